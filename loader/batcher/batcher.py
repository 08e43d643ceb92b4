"""The batcher process: lays out batch slabs, publishes them for the
workers' direct writes, and tells main when a batch is complete.  See
NOTE [ ShmLoader processes and shutdown ] in shared/messages.py and NOTE [ Direct
row writes ] in shared/table.py.  Its loop never blocks: it takes messages
without waiting and sleeps only on its bell."""

from __future__ import annotations

import os

import shmq
from shmq import sync
from loader.shared import control as _control
from loader.shared import messages as _protocol
from loader.batcher.runs import (
    Batch,
    BatcherRun,
    ToMain,
    WaitingBatches,
    closed_up,
    copy_rows,
    parked_rows,
)
from loader.shared.layout import (
    LayoutCache,
    castable,
    misfit,
    promoted,
    signature_and_leaves,
)
from loader.shared.memory import SharedState
from loader.shared.spec import LoaderSpec
from loader.batcher.slabs import Slab, SlabAllocator, never_fits, slab_bytes
from loader.main.stats import WaitClock
from loader.shared.table import CONFIRMED, REFUSED, count_of
from loader.shared.trace import ROLE_BATCHER, now, tracer_of
from loader.batcher.warmup import ArenaWarmer

DRAIN_BATCH = 256  # messages handled between looks at runs, memory and the outbox


