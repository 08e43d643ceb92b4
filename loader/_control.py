"""Shared control words: runs, cursors, limits, and the bells processes
sleep on.  See NOTE [ Runs ] below.

NOTE [ Runs ]
=============

A *run* is one pass over the data; runs have ids that are never reused in
a loader's life.  The user's epoch number only picks the order and the
seeds.  Main starts a run by filling a block of ctl words and storing the
run id into LATEST_RUN last (release); workers and the collator read
LATEST_RUN (acquire) and then the block.  Nothing is sent: main never
blocks on a send, whatever the children are doing.

  ctl[LATEST_RUN] ──► run block (run % 2): ID EPOCH SIZE KEPT UNITS ORDER ORDER_SEED
                                             CURSOR LIMIT ARRIVED

- SIZE, KEPT: positions in the epoch's order, and those it delivers
  (drop_last drops a short last batch); -1 for an iterable dataset.
- UNITS: what the workers claim one by one: positions of the epoch's order
  (default collate), batches (with a collate_fn, a worker loads and
  collates a whole batch), or -1 for an iterable dataset.
- ORDER: how a worker finds the dataset index of a position without being
  sent anything: RANGE (i), PERMUTATION (the same seeded permutation, from
  (ORDER_SEED, EPOCH), computed by every worker), or SHIPPED (a user
  sampler's order, written by main into the run's order file).
- CURSOR: (run << 32) | next unit, claimed by compare-and-swap.  A worker
  still busy in an ended run can never take a unit of a newer one, and
  ending a run is one store of an untagged value.
- LIMIT: units below it may be loaded.  Main keeps it `prefetch` batches
  ahead of what it has yielded, so prefetch does not grow with workers.
- ARRIVED: (run << 32) | samples (or batches) ready so far, in arrival
  order (first-ready mode and iterable datasets): the k-th goes to row
  k % B of batch k // B.

The next epoch's run starts as soon as every unit of the current one is
claimed (run ahead), so two runs can be live; a third waits until the
older has ended, i.e. until main has received its End (every worker has
said Done for it), so a block is never reused under a worker.

Bells are eventcounts (shmq_sync.h) on int32 words: whoever changes what a
sleeper waits for rings the bell after the change, and a sleeper re-checks
its condition after announcing itself, so no wake-up is lost.  Every sleep
is a bounded slice: the sleeper re-checks STOP, its parent and deadlines.
"""

from __future__ import annotations

import numpy as np

import shmq
from loader._native import Bell  # an eventcount: see its docstring

# --- ctl words (int64) ---------------------------------------------------------
STOP = 0            # 1 once main stops the loader (see NOTE [ ShmLoader processes and shutdown ])
LATEST_RUN = 1      # id of the latest run started
OUTBOX = 2          # 1 while the collator holds messages main's full ring could not take
RUN_BASE = 8
RUN_WORDS = 16
ID, EPOCH, SIZE, KEPT, UNITS, ORDER, ORDER_SEED, CURSOR, LIMIT, ARRIVED = range(10)
CTL_WORDS = RUN_BASE + 2 * RUN_WORDS
RUN_SHIFT = 32      # units per run < 2**32

ORDER_RANGE, ORDER_PERMUTATION, ORDER_SHIPPED = 0, 1, 2

# --- bells (int32 pairs: sequence, sleepers) -------------------------------------
RUN_BELL = 0        # a run started, or STOP: idle workers
LIMIT_BELL = 2      # LIMIT rose, or a run ended: workers waiting to load
TABLE_BELL = 4      # a table entry changed: workers waiting for a layout
COLLATOR_BELL = 6   # a message, a released slab, a new run, STOP: the collator
BELL_WORDS = 8


def word(run: int, which: int) -> int:
    """Index in ctl of word `which` of the run's block."""
    return RUN_BASE + (run % 2) * RUN_WORDS + which


def tagged(run: int, value: int = 0) -> int:
    return (run << RUN_SHIFT) | value


class Control:
    """The ctl words and bells, as every process sees them."""

    def __init__(self):
        self.ctl = shmq.shared_array(CTL_WORDS, np.int64)
        self.bells = shmq.shared_array(BELL_WORDS, np.int32)
        self.run_bell = Bell(self.bells, RUN_BELL)
        self.limit_bell = Bell(self.bells, LIMIT_BELL)
        self.table_bell = Bell(self.bells, TABLE_BELL)
        self.collator_bell = Bell(self.bells, COLLATOR_BELL)

    def ring_all(self) -> None:
        for bell in (self.run_bell, self.limit_bell, self.table_bell, self.collator_bell):
            bell.ring()

    # --- main --------------------------------------------------------------

    def start_run(self, run: int, epoch: int, size: int, kept: int, units: int, order: int,
                  order_seed: int, limit: int) -> None:
        """Fill the run's block, then publish it.  The block's previous run
        (run - 2) must have ended: see NOTE [ Runs ]."""
        c = self.ctl
        c[word(run, ID)] = run
        c[word(run, EPOCH)] = epoch
        c[word(run, SIZE)] = size
        c[word(run, KEPT)] = kept
        c[word(run, UNITS)] = units
        c[word(run, ORDER)] = order
        c[word(run, ORDER_SEED)] = order_seed
        c[word(run, LIMIT)] = limit
        c[word(run, ARRIVED)] = tagged(run)
        shmq.atomic_store(c, word(run, CURSOR), tagged(run))
        shmq.atomic_store(c, LATEST_RUN, run)  # SYNC POINT: last; pairs with latest_run()
        self.run_bell.ring()
        self.collator_bell.ring()

    def end_run(self, run: int) -> None:
        """Workers stop claiming units of the run.  A plain store is enough:
        a claim's compare-and-swap fails on any other value."""
        i = word(run, CURSOR)
        if shmq.atomic_load(self.ctl, i) >> RUN_SHIFT == run:
            shmq.atomic_store(self.ctl, i, 0)
        self.limit_bell.ring()   # workers waiting to load its units
        self.table_bell.ring()   # workers waiting for its layouts

    def set_limit(self, run: int, limit: int) -> None:
        shmq.atomic_store(self.ctl, word(run, LIMIT), limit)
        self.limit_bell.ring()

    def stop(self) -> None:
        shmq.atomic_store(self.ctl, STOP, 1)
        self.ring_all()

    # --- everyone ------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return shmq.atomic_load(self.ctl, STOP) != 0

    def latest_run(self) -> int:
        return shmq.atomic_load(self.ctl, LATEST_RUN)

    def read(self, run: int, which: int) -> int:
        return int(self.ctl[word(run, which)])

    def live(self, run: int) -> bool:
        return shmq.atomic_load(self.ctl, word(run, CURSOR)) >> RUN_SHIFT == run

    def claimed(self, run: int) -> int:
        """Units of a live run claimed so far (-1 once it ended)."""
        v = shmq.atomic_load(self.ctl, word(run, CURSOR))
        return v & ((1 << RUN_SHIFT) - 1) if v >> RUN_SHIFT == run else -1
