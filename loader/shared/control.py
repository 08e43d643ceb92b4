"""Shared control words: runs, cursors, limits, and the bells processes
sleep on.  See NOTE [ Runs ] below.

NOTE [ Runs ]
=============

A *run* is one pass over the data; runs have ids that are never reused in
a loader's life.  The user's epoch number only picks the order and the
seeds.  Main starts a run by filling a block of ctl words and storing the
run id into LATEST_RUN last (release); workers and the batcher read
LATEST_RUN (acquire) and then the block.  Nothing is sent: main never
blocks on a send, whatever the children are doing.

  ctl[LATEST_RUN] ──► run block (run % 2): ID EPOCH SIZE KEPT UNITS NBATCHES ORDER ORDER_SEED
                                             OFFSETS BASE_SEED SNAPSHOT CURSOR LIMIT ARRIVED
                                             FINISHED RESUMED OPEN

- SIZE: the dataset's length, from which a computed order is made (or
  the shipped order's length); KEPT: positions of this rank's order it
  delivers (drop_last drops a short last batch); -1 for an iterable
  dataset.
- UNITS: what the workers claim one by one: positions of the order
  (default collate), or batches (with a collate_fn, or batch_size=None, a
  worker loads a whole batch, as PyTorch's workers do).
- NBATCHES: batches the run delivers.  They are KEPT // batch size
  (rounded up), unless a batch sampler made them (see OFFSETS).
- ORDER: how a worker finds the dataset index of a position without being
  sent anything (order/indices.py): RANGE (i), PERMUTATION (the same seeded
  permutation, from (ORDER_SEED, EPOCH), computed by every worker per
  position and, with distributed=True, cut into this rank's share: NOTE
  [ The seeded order ]), or SHIPPED (ORDER_SHIPPED): main wrote the order into the run's
  order file (a user sampler, a torch.Generator's shuffle, the rest of a
  resumed epoch of those); the workers map the file, so the order is in
  memory once whatever the number of workers.
- RESUMED: 1 when a computed order (RANGE, PERMUTATION) is the rest of a
  resumed epoch: the order file holds the few numbers of _order.Remaining
  (the epoch's kept positions, the prefix delivered and the ranges
  delivered past it), and KEPT counts the positions left.
- OPEN: 1 when the run's length is learnt late (a sampler without
  len(): NOTE [ Streamed samplers ] in order/feed.py).  SIZE, KEPT,
  UNITS and NBATCHES then start as a provisional bound (OPEN_POSITIONS)
  and main stores the final ones (settle_run) as soon as the sampler
  ends, before any LIMIT that reaches past the last full batch: a worker
  loads only below LIMIT, so it never loads a position by a provisional
  length, and one waiting for a unit past the end wakes (the limit bell)
  and finds it past UNITS.
- OFFSETS: OFFSETS_STREAMED when a batch sampler makes the batches (of
  any sizes): batch k's positions [offsets[k], offsets[k + 1]) are written
  into the order file as main pulls it (order/indices.py); else 0.
- BASE_SEED: drawn by main for each epoch, as torch's DataLoader draws
  one per iterator; a worker process seeds itself from the first run it
  sees (see seed_worker in worker/seeding.py).
- SNAPSHOT: 1 when the dataset gave main a snapshot of itself for the
  epoch, written into the run's snapshot file; each worker hands it to
  dataset.restore_snapshot() before loading the run (NOTE [ Datasets that
  change with the epoch ] in datasets/snapshot.py).
- CURSOR: (run << 32) | next unit, claimed by compare-and-swap.  A worker
  still busy in an ended run can never take a unit of a newer one, and
  ending a run is one store of an untagged value.
- LIMIT: units below it may be loaded.  Main keeps it `prefetch` batches
  ahead of what it has yielded, so prefetch does not grow with workers.
- ARRIVED: (run << 32) | samples (or batches) ready so far, in arrival
  order (first-ready mode): the k-th goes to row k % B of batch k // B.
- FINISHED: map-style runs: every batch below it is sent, or given up (a
  sample of it failed, or it cannot be collated: main raises its error
  and goes on with the next batch).  Written by the batcher; a worker
  drops a row of such a batch, so a batch that will never be sent does
  not keep its table entry, or the worker, waiting.

An iterable dataset is read by every worker from its own iterator, as in
PyTorch: worker w fills its own batches, its j-th being batch j * W + w
(W workers), and may run `prefetch` of them ahead of those main yielded:
main raises limits[run % 2][w], one word per worker.  A worker whose
iterator ends says how many batches it made (Done); main skips the ids it
will never fill, so in-order mode delivers the batches round-robin over
the workers still going, as PyTorch does.

The next epoch's run starts as soon as every unit of the current one is
claimed (run ahead), so two runs can be live; a third waits until the
older has ended, i.e. until main has received its RunEnded (every worker
has said Done for it), so a block is never reused under a worker.

Bells are eventcounts (shmq_sync.h) on int32 words: whoever changes what a
sleeper waits for rings the bell after the change, and a sleeper re-checks
its condition after announcing itself, so no wake-up is lost.  Every sleep
is a bounded slice: the sleeper re-checks STOP, its parent and deadlines.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from shmq import sync
from loader.shared.passable import shared_array
from loader._native import Bell  # an eventcount: see its docstring

# --- ctl words (int64) ---------------------------------------------------------
STOP = 0            # 1 once main stops the loader (see NOTE [ ShmLoader processes and shutdown ])
LATEST_RUN = 1      # id of the latest run started
OUTBOX = 2          # 1 while the batcher holds messages main's full ring could not take
ACTIVE = 3          # num_workers="auto": workers with a lower id claim units (see main/autoscale.py)
MEMORY_WAIT = 4     # 1 while a batch waits for slab memory (NOTE [ Kept batch memory ])
RUN_BASE = 8
RUN_WORDS = 17
(ID, EPOCH, SIZE, KEPT, UNITS, NBATCHES, ORDER, ORDER_SEED, OFFSETS, BASE_SEED, SNAPSHOT,
 CURSOR, LIMIT, ARRIVED, FINISHED, RESUMED, OPEN) = range(17)
CTL_WORDS = RUN_BASE + 2 * RUN_WORDS
RUN_SHIFT = 32      # units per run < 2**32

# --- bells (int32 pairs: sequence, sleepers) -------------------------------------
RUN_BELL = 0        # a run started, or STOP: idle workers
LIMIT_BELL = 2      # LIMIT rose, or a run ended: workers waiting to load
TABLE_BELL = 4      # a table entry changed: workers waiting for a layout
BATCHER_BELL = 6   # a message, a released slab, a new run, STOP: the batcher
BELL_WORDS = 8


class RunWordLayout(NamedTuple):
    """Where a run's words lie in ctl, for the compiled code that reads
    them (RunCounters in _native.pyx): built once from the constants
    above, so the layout has one source."""
    base: int      # RUN_BASE: the first run block's first word
    words: int     # RUN_WORDS: words per run block (blocks alternate by run parity)
    cursor: int    # CURSOR, LIMIT, ARRIVED: their offsets in a block
    limit: int
    arrived: int
    shift: int     # RUN_SHIFT: a tagged word holds (run << shift) | value


RUN_LAYOUT = RunWordLayout(base=RUN_BASE, words=RUN_WORDS, cursor=CURSOR, limit=LIMIT,
                           arrived=ARRIVED, shift=RUN_SHIFT)


def word(run: int, which: int) -> int:
    """Index in ctl of word `which` of the run's block."""
    return RUN_BASE + (run % 2) * RUN_WORDS + which