class Batcher:
    def __init__(self, cfg: LoaderSpec, shared: SharedState):
        self.cfg, self.shared = cfg, shared
        self.control, self.table, self.arena = shared.control, shared.table, shared.arena
        self.inbox = shared.to_batcher
        self.to_main = ToMain(shared)  # never blocks: an outbox behind the ring
        # Slabs the warm-up covers: NOTE [ Warming the arena ] in native/warm.pxi
        self.slabs = SlabAllocator(shared.arena, shared.released, shared.hazards,
                                   cfg.slabs_in_flight)
        self.warmer = ArenaWarmer(shared.warm_fd, shared.arena.nbytes)
        self.passes: dict[int, BatcherRun] = {}
        self.known_run = 0
        self.joined: dict[int, int] = {}  # workers added while running -> their first run
        self.taken: dict[int, tuple[int, int]] = {}   # table entry -> (run, batch) published there
        self.layouts = LayoutCache()
        self.guess = None              # signature of the latest batch's layout
        self.waiting = WaitingBatches(self.control)  # for memory or a table entry
        self.told_memory_wait = False
        self.early = None              # a message taken while checking whether to sleep
        self.freed = False             # memory was reclaimed while checking whether to sleep
        self.pid = os.getpid()
        self.clock = WaitClock(shared.waited, len(shared.waited) - 1)  # NOTE [ Wait clocks ]
        self.tracer = tracer_of(cfg.trace, ROLE_BATCHER)  # NOTE [ Trace records ]
        self.laid_out: dict = {}  # (run, batch) -> when first published, for the trace

    # --- loop ---------------------------------------------------------------------

    def run(self) -> None:
        c = self.control
        while not c.stopped:
            self.to_main.flush()
            self._look_at_runs()
            if self.waiting and (self.slabs.reclaim() or self.freed):
                self._retry_waiting()
            self.freed = False
            if self.waiting and self._make_room():
                self._retry_waiting()
            for p in list(self.passes.values()):
                if p.done:  # Done messages whose batches waited for memory
                    self._settle(p)
            if self._drain():
                continue
            self._sleep()

    def _drain(self) -> bool:
        """Handle up to DRAIN_BATCH messages; True if there were any."""
        handled = 0
        while handled < DRAIN_BATCH:
            msg = self._take()
            if msg is None:
                break
            self._handle(msg)
            handled += 1
        return handled > 0

    def _take(self):
        if self.early is not None:
            msg, self.early = self.early, None
            return msg
        try:
            # get (a copy), never get_view: a message may hold arrays (a
            # SampleRow, objects among a row's values) that the batcher keeps
            # after the ring reuses their memory.
            return self.shared.receive(self.inbox.get(timeout=0))
        except shmq.Empty:
            return None
        except shmq.PeerLost:
            return None  # a worker died mid-write; main sees its exit status and reports it

    def _sleep(self) -> None:
        c = self.control

        def ready():
            if c.stopped or c.latest_run() > self.known_run:
                return True
            if self.early is None:
                self.early = self._take()
            if self.early is not None:
                return True
            if self.to_main.outbox and self.to_main.flush():
                return True
            if self.waiting and self.slabs.reclaim():
                self.freed = True
            return self.freed

        self.clock.begin()
        try:
            if not c.batcher_bell.wait(ready, _protocol.IDLE_SLICE_S):
                _control.exit_if_orphaned(self.cfg.parent_pid)
        finally:
            self.clock.end()

    def _send(self, msg) -> None:
        self.to_main.send(msg)

    def _fail(self, exc: BaseException, note: str, *, run: int, batch: int | None,
              pos: int | None, ends_run: bool = False, given_up: bool = False) -> None:
        """given_up: the batch will never come, and main is told which it
        is in first-ready mode too (it counts it as handed out)."""
        if not (self.cfg.in_order or given_up):
            batch = None
        self._send(_protocol.Failed(run=run, batch=batch, pos=pos, index=None, worker=None,
                                    pid=self.pid, ends_run=ends_run,
                                    error=_protocol.ErrorReport.of(exc, note)))

    # --- runs -----------------------------------------------------------------------

    def _look_at_runs(self) -> None:
        latest = self.control.latest_run()
        while self.known_run < latest:
            self.known_run += 1
            p = self.passes[self.known_run] = BatcherRun(self.known_run, self.control, self.cfg,
                                                          self.shared)
            p.expected |= {w for w, first in self.joined.items() if first <= p.run}
            self.tracer.run_started(now(), run=p.run,
                                    epoch=self.control.read(p.run, _control.EPOCH))
            self._publish_ahead(p)

    def _pass(self, run: int) -> BatcherRun:
        if run > self.known_run:
            self._look_at_runs()  # a worker saw the run before we did
        return self.passes[run]   # a run's messages all come before its workers' Done

    def _settle(self, p: BatcherRun) -> None:
        """Act on the Done messages of workers whose batches no longer wait
        for anything (memory, a table entry): iterable runs send or free
        each such worker's last batches; once every worker is settled,
        the run ends."""
        if p.done and not self.control.live(p.run):
            # Main ended the run and reads none of its batches: those waiting
            # for memory wait no more (the memory may be what a newer run needs).
            for b in p.open.values():
                b.wanted, b.held_rows, b.parked = None, [], None
            self.waiting.drop(p.run)
        for w in list(p.done):
            mine = [b for b in p.open.values() if not p.iterable or p.worker_of(b.index) == w]
            if p.iterable or p.settled | set(p.done) >= p.expected:
                self._stop_waiting_for_rows(p, mine)
            if any(b.wanted is not None or b.held_rows for b in mine):
                continue  # settled later: see run()
            done = p.done.pop(w)
            p.settled.add(w)
            if p.iterable:
                self._end_stream(p, w, done, mine)
        if p.settled >= p.expected and not p.ended:
            self._end_pass(p)

    def _stop_waiting_for_rows(self, p: BatcherRun, batches: list) -> None:
        """Batches no worker writes into any more: one waiting for memory
        with no row to keep (laid out ahead, then parked for an earlier
        batch) waits no more; it is dropped with the rest (the memory it
        waits for may be held by batches that wait for it to settle)."""
        for b in batches:
            if (b.wanted is not None and not b.held_rows and not b.published
                    and (b.parked is None or not b.parked.counted)):
                b.wanted = b.parked = None
                self.waiting.drop(p.run, b.index)

    def _end_stream(self, p: BatcherRun, w: int, done: _protocol.Done, mine: list) -> None:
        """Worker w's stream of an iterable run ended: send its short last
        batch, or close up the holes of a shuffle buffer's last batches
        (unless drop_last), free what it will never fill, and tell main
        which of its batches there are."""
        mine = sorted(mine, key=lambda b: b.index)
        end = done.stream_end
        if end.holes_to_close:
            for b, rows in closed_up(self.arena, mine, self.cfg.drop_last):
                if rows:
                    self._finish(p, b, rows)
                else:
                    self._drop(p, b)
            mine = [b for b in mine if b.index in p.open]
        for b in mine:
            rows = count_of(self.table.filled_word(p.run, b.index)) if b.published else 0
            if (b.index == end.last_batch and rows == end.last_rows and not self.cfg.drop_last
                    and not b.refused and self._values_complete(b, rows)):
                self._finish(p, b, rows)
            else:
                self._drop(p, b)
        end, dropped = p.stream_end(w)
        self._send(_protocol.StreamEnded(p.run, w, end, dropped))

    def _values_complete(self, b: Batch, rows: int) -> bool:
        return not b.layout.value_leaves or all(r in b.values for r in range(rows))

    def _drop(self, p: BatcherRun, b: Batch) -> None:
        """A batch that will not be sent: no worker writes into it any more."""
        del p.open[b.index]
        self._unpublish(p, b)
        self._forget_values(b)
        if b.slab is not None:
            self.slabs.release(b.slab.lease)

    def _end_pass(self, p: BatcherRun) -> None:
        """Every worker is done: in first-ready mode send what is left of a
        partial batch (rows fill in arrival order, so the counted rows are
        a complete prefix; it is short when samples failed), free the
        rest, and tell main."""
        p.ended = True
        for b in p.given_up.values():  # every worker is done: no row comes for them
            self._unpublish(p, b)
        p.given_up.clear()
        arrival_order = not self.cfg.in_order and not p.iterable
        for b in sorted(p.open.values(), key=lambda b: b.index):
            rows = count_of(self.table.filled_word(p.run, b.index)) if b.published else 0
            if (rows and arrival_order and not self.cfg.drop_last and not b.refused
                    and self._values_complete(b, rows)):
                self._finish(p, b, rows)
            else:
                self._drop(p, b)
        self.waiting.drop(p.run)
        del self.passes[p.run]
        self.tracer.run_ended(p.run, self.laid_out)
        self._send(_protocol.RunEnded(run=p.run, batches=p.sent, samples=p.samples,
                                      rows_by_batcher=p.rows_by_batcher, relayouts=p.relayouts,
                                      peak_slab_bytes=p.peak_slab_bytes))

    # --- layouts, slabs and the table --------------------------------------------------

    def _allocate(self, p: BatcherRun, b: Batch, nbytes: int) -> Slab | None:
        """A slab, or None: then (run, batch) waits in self.waiting (the
        caller refused what the pool can never hold: _cannot_fit)."""
        nbytes = slab_bytes(nbytes)
        slab = None if self.waiting.before(p.run, b.index) else self._take_slab(nbytes)
        if slab is None:
            self.waiting.add(p.run, b.index, nbytes)
            # A level, not only the message: main may hand out the batch
            # that holds the memory only after it saw MemoryWait.
            sync.atomic_store(self.control.ctl, _control.MEMORY_WAIT, 1)
            if not self.told_memory_wait:
                self.told_memory_wait = True
                self._send(_protocol.MemoryWait(self.slabs.held_bytes, self.slabs.capacity,
                                                len(self.slabs.live), nbytes))
        return slab

    def _cannot_fit(self, p: BatcherRun, b: Batch, layout) -> bool:
        """Refuse a batch the pool can never hold in `layout`
        (slabs.never_fits): the batch, or the whole run (main raises it at
        once and at every next() of the run; its workers wait until main
        ends it)."""
        nbytes = slab_bytes(layout.nbytes)
        error, whole_run = never_fits(self.cfg, b.index, nbytes, self.slabs.capacity)
        if error is None:
            return False
        self._refuse(p, b, None, error, whole_run=whole_run)
        return True

    def _older_run_first(self, p: BatcherRun) -> bool:
        """NOTE [ Memory goes to batches in order ] in batcher/runs.py."""
        return any(q.run < p.run and self.control.live(q.run)
                   and q.to_lay_out(self.cfg.publish_window) for q in self.passes.values())

    def _take_slab(self, nbytes: int) -> Slab | None:
        slab = self.slabs.allocate(nbytes)
        if slab is not None:
            for p in self.passes.values():  # every run going on sees the pool's use
                p.peak_slab_bytes = max(p.peak_slab_bytes, self.slabs.in_use)
            self.tracer.pool(now(), in_use=self.slabs.in_use, capacity=self.slabs.capacity)
            self.warmer.want(self.slabs.warm_target)
        return slab

    def _retry_waiting(self) -> None:
        self.told_memory_wait = False
        for run, index in self.waiting.take():
            p = self.passes.get(run)
            b = None if p is None else p.open.get(index)
            if b is None:
                continue
            if b.wanted is not None:
                sig, b.wanted = b.wanted, None
                self._lay_out(p, b, sig)
            held, b.held_rows = b.held_rows, []
            for msg in held:
                self._sample_row(p, msg)
            if p.open.get(index) is b:
                self._finish_if_complete(p, b)  # its rows were all counted when it was parked
        if not self.waiting:
            sync.atomic_store(self.control.ctl, _control.MEMORY_WAIT, 0)

    def _entry_free(self, p: BatcherRun, b: Batch) -> bool:
        entry = self.table.entry(p.run, b.index)
        owner = self.taken.get(entry)
        if owner is not None and owner != (p.run, b.index):
            q = self.passes.get(owner[0])
            if q is not None and owner[1] in q.given_up and owner[1] < q.lo:
                # given up, and below FINISHED: no worker writes into it any more
                self._drop_given_up(q, q.given_up.pop(owner[1]))
                owner = None
        return owner is None or owner == (p.run, b.index)

    def _give_up(self, p: BatcherRun, index: int) -> None:
        """A map-style run's batch that will never be sent (a sample of it
        failed, or it cannot be collated): it counts as finished, so the
        FINISHED word passes it and workers drop its rows; its entry and
        slab are freed once FINISHED has passed it (_entry_free, and at
        the end of the run)."""
        if index < p.lo or index in p.finished:
            return
        b = p.open.pop(index, None)
        if b is not None:
            self._forget_values(b)
            b.parked = None
            if b.published:
                self.table.add_flags(p.run, b.index, REFUSED)  # writers drop their rows now
                self._retire_refused(b)
                p.given_up[index] = b
            self.waiting.drop(p.run, index)
        p.finished.add(index)
        self._advance(p)

    def _drop_given_up(self, p: BatcherRun, b: Batch) -> None:
        self._unpublish(p, b)

    def _retire_refused(self, b: Batch) -> None:
        """A batch whose entry says REFUSED: no worker writes into its slab
        any more, so batches waiting for memory need not wait for its
        entry to go (a worker may be inside it: freed once no hazard
        names it).  Its entry stays, so that its workers drop their rows."""
        if b.slab is not None:
            self.slabs.retire(b.slab.lease)
            b.slab = None

    def _advance(self, p: BatcherRun) -> None:
        """Move the run's finished prefix, and tell the workers (FINISHED)."""
        moved = False
        while p.lo in p.finished:
            p.finished.remove(p.lo)
            p.lo += 1
            moved = True
        if moved:
            finished = _control.word(p.run, _control.FINISHED)
            sync.atomic_store(self.control.ctl, finished, p.lo)  # SYNC POINT
            self.control.table_bell.ring()  # workers waiting for a batch given up

    def _lay_out(self, p: BatcherRun, b: Batch, sig) -> bool:
        """Give b a slab with sig's layout and publish it: its first layout,
        a provisional one replaced, or the one its parked rows go back
        into.  False if it must wait for memory or for its table entry."""
        if not self._entry_free(p, b):
            b.wanted = sig
            self.waiting.add(p.run, b.index)
            return False
        layout = self.layouts.get(sig, b.rows, b.batched)
        if self._cannot_fit(p, b, layout):
            b.wanted = None
            return False
        if b.published and not self._replace_provisional(p, b):
            return True
        slab = self._allocate(p, b, layout.nbytes)
        if slab is None:
            b.wanted = sig
            return False
        parked, b.parked = b.parked, None
        b.layout, b.slab = layout, slab
        if parked is None or parked.data is None:
            self._mark_holes(b)
            self._forget_values(b)  # rows' values are re-sent by their writers after a relayout
        else:
            copy_rows(layout, self._slab_view(b), parked.layout, parked.data)
        counted = 0 if parked is None else parked.counted
        # A layout a sample asked for, or one rows were counted in or promoted to, is confirmed
        b.confirmed = (parked is None or parked.confirmed or counted > 0
                       or layout.digest != parked.layout.digest)
        self._publish(p, b, counted)
        return True

    def _replace_provisional(self, p: BatcherRun, b: Batch) -> bool:
        """Give up b's provisional layout if no row is counted: True, and b
        waits for its new slab unpublished (its old one retired first, so
        a batch laid out again never needs room for two).  Else the layout
        stands, confirmed (a worker whose sample differs sends it whole):
        False."""
        if not self.table.replace_if_uncounted(p.run, b.index):
            b.confirmed = True
            self.control.table_bell.ring()
            return False
        b.version += 1
        p.relayouts += 1
        self._set_aside(p, b)
        return True

    def _set_aside(self, p: BatcherRun, b: Batch) -> None:
        """b's entry was unpublished by a version bump (no count of its old
        version succeeds): its slab is retired (a worker may be inside it)
        and the entry given up until b is laid out again."""
        self.slabs.retire(b.slab.lease)
        b.slab = None
        del self.taken[self.table.entry(p.run, b.index)]
        b.published = False
        self.control.table_bell.ring()

    def _park(self, p: BatcherRun, b: Batch) -> None:
        """Copy b's counted rows into the batcher's own memory and give its
        slab back; it waits to be laid out again with them (NOTE [ Memory
        goes to batches in order ] in batcher/runs.py)."""
        counted = self.table.freeze(p.run, b.index)
        b.version += 1
        b.parked = parked_rows(self.arena, b, counted)
        b.counted = counted == b.rows
        self._set_aside(p, b)

    def _make_room(self) -> bool:
        """The first batch waiting for memory takes it back from later
        batches: park them, latest first, until what is free, retired or
        parked holds it (NOTE [ Memory goes to batches in order ] in
        batcher/runs.py).  True if it fits now (the batch it waited
        behind went without taking memory): try again."""
        first = self.waiting.first_for_memory()
        if first is None or first[0][0] not in self.passes:
            return False
        (run, index), need = first
        if self.slabs.fits_now(need):
            return True
        freed = []
        for q, b in self._later_holders(run, index):
            if self.slabs.fits(need, freed):
                break
            freed.append(b.slab)
            nbytes = b.slab.nbytes
            self._park(q, b)
            b.wanted = b.layout.signature
            self.waiting.add(q.run, b.index, nbytes)
        return False

    def _later_holders(self, run: int, index: int) -> list:
        """(run, batch) of the batches after batch `index` of run `run` that
        hold a slab and may be parked, latest first: published, of a live
        run, neither refused nor complete (that one goes to main, which
        moves it out if it holds it back), nor in the shuffle window that
        batch `index` may share (its worker places rows into both at once)."""
        found = []
        for q in self.passes.values():
            if q.run < run or not self.control.live(q.run):
                continue
            for b in q.open.values():
                if ((q.run, b.index) <= (run, index) or not b.published or b.refused or b.counted
                        or (q.run == run and self._same_window(q, index, b.index))
                        or count_of(self.table.filled_word(q.run, b.index)) == b.rows):
                    continue
                found.append((q, b))
        found.sort(key=lambda qb: (qb[0].run, qb[1].index), reverse=True)
        return found

    def _same_window(self, p: BatcherRun, first: int, later: int) -> bool:
        """Whether a worker may place rows into batch `later` before batch
        `first` has all its rows: a shuffle buffer's window spans
        shuffle_batches of its stream from its lowest incomplete batch (at
        most `first`; StreamSlots)."""
        return (p.iterable and p.worker_of(first) == p.worker_of(later)
                and later // p.workers < first // p.workers + self.cfg.shuffle_batches)

    def _slab_view(self, b: Batch):
        return self.arena[b.slab.offset:b.slab.offset + b.layout.nbytes]

    def _publish(self, p: BatcherRun, b: Batch, count: int = 0) -> None:
        flags = (CONFIRMED if b.confirmed else 0) | (REFUSED if b.refused else 0)
        self.table.publish(p.run, b.index, b.slab.offset, b.slab.token, b.layout, b.version, flags,
                           count)
        self.taken[self.table.entry(p.run, b.index)] = (p.run, b.index)
        b.published = True
        self.tracer.batch_laid_out(p.run, b.index, self.laid_out)
        self.control.table_bell.ring()

    def _unpublish(self, p: BatcherRun, b: Batch) -> None:
        if b.published:
            self.table.unpublish(p.run, b.index)
            del self.taken[self.table.entry(p.run, b.index)]
            b.published = False
            self.control.table_bell.ring()

    def _publish_ahead(self, p: BatcherRun) -> None:
        """Lay out the next batches with the latest layout, so workers can
        write their rows without asking (NOTE [ Direct row writes ])."""
        if (self.guess is None or p.ended or not self.control.live(p.run)
                or self._older_run_first(p)):
            return  # (main reads none of a run it ended; an older run comes first)
        for index in p.ahead(self.cfg.publish_window):
            if self.waiting.before(p.run, index):
                return  # and every later one: NOTE [ Memory goes to batches in order ]
            if index in p.open or index in p.finished:
                continue
            b = Batch(index, p.rows_of(index), not p.per_batch)
            if not self._entry_free(p, b):
                continue
            layout = self.layouts.get(self.guess, b.rows, b.batched)
            slab = self._take_slab(layout.nbytes)
            if slab is None:
                return  # memory is short: batches wait for it when a sample asks
            b.layout, b.slab = layout, slab
            self._mark_holes(b)
            p.open[index] = b
            self._publish(p, b)

    def _mark_holes(self, b: Batch) -> None:
        """A fresh slab of a shuffle buffer's batch: every row's tag says
        "not written" (-1), so that its holes can be found (closed_up)."""
        if self.cfg.shuffle_batches:
            b.layout.tags(self.arena[b.slab.offset:b.slab.offset + b.layout.nbytes])[:] = -1

    # --- messages -------------------------------------------------------------------------

    def _handle(self, msg) -> None:
        kind = type(msg)
        if kind is _protocol.Failed:
            self._send(msg)
            p = self.passes.get(msg.run)
            if p is not None and msg.batch is not None and not p.iterable:
                self._give_up(p, msg.batch)  # main raises its error and goes on
            return
        if kind is _protocol.DatasetState:
            # main keeps it, and has it before the sender's batches (NOTE
            # [ Datasets that keep their own state ] in datasets/own_state.py)
            self._send(msg)
            return
        if kind is _protocol.Joined:  # num_workers="auto" added a worker: its Done counts too
            self._look_at_runs()
            self.joined[msg.worker] = msg.first_run
            for q in self.passes.values():
                if q.run >= msg.first_run:
                    q.expected.add(msg.worker)
            return
        if msg.run <= self.known_run and msg.run not in self.passes:
            # a run that ended before a worker added late said Done for it,
            # or a row's values arriving after the run ended
            if kind is _protocol.RowValues:
                self.shared.free_values(msg.values)
            return
        p = self._pass(msg.run)
        if kind is _protocol.Done:
            p.done[msg.worker] = msg
            self._settle(p)
            return
        try:
            if kind is _protocol.RowValues:
                self._row_values(p, msg)
            elif kind is _protocol.Filled:
                b = p.open.get(msg.batch)
                if b is not None:
                    b.counted = True
                    self._finish_if_complete(p, b)
            elif kind is _protocol.LayoutRequest:
                self._layout_request(p, msg)
            elif kind is _protocol.SampleRow:
                self._sample_row(p, msg)
        except Exception as e:
            self._fail(e, f"in the batcher, handling {kind.__name__}", run=p.run,
                       batch=msg.batch, pos=getattr(msg, "pos", None))

    def _layout_request(self, p: BatcherRun, m: _protocol.LayoutRequest) -> None:
        b = p.open.get(m.batch)
        if b is None:
            if m.batch < p.lo or m.batch in p.finished or p.ended:  # sent or given up
                return
            b = p.open[m.batch] = Batch(m.batch, m.rows, m.batched)
            self._lay_out(p, b, m.signature)
            return
        if not b.published:
            # (one waiting for memory, parked too, is laid out when memory comes)
            if b.wanted is None and not b.refused:
                b.wanted = m.signature
                self._lay_out(p, b, m.signature)
            return
        if (m.version == _protocol.NO_VERSION or m.version != b.version or b.confirmed
                or b.refused):
            return  # the entry changed since the worker looked: it looks again
        self._lay_out(p, b, m.signature)

    def _row_values(self, p: BatcherRun, m: _protocol.RowValues) -> None:
        b = p.open.get(m.batch)
        if b is None or b.layout is None or m.values_key != b.layout.values_key:
            # given up, or written into a layout replaced since (its writer
            # sends them again)
            self.shared.free_values(m.values)
            return
        self.shared.free_values(b.values.get(m.row))
        b.values[m.row] = m.values
        self._finish_if_complete(p, b)

    def _forget_values(self, b: Batch, keep: int = 0) -> None:
        """Free the values of b's rows from `keep` on: they will not be
        sent (a row's values may be a block of the spill heap)."""
        for r in [r for r in b.values if r >= keep]:
            self.shared.free_values(b.values.pop(r))

    def _sample_row(self, p: BatcherRun, m: _protocol.SampleRow) -> None:
        """A sample whose batch's confirmed layout differs: write it with a
        safe cast, promote the batch's dtypes, or refuse the batch."""
        b = p.open.get(m.batch)
        if b is None or b.refused:
            return
        if not b.published:
            b.held_rows.append(m)
            return
        sig, leaves = signature_and_leaves(m.sample)
        if not castable(sig, b.layout):
            wider = promoted(b.layout.signature, sig)
            if wider is None:
                self._refuse(p, b, m.pos, misfit(b.index, m.row, b.layout.signature, sig, leaves))
                return
            if not self._promote(p, b, wider):
                if not b.refused:
                    b.held_rows.append(m)
                return
        values = b.layout.write_row(self._slab_view(b), m.row, leaves, m.pos)
        if b.layout.value_leaves:
            self.shared.free_values(b.values.get(m.row))
            b.values[m.row] = values
        p.rows_by_batcher += 1
        if self.table.count(p.run, b.index, b.version) == b.rows:
            b.counted = True
        self._finish_if_complete(p, b)

    def _promote(self, p: BatcherRun, b: Batch, sig) -> bool:
        """Lay b out again with wider dtypes, copying the rows counted so
        far (safe casts).  Workers still writing the old layout fail to count
        and send their samples whole.  False if it must wait for memory
        (its rows parked: it gives its slab back while it waits) or was
        refused."""
        layout = self.layouts.get(sig, b.rows, b.batched)
        if self._cannot_fit(p, b, layout):
            return False
        p.relayouts += 1
        slab = self._allocate(p, b, layout.nbytes)
        if slab is None:
            self._park(p, b)
            b.wanted = sig
            return False
        counted = self.table.freeze(p.run, b.index)
        b.version += 1
        old_layout, old = b.layout, b.slab
        b.layout, b.slab, b.confirmed = layout, slab, True
        copy_rows(layout, self._slab_view(b), old_layout,
                  self.arena[old.offset:old.offset + old_layout.nbytes])
        self.slabs.retire(old.lease)
        self._publish(p, b, counted)
        return True

    def _refuse(self, p: BatcherRun, b: Batch, pos: int | None, exc: BaseException,
                whole_run: bool = False) -> None:
        """The batch cannot be made: every worker drops its row, and main
        raises when it reaches it (then goes on with the next batch).
        whole_run: no batch of the run can be; main hears it once, raises
        it at once and again at every next() of the run."""
        if b.refused:
            return
        b.refused = True
        b.parked = None
        if b.published:
            self.table.add_flags(p.run, b.index, REFUSED)
            self._retire_refused(b)
            self.control.table_bell.ring()
        elif not whole_run and self._entry_free(p, b):
            # Its workers may wait for its entry already (a stream's have no
            # FINISHED word to pass it): it says REFUSED, and they drop their rows.
            self.table.publish_refused(p.run, b.index)
            self.taken[self.table.entry(p.run, b.index)] = (p.run, b.index)
            b.published = True
            self.control.table_bell.ring()
        if whole_run:
            if not p.refused_window:
                p.refused_window = True
                self._fail(exc, "in the batcher", run=p.run, batch=None, pos=None, ends_run=True)
            return
        self._fail(exc, "in the batcher", run=p.run, batch=b.index, pos=pos, given_up=True)
        if not p.iterable:
            self._give_up(p, b.index)

    def _finish_if_complete(self, p: BatcherRun, b: Batch) -> None:
        """Complete: every row counted and, where rows carry non-numeric
        leaves, every row's values seen (a worker sends them before it
        counts its row, but a row the batcher wrote may complete the count
        while another row's values are still behind in the ring)."""
        if (b.counted and b.published and not b.refused
                and (not b.layout.value_leaves or len(b.values) == b.rows)):
            self._finish(p, b, b.rows)

    def _finish(self, p: BatcherRun, b: Batch, rows: int) -> None:
        del p.open[b.index]
        self._unpublish(p, b)
        self.guess = b.layout.signature
        spec = b.layout.spec(rows, b.values)
        self._forget_values(b, keep=rows)  # (main frees the rows' blocks it opens)
        b.values = {}
        self._send(_protocol.BatchReady(run=p.run, batch=b.index, slab=b.slab, spec=spec,
                                        tags=b.layout.tags_offset, rows=rows))
        self.tracer.batch_sent(p.run, b.index, rows, self.laid_out)
        p.sent += 1
        p.samples += rows if b.batched else 1
        if p.iterable:
            p.sent_stream_batch(b.index)
        else:
            p.finished.add(b.index)
            self._advance(p)
        if self.waiting:
            self._retry_waiting()  # its table entry is free now
        self._publish_ahead(p)
        for q in self.passes.values():
            if q is not p:
                self._publish_ahead(q)  # the next epoch's run, started ahead


def batcher_main(cfg: LoaderSpec, shared: SharedState) -> None:
    batcher = Batcher(cfg, shared)
    try:
        batcher.run()
    finally:
        batcher.warmer.stop()
    shared.to_batcher.close()
    shared.to_main.close()
