"""The batcher's book of one run: its batches being filled (Batch), and
which batches it has sent and laid out ahead (BatcherRun); and what it
sends main (ToMain).  The batcher itself is in batcher/batcher.py."""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

import shmq
from shmq import sync
from loader.shared import control as _control
from loader.order import indices as _order
from loader.shared import messages as _protocol
from loader.order.progress import stream_skips
from loader.shared.memory import SharedState, batch_ready_wire
from loader.shared.spec import LoaderSpec


class WaitingBatches:
    """The batches waiting for memory or for their table entry, as (run,
    batch), and who may take memory while they wait.

    NOTE [ Memory goes to batches in order ]
    A batch may not take memory while a batch before it (an older live
    run's, or one of its own run with a lower number) waits, or, to be
    laid out ahead, while an older live run has batches still to lay out
    (Batcher._older_run_first).  A later batch holding the pool's memory
    can keep it from the earlier one for good: main delivers in order, and
    the workers that claimed the earlier batch's positions wait for its
    slab before they claim more, so a batch laid out ahead may never be
    filled (with a pool of one batch, the next epoch's first batch laid out
    ahead, or the next batch while this one waited, stalled the loader
    until its timeout).

    That rule alone does not cover memory a batch asks for *after* later
    batches took theirs: a batch laid out again (a provisional layout of
    the wrong shape, or dtypes promoted by a later row) or a layout
    request that arrives after the next batch's.  So the first batch
    waiting for memory takes it back from later batches (Batcher._make_room):
    from the latest on, each is *parked* (Parked: its counted rows copied
    into the batcher's own memory, its slab retired, its entry left
    unpublished, so its workers wait) until what is free, retired or
    parked holds the waiting batch in one piece.  A parked batch waits in
    turn, and gets a slab and its rows back when memory comes to it.
    Batches are never parked for a batch after them, so every wait ends:
    a worker places its rows batch after batch, so no batch before a
    parked one needs a row from a worker waiting for it (except within a
    worker's shuffle window, whose batches are never parked for one
    another: the pool must hold that window, slabs.never_fits).  A batch
    laid out again when memory is short gives its own slab back first (its
    rows parked, or none counted), so a batch never needs room for two:
    a pool that holds its largest batch never waits for ever, and a smaller
    one is a MemoryError naming both sizes.

    The rest of the memory a waiting batch needs comes back from main,
    which moves out what it holds back (NOTE [ Kept batch memory ] in
    native/leases.pxi), from batches before it, which complete, and from retired
    slabs, never from later batches, so waiting behind it is safe.  Runs
    main ended are not waited for."""

    def __init__(self, control):
        self.control = control
        self.items: list[tuple[int, int]] = []
        self.need: dict[tuple[int, int], int] = {}  # those waiting for memory -> the bytes

    def __bool__(self) -> bool:
        return bool(self.items)

    def add(self, run: int, batch: int, need_bytes: int | None = None) -> None:
        """need_bytes: the slab it waits for (None: it waits for its table entry)."""
        if (run, batch) not in self.items:
            self.items.append((run, batch))
        if need_bytes is not None:
            self.need[run, batch] = need_bytes

    def drop(self, run: int, batch: int | None = None) -> None:
        """Forget a batch, or (batch None) every batch of the run."""
        self.items = [(r, i) for r, i in self.items
                      if r != run or (batch is not None and i != batch)]
        self.need = {k: n for k, n in self.need.items() if k in self.items}

    def take(self) -> list[tuple[int, int]]:
        """All of them, in the order memory goes to them; the book is empty
        until those that still cannot proceed are added again."""
        items, self.items, self.need = sorted(self.items), [], {}
        return items

    def first_for_memory(self) -> tuple[tuple[int, int], int] | None:
        """((run, batch), bytes) of the first batch of a live run that waits
        for memory, if it is the first of all that wait (one waiting for
        its table entry comes first: memory would not let it go on)."""
        live = sorted(k for k in self.items if self.control.live(k[0]))
        if not live or live[0] not in self.need:
            return None
        return live[0], self.need[live[0]]

    def before(self, run: int, batch: int) -> bool:
        """A batch of a live run before (run, batch) waits: this one may not
        take memory (NOTE [ Memory goes to batches in order ])."""
        return any((r, i) < (run, batch) and self.control.live(r) for r, i in self.items)


class Batch:
    """A batch being filled.  It is *published* while it owns its table
    entry; its layout is *confirmed* once it came from a sample of this
    batch (else it is a guess from earlier batches)."""

    __slots__ = ("index", "rows", "batched", "layout", "slab", "version", "confirmed", "published",
                 "refused", "counted", "values", "wanted", "held_rows", "parked")

    def __init__(self, index, rows, batched):
        self.index, self.rows, self.batched = index, rows, batched
        self.layout = self.slab = None
        self.version = 0
        self.confirmed = self.published = self.refused = self.counted = False
        self.values: dict[int, list] = {}   # row -> its non-numeric leaves
        self.wanted = None      # a signature waiting for memory (or for the table entry)
        self.held_rows = []     # SampleRow messages waiting for memory to promote the batch
        self.parked: Parked | None = None  # its rows, while it waits for a slab to put them in