def tagged(run: int, value: int = 0) -> int:
    return (run << RUN_SHIFT) | value


class RunWords(NamedTuple):
    """What main stores in a run's block (NOTE [ Runs ]): one field per
    word, 0/1 for the flags.  limit: the LIMIT word, or for an iterable
    dataset each worker's (a list)."""
    epoch: int
    size: int
    kept: int
    units: int
    nbatches: int
    order: int          # ORDER: _order.ORDER_RANGE, ORDER_PERMUTATION, ...
    order_seed: int
    offsets: int        # OFFSETS: 0 or _order.OFFSETS_STREAMED
    base_seed: int
    limit: int | list
    snapshot: int = 0
    resumed: int = 0
    open_ended: int = 0


class Control:
    """The ctl words, the per-worker limits of iterable runs, and the bells,
    as every process sees them."""

    def __init__(self, num_workers: int, passable: bool = False):
        # passable: start_method="spawn" (NOTE [ Starting clean ] in shared/passable.py)
        self.ctl = shared_array(CTL_WORDS, np.int64, passable)
        self.streams = max(num_workers, 1)  # LIMIT words per run parity (LoaderSpec.streams)
        self.limits = shared_array(2 * self.streams, np.int64, passable)
        self.bells = shared_array(BELL_WORDS, np.int32, passable)
        self.run_bell = Bell(self.bells, RUN_BELL)
        self.limit_bell = Bell(self.bells, LIMIT_BELL)
        self.table_bell = Bell(self.bells, TABLE_BELL)
        self.batcher_bell = Bell(self.bells, BATCHER_BELL)

    def ring_all(self) -> None:
        for bell in (self.run_bell, self.limit_bell, self.table_bell, self.batcher_bell):
            bell.ring()

    # --- main --------------------------------------------------------------

    def start_run(self, run: int, words: "RunWords") -> None:
        """Fill the run's block with its words, then publish it.  The
        block's previous run (run - 2) must have ended: see NOTE [ Runs ]."""
        c = self.ctl
        limit = words.limit
        per_worker = isinstance(limit, (list, tuple))
        for which, value in ((ID, run), (EPOCH, words.epoch), (SIZE, words.size),
                             (KEPT, words.kept), (UNITS, words.units),
                             (NBATCHES, words.nbatches), (ORDER, words.order),
                             (ORDER_SEED, words.order_seed), (OFFSETS, words.offsets),
                             (BASE_SEED, words.base_seed), (SNAPSHOT, words.snapshot),
                             (FINISHED, 0), (RESUMED, words.resumed), (OPEN, words.open_ended),
                             (LIMIT, -1 if per_worker else limit),
                             (ARRIVED, tagged(run))):
            c[word(run, which)] = value
        if per_worker:
            first = (run % 2) * self.streams
            self.limits[first:first + len(limit)] = limit
        sync.atomic_store(c, word(run, CURSOR), tagged(run))
        sync.atomic_store(c, LATEST_RUN, run)  # SYNC POINT: last; pairs with latest_run()
        self.run_bell.ring()
        self.batcher_bell.ring()

    def end_run(self, run: int) -> None:
        """Workers stop claiming units of the run.  A plain store is enough:
        a claim's compare-and-swap fails on any other value."""
        i = word(run, CURSOR)
        if sync.atomic_load(self.ctl, i) >> RUN_SHIFT == run:
            sync.atomic_store(self.ctl, i, 0)
        self.limit_bell.ring()   # workers waiting to load its units
        self.table_bell.ring()   # workers waiting for its layouts

    def settle_run(self, run: int, kept: int, units: int, nbatches: int) -> None:
        """An OPEN run's final length, stored before the LIMIT that
        reaches it (set_limit's release store publishes these too)."""
        for which, value in ((SIZE, kept), (KEPT, kept), (NBATCHES, nbatches), (UNITS, units)):
            sync.atomic_store(self.ctl, word(run, which), value)
        self.limit_bell.ring()   # workers waiting for a unit now past the end

    def kept(self, run: int) -> int:
        """The run's KEPT as stored now (an OPEN run's may still change)."""
        return sync.atomic_load(self.ctl, word(run, KEPT))

    def nbatches(self, run: int) -> int:
        return sync.atomic_load(self.ctl, word(run, NBATCHES))

    def units(self, run: int) -> int:
        return sync.atomic_load(self.ctl, word(run, UNITS))

    def set_limit(self, run: int, limit: int) -> None:
        sync.atomic_store(self.ctl, word(run, LIMIT), limit)
        self.limit_bell.ring()

    def raise_worker_limit(self, run: int, worker: int) -> None:
        """An iterable run: worker may fill one more batch."""
        sync.atomic_add(self.limits, (run % 2) * self.streams + worker, 1)
        self.limit_bell.ring()

    def set_active(self, active: int) -> None:
        """num_workers="auto": how many workers may claim units now."""
        sync.atomic_store(self.ctl, ACTIVE, active)
        self.run_bell.ring()   # waiting workers look again

    def active(self) -> int:
        return sync.atomic_load(self.ctl, ACTIVE)

    def stop(self) -> None:
        sync.atomic_store(self.ctl, STOP, 1)
        self.ring_all()

    # --- everyone ------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return sync.atomic_load(self.ctl, STOP) != 0

    def latest_run(self) -> int:
        return sync.atomic_load(self.ctl, LATEST_RUN)

    def read(self, run: int, which: int) -> int:
        return int(self.ctl[word(run, which)])

    def live(self, run: int) -> bool:
        return sync.atomic_load(self.ctl, word(run, CURSOR)) >> RUN_SHIFT == run

    def claimed(self, run: int) -> int:
        """Units of a live run claimed so far (-1 once it ended)."""
        v = sync.atomic_load(self.ctl, word(run, CURSOR))
        return v & ((1 << RUN_SHIFT) - 1) if v >> RUN_SHIFT == run else -1


def exit_if_orphaned(parent_pid: int) -> None:
    """In a worker or the batcher: the fallback to the parent-death
    signal, checked between bounded waits (0: a thread of the main
    process, which has no parent to lose)."""
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)