class Parked(NamedTuple):
    """A batch's rows set aside while it waits for a slab (NOTE [ Memory
    goes to batches in order ]): a copy of what its old slab held."""
    layout: object              # the Layout they were written in
    data: np.ndarray | None     # the old slab's bytes; None when no row was counted
    counted: int                # rows counted when it was parked
    confirmed: bool             # its layout came from a sample of the batch


def parked_rows(arena: np.ndarray, b: Batch, counted: int) -> Parked:
    """b's rows, copied out of its slab into the batcher's own memory."""
    data = None
    if counted:
        data = arena[b.slab.offset:b.slab.offset + b.layout.nbytes].copy()
    return Parked(b.layout, data, counted, b.confirmed)


def copy_rows(layout, dst: np.ndarray, old_layout, src: np.ndarray) -> None:
    """A batch's rows into its new slab: byte for byte in the same layout,
    else leaf by leaf with the safe casts of a promotion.  Every row: those
    not counted are written again."""
    if layout.digest == old_layout.digest:
        dst[...] = src
        return
    for d, s in zip(layout.views(dst), old_layout.views(src)):
        if d is not None:
            d[...] = s
    layout.tags(dst)[...] = old_layout.tags(src)


class BatcherRun:
    """One run, from the batcher's side.  It lives until every worker has
    said Done for it, even after main abandoned it: until then a worker may
    still write into its slabs."""

    def __init__(self, run: int, control: _control.Control, cfg: LoaderSpec, shared: SharedState):
        self.run = run
        self.control = control
        self.iterable = cfg.iterable
        self.per_batch = cfg.per_batch
        self.claims_batches = cfg.claims_batches
        self.workers = cfg.streams
        self.B = cfg.rows
        if self.iterable:
            self.nbatches = None
            self.batches = None
        else:
            kept = control.read(run, _control.KEPT)
            self.nbatches = control.read(run, _control.NBATCHES)
            if control.read(run, _control.OFFSETS) == _order.OFFSETS_STREAMED:
                # a streamed batch sampler's (NOTE [ Runs ])
                open_positions = _order.OPEN_POSITIONS
                _, stored = shared.read_order(run, open_positions, open_positions, True)
                self.batches = _order.StreamedBatches(stored, lambda: control.kept(run),
                                                      lambda: control.nbatches(run))
            elif control.read(run, _control.OPEN):  # its length is learnt late (NOTE [ Runs ])
                self.batches = _order.OpenBatches(self.B, lambda: control.kept(run))
            else:
                self.batches = _order.Batches(kept, self.B)
        self.open_ended = not self.iterable and (
            bool(control.read(run, _control.OPEN))
            or control.read(run, _control.OFFSETS) == _order.OFFSETS_STREAMED)
        self.open: dict[int, Batch] = {}
        # map-style: batches below lo, and those in `finished`, are sent
        self.lo, self.finished = 0, set()
        # iterable: per worker's stream, its batch numbers below low[w] are
        # all sent, and those in above[w] too (a shuffle buffer completes
        # batches out of order).  A resumed run's streams start past the
        # batches delivered before (see NOTE [ Runs ]).
        self.low = [0] * self.workers
        self.above: list[set] = [set() for _ in range(self.workers)]
        if self.iterable and control.read(run, _control.ORDER) == _order.ORDER_SHIPPED:
            words, _ = shared.read_order(run, control.read(run, _control.KEPT), 0, False)
            self.low = [stream_skips(words, self.workers, w)[0] for w in range(self.workers)]
        self.given_up: dict[int, Batch] = {}  # map-style: batches given up, entry still held
        self.expected: set[int] = set(range(self.workers))  # workers whose Done it waits for
        self.done: dict[int, _protocol.Done] = {}  # workers that said Done, not yet settled
        self.settled: set[int] = set()     # workers whose batches are all sent or freed
        self.sent = self.samples = self.rows_by_batcher = self.relayouts = 0
        self.peak_slab_bytes = 0
        self.refused_window = False  # memory_cap_bytes cannot hold the shuffle windows
        self.ended = False

    def rows_of(self, index: int) -> int:
        if self.per_batch:
            return 1
        if self.iterable:  # full until the stream ends (then trimmed)
            return self.B
        return self.batches.rows(index)

    def worker_of(self, index: int) -> int:
        """Iterable runs: the worker whose stream fills batch `index`."""
        return index % self.workers

    def sent_stream_batch(self, index: int) -> None:
        w, j = index % self.workers, index // self.workers
        self.above[w].add(j)
        while self.low[w] in self.above[w]:
            self.above[w].remove(self.low[w])
            self.low[w] += 1

    def stream_end(self, w: int) -> tuple[int, tuple]:
        """(batch numbers end, those below it never sent) of worker w's
        stream, for StreamEnded."""
        end = max(self.above[w], default=self.low[w] - 1) + 1
        return max(end, self.low[w]), tuple(j for j in range(self.low[w], end)
                                            if j not in self.above[w])

    def ahead(self, window: int):
        """Batches to lay out ahead of the workers: `window` past those sent
        (per worker's stream for an iterable run)."""
        if self.iterable:  # in batch order across the streams: memory goes in order
            yield from sorted(j * self.workers + w for w in range(self.workers)
                              if w not in self.done and w not in self.settled
                              for j in range(self.low[w], self.low[w] + window)
                              if j not in self.above[w])
            return
        loadable = self.loadable_batches()
        if loadable == 0:  # (a run started ahead whose turn has not come)
            return
        if self.open_ended:  # none past LIMIT: the next may be a short last batch, unknown yet
            yield from range(self.lo, min(self.sent + window, self.batches.count, loadable))
            return
        yield from range(self.lo, min(self.sent + window, self.nbatches, loadable + 1))

    def to_lay_out(self, window: int) -> bool:
        """A batch waits for memory, or one is still to be laid out."""
        return not self.ended and (
            any(not b.published for b in self.open.values())
            or any(i not in self.open and i not in self.finished for i in self.ahead(window)))

    def loadable_batches(self) -> int:
        """Batches below main's LIMIT, which workers may load now.  One past
        them is laid out too, ready when the limit rises; a slab for any
        further would only wait, so the pool holds at most `prefetch` + 1
        batches beyond those the training loop holds.  None while LIMIT is
        0: a slab laid out ahead that no worker may fill would keep memory
        an older run waits for."""
        # SYNC POINT: acquire load; main's store of LIMIT (Control.set_limit) pairs with it.
        limit = sync.atomic_load(self.control.ctl, _control.word(self.run, _control.LIMIT))
        if self.claims_batches or limit <= 0:
            return max(limit, 0)
        return self.batches.locate(min(limit, self.batches.kept) - 1)[0] + 1


def closed_up(arena: np.ndarray, batches: list, drop_last: bool):
    """A shuffle buffer's last batches of one stream have rows here and
    there (holes are tagged -1): move their rows to the front, batch by
    batch in order, among batches of the same layout.  Yields (batch, rows
    to send, or None: drop it): the full batches and a last short one
    (unless drop_last).  The only second copy of a sample, and only at the
    end of a stream."""
    groups: dict = {}
    for b in batches:
        if b.published and not b.refused:
            groups.setdefault(b.layout.digest, []).append(b)
    for group in groups.values():
        per_batch = group[0].layout.rows
        full, short = divmod(pack_rows(arena, group), per_batch)
        for k, b in enumerate(group):
            if k < full:
                yield b, per_batch
            else:
                yield b, short if k == full and short and not drop_last else None


def pack_rows(arena: np.ndarray, group: list) -> int:
    """Move the rows of a group of batches of one layout to the front, in
    order (the batcher closing up a shuffle buffer's last batches);
    returns how many rows there are."""
    layout = group[0].layout
    slabs = [arena[b.slab.offset:b.slab.offset + layout.nbytes] for b in group]
    views = [layout.views(s) for s in slabs]
    tags = [layout.tags(s) for s in slabs]
    sources = [(k, r) for k, t in enumerate(tags) for r in np.flatnonzero(t >= 0)]
    for i, (k, r) in enumerate(sources):  # target i is never a source not yet moved
        tk, tr = divmod(i, layout.rows)
        if (tk, tr) == (k, r):
            continue
        for dst, src in zip(views[tk], views[k]):
            if dst is not None:
                dst[tr] = src[r]
        tags[tk][tr] = tags[k][r]
        if layout.value_leaves and r in group[k].values:
            group[tk].values[tr] = group[k].values.pop(r)
    return len(sources)


class ToMain:
    """The batcher's messages to main, never blocking: what main's ring
    cannot take waits in the outbox (OUTBOX says so), and main rings the
    batcher's bell when it has made room."""

    def __init__(self, shared: SharedState):
        self.control, self.ring = shared.control, shared.to_main
        self.outbox: collections.deque = collections.deque()  # encoded (put_encoded)
        self.spill = shared.spill_writer(shared.batcher_region)  # NOTE [ Spilled messages ]

    def send(self, msg) -> None:
        if self.spill is None:  # threads: the ring takes anything at once
            self.ring.put(msg, timeout=0)
            return
        if type(msg) is _protocol.BatchReady:  # main unpickles it on every batch: the cheap form
            msg = batch_ready_wire(msg)
        encoded = self.spill.encoded(msg)
        if not self.outbox:
            try:
                self.ring.put_encoded(*encoded, timeout=0)
                return
            except shmq.Full:
                pass
        self.outbox.append(encoded)
        sync.atomic_store(self.control.ctl, _control.OUTBOX, 1)

    def flush(self) -> bool:
        """Move what the ring takes; True if something moved."""
        moved = False
        while self.outbox:
            try:
                self.ring.put_encoded(*self.outbox[0], timeout=0)
            except shmq.Full:
                return moved
            self.outbox.popleft()
            moved = True
        if moved:
            sync.atomic_store(self.control.ctl, _control.OUTBOX, 0)
        return moved
