"""Worker processes (or threads): a worker's life and runs, and what its
units share: its channel to the batcher, its waits, collate_fn, a batch's
output placed.  The units themselves go through one loop (NOTE [ Units ]
in worker/units.py), each sample into its row (NOTE [ Direct row writes ]
in shared/table.py).  See NOTE [ Runs ] in shared/control.py for how runs
are started and ended without messages."""

from __future__ import annotations

import ctypes
import os

import numpy as np

from shmq import sync
from loader.shared import control as _control
from loader.order import indices as _order
from loader.shared import messages as _protocol
from loader._native import ENDED, RowWriter, RunCounters
from loader.order.feed import ObjectOrder
from loader.worker.failures import COLLATING, IN_INIT_FN, PLACING_OUTPUT, Failures
from loader.worker.fetch import Fetcher
from loader.worker.seeding import (U64, Generators, SampleSeeder, WorkerInfo, seed_worker,
                             set_worker_info)
from loader.worker.units import FAILED, MapRun, StreamRun
from loader.shared.memory import SharedState
from loader.shared.spec import LoaderSpec
from loader.main.stats import WaitClock
from loader.shared.table import SEQ
from loader.shared.trace import TracedWriter
from loader.shared.optional import imported_torch
from loader.datasets.own_state import CopyState, RunDataset

# A sample's buffers (a decoded image, its arrays) are 0.1-10 MB each: over
# glibc's default mmap threshold (128 KiB), each is mapped anew and its
# pages faulted in, then unmapped, on every sample, and what is freed at the
# top of the heap goes back to the kernel only to be faulted in again.  A
# worker keeps them: at most MALLOC_KEEP_BYTES freed at the top, buffers
# up to half that from the heap.  (glibc's own dynamic thresholds get
# there only after an early large free, which importing torch happens to
# make, so a worker forked before torch was imported paid for it: W11's
# decode in docs/benchmarks.md.)
MALLOC_KEEP_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (<malloc.h>)


def keep_freed_memory() -> None:
    """In a worker process: let glibc's malloc reuse a sample's freed
    buffers rather than unmap and fault them in again (a no-op with
    another C library)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, MALLOC_KEEP_BYTES // 2)
        mallopt(_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES)


class Sleeper:
    """A worker's one way to wait: on a bell, in bounded slices that check
    its parent is alive, timed by its wait clock (NOTE [ Wait clocks ] in
    main/stats.py: what stats() and num_workers="auto" read)."""

    def __init__(self, shared: SharedState, worker_id: int, parent_pid: int):
        self.clock, self.parent_pid = WaitClock(shared.waited, worker_id), parent_pid

    def until(self, bell, ready) -> None:
        if ready():
            return
        self.clock.begin()
        try:
            while not bell.wait(ready, _protocol.IDLE_SLICE_S):
                _control.exit_if_orphaned(self.parent_pid)
        finally:
            self.clock.end()


class Channel:
    """A worker's messages to the batcher (each followed by a ring of the
    batcher's bell) and its waits for table entries."""

    def __init__(self, shared: SharedState, worker_id: int, sleeper: Sleeper):
        self.ring, self.control, self.table = shared.to_batcher, shared.control, shared.table
        self.me, self.pid, self.sleeper = worker_id, os.getpid(), sleeper
        self.spill = shared.spill_writer(worker_id)  # NOTE [ Spilled messages ]

    def send(self, msg) -> None:
        if self.spill is None:
            self.ring.put(msg)
        else:
            self.spill.put(self.ring, msg)
        self.control.batcher_bell.ring()

    def request_layout(self, run, batch, row, sig, version, rows, batched):
        self.send(_protocol.LayoutRequest(run=run, batch=batch, row=row, signature=sig,
                                          version=version, rows=rows, batched=batched))

    def row_values(self, run, batch, row, values_key, values):
        if self.spill is not None:  # large bytes and str go to main by reference
            values = self.spill.values_ref(values)
        self.send(_protocol.RowValues(run=run, batch=batch, row=row, values_key=values_key,
                                      values=values))

    def filled(self, run, batch):
        self.send(_protocol.Filled(run=run, batch=batch))

    def sample_row(self, run, batch, row, pos, sample, version):
        self.send(_protocol.SampleRow(run=run, batch=batch, row=row, pos=pos, sample=sample,
                                      version=version))

    def failed(self, exc: BaseException, where: str, *, run: int, batch: int | None = None,
               pos: int | None = None, index=None):
        """Report exc to main (through the batcher); batch, pos, index:
        what it spoils, where known (Failed)."""
        if index is not None and type(index) is not int:  # a sampler's index object:
            where, index = f"{where}, on dataset[{index!r}]"[:500], None  # named in the text
        self.send(_protocol.Failed(run=run, batch=batch, pos=pos, index=index, worker=self.me,
                                   pid=self.pid, error=_protocol.ErrorReport.of(exc, where)))

    def done(self, run, stream_end: _protocol.StreamEnd):
        self.send(_protocol.Done(run=run, worker=self.me, stream_end=stream_end))

    def wait_for_entry(self, run, batch, base, seq_seen) -> bool:
        """Until the table entry at `base` changes (its SEQ word), the batch
        is given up (FINISHED), or the run ended.  False if it ended."""
        c, words = self.control, self.table.words
        finished = _control.word(run, _control.FINISHED)

        def ready():
            return (not c.live(run) or c.stopped or sync.atomic_load(words, base + SEQ) != seq_seen
                    or sync.atomic_load(c.ctl, finished) > batch)

        self.sleeper.until(c.table_bell, ready)
        return c.live(run) and not c.stopped


class Worker:
    def __init__(self, cfg: LoaderSpec, shared: SharedState, worker_id: int,
                 joining_run: int = 0):
        self.cfg, self.shared, self.id = cfg, shared, worker_id
        # a worker added while the loader runs (num_workers="auto") starts with
        # the run in progress; 0: it started with the loader
        self.joining_run = joining_run
        self.control = shared.control
        self.sleeper = Sleeper(shared, worker_id, cfg.parent_pid)
        self.channel = Channel(shared, worker_id, self.sleeper)
        finished = (_control.word(0, _control.FINISHED), _control.word(1, _control.FINISHED))
        self.writer = RowWriter(shared.table, shared.arena, shared.hazards, worker_id, self.channel,
                                shared.control.ctl, finished)
        self.counters = RunCounters(shared.control.ctl, _control.RUN_LAYOUT)
        self.started = False   # seeded, worker_init_fn called
        self.broken = False    # worker_init_fn raised: load nothing more
        self.seeder = None     # reproducible=True: made at the start (a thread's own generators)
        self.autoscaled = bool(cfg.max_workers)  # num_workers="auto" (see main/autoscale.py)
        self.own = None  # NOTE [ Datasets that keep their own state ]: this worker's copy's
        if cfg.own_state:
            self.own = CopyState(cfg.dataset, worker_id, cfg.iterable, cfg.rows,
                                 self.channel.send,
                                 lambda e, where, run: self.channel.failed(e, where, run=run))
        self.failed = Failures(self.channel, worker_id)
        self.fetcher = None  # made at the start (its seeder is)
        self.tracer = None
        if cfg.trace is not None:  # NOTE [ Trace records ]: the hot paths, wrapped only if traced
            self.tracer = cfg.trace.tracer(worker_id)
            if cfg.collate_fn is not None:
                self.collate = self.tracer.traced_collate(self.collate)
            self.writer = TracedWriter(self.writer, self.tracer)

    def run(self) -> None:
        torch = imported_torch()
        if not self.cfg.threads:  # (a thread worker's process is the user's: left alone)
            keep_freed_memory()
            if torch is not None:
                # One intra-op thread per worker, as PyTorch's workers have: the
                # parent's thread pool does not survive the fork.
                torch.set_num_threads(1)
        seen = max(self.joining_run - 1, 0)
        if self.joining_run:  # added while the loader runs: one more Done for the batcher
            self.channel.send(_protocol.Joined(self.id, self.joining_run))
        while (latest := self._wait_for_run(seen)) is not None:
            for run in range(seen + 1, latest + 1):
                ended = self._one_run(run)
                self.channel.done(run, ended)  # after this worker's last write into the run
            seen = latest

    def _wait_for_run(self, seen: int) -> int | None:
        c = self.control
        self.sleeper.until(c.run_bell, lambda: c.stopped or c.latest_run() > seen)
        return None if c.stopped else c.latest_run()

    def _start(self, run: int) -> None:
        """Once per process, at its first run: seeds, worker info,
        worker_init_fn (as PyTorch does, in that order)."""
        cfg = self.cfg
        self.started = True
        base_seed = self.control.read(run, _control.BASE_SEED)
        if cfg.threads:
            seed = (base_seed + self.id) & U64
            rng = Generators(seed)
        else:
            seed = seed_worker(base_seed, self.id, cfg.torch_rules)
            rng = Generators(None)
        info = WorkerInfo(id=self.id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset,
                          rank=cfg.rank, world_size=cfg.world, rng=rng,
                          worker_method="thread" if cfg.threads else "multiprocessing")
        self.seeder = SampleSeeder(cfg.seed, rng) if cfg.reproducible else None
        self.fetcher = Fetcher(cfg.dataset, self.seeder, tracer=self.tracer)
        set_worker_info(info)
        if cfg.worker_init_fn is not None:
            try:
                cfg.worker_init_fn(self.id)
            except Exception as e:
                self.broken = True
                self.failed(IN_INIT_FN, e, run)

    def _one_run(self, run: int) -> _protocol.StreamEnd:
        """Load this worker's part of the run.  Returns how an iterable run's
        stream ended (see StreamRun.load), else NO_STREAM_END."""
        if not self.control.live(run):
            return _protocol.NO_STREAM_END
        if not self.started:
            self._start(run)
        carried = self.shared.read_snapshot(run) if self.control.read(run, _control.SNAPSHOT) \
            else RunDataset(None, None)
        if self.own is not None:  # before anything of the run is loaded, broken or not
            self.own.begin(run, carried.states, usable=not self.broken)
        if self.broken:
            return _protocol.NO_STREAM_END
        if carried.snapshot is not None:  # the epoch's dataset view (FileDataset)
            self.cfg.dataset.restore_snapshot(carried.snapshot)
        ended = self._load_run(run, carried.states)
        if self.own is not None:
            self.own.end(run)
        return ended

    def _load_run(self, run: int, points: list | None) -> _protocol.StreamEnd:
        """The run's units loaded (NOTE [ Units ] in worker/units.py)."""
        if self.cfg.iterable:
            return StreamRun(self, run, None if points is None else
                             points[self.id % len(points)]).load()
        epoch = self.control.read(run, _control.EPOCH)
        order, batches = self._order(run)
        MapRun(self, run, epoch, order, batches).load()
        return _protocol.NO_STREAM_END

    def _order(self, run: int) -> tuple[np.ndarray | None, _order.Batches]:
        """The run's dataset index per position (None: the position is the
        index), and its batches."""
        c, cfg = self.control, self.cfg
        kept, kind = c.read(run, _control.KEPT), c.read(run, _control.ORDER)
        if kind == _order.ORDER_OBJECTS:  # a streamed sampler's index objects
            order = ObjectOrder(self.shared.order_fd(run))
        elif kind == _order.ORDER_SHIPPED and \
                c.read(run, _control.OFFSETS) == _order.OFFSETS_STREAMED:
            # a streamed batch sampler's: offsets written as main pulls it
            open_positions = _order.OPEN_POSITIONS
            order, stored = self.shared.read_order(run, open_positions, open_positions, True)
            return order, _order.StreamedBatches(stored, lambda: c.kept(run),
                                                 lambda: c.nbatches(run))
        elif kind == _order.ORDER_SHIPPED:
            order, _ = self.shared.read_order(run, kept, 0, False)
        else:
            remaining = None
            if c.read(run, _control.RESUMED):
                remaining = _order.Remaining.from_words(self.shared.read_words(run))
            order = _order.computed_order(kind, c.read(run, _control.SIZE),
                                          c.read(run, _control.ORDER_SEED),
                                          c.read(run, _control.EPOCH), cfg.rank, cfg.world, kept,
                                          remaining)
        if c.read(run, _control.OPEN):  # its length is learnt late: KEPT is read at every use
            return order, _order.OpenBatches(cfg.rows, lambda: c.kept(run))
        return order, _order.Batches(kept, cfg.rows)

    def wait_to_load(self, run: int, unit: int) -> bool:
        """Until unit is below main's limit (prefetch); False if the run ended."""
        c, counters = self.control, self.counters
        if counters.below_limit(run, unit):
            return True
        # (an OPEN run: a unit past the end settled meanwhile is never loaded)
        self.sleeper.until(c.limit_bell, lambda: counters.below_limit(run, unit)
                           or not c.live(run) or c.stopped or unit >= c.units(run))
        return counters.below_limit(run, unit) and c.live(run) and not c.stopped

    def may_claim(self, run: int, units: int) -> bool:
        """num_workers="auto": wait while this worker is not among the
        active ones, unless every unit of the run is claimed (then it says
        Done like the others).  False once the run ended."""
        c = self.control
        if not self.autoscaled or self.id < c.active():
            return True

        def ready():  # (UNITS read again: an OPEN run's may have been settled)
            return (self.id < c.active() or c.claimed(run) >= min(units, c.units(run))
                    or not c.live(run) or c.stopped)

        self.sleeper.until(c.run_bell, ready)
        return c.live(run) and not c.stopped

    def collate(self, run: int, batch: int | None, samples: list):
        if self.cfg.collate_fn is None:  # batch_size=None: the sample is the batch
            return samples[0]
        try:
            return self.cfg.collate_fn(samples)
        except Exception as e:
            self.failed(COLLATING, e, run, batch=batch)
            return FAILED

    def place_output(self, run: int, slot: int, output, tag: int) -> bool:
        """Place a collated batch as batch `slot`, tagged (its unit, or its
        number in the worker's stream); False once the run ended."""
        try:
            return self.writer.place(run, slot, 0, 1, tag, output, batched=False) != ENDED
        except Exception as e:  # a CollateError, or a file read failing
            self.failed(PLACING_OUTPUT, e, run, batch=slot if self.cfg.in_order else None,
                        slot=slot)
            return True

    # --- iterable datasets ---------------------------------------------------------

    def wait_for_room(self, run: int, j: int) -> bool:
        """Until this worker may fill its j-th batch of the run; False if
        the run ended."""
        c = self.control
        i = (run % 2) * c.streams + self.id

        def ready():
            return sync.atomic_load(c.limits, i) > j or not c.live(run) or c.stopped

        self.sleeper.until(c.limit_bell, ready)
        return c.live(run) and not c.stopped


def worker_main(cfg: LoaderSpec, shared: SharedState, worker_id: int,
                joining_run: int = 0) -> None:
    Worker(cfg, shared, worker_id, joining_run).run()
    shared.to_batcher.close()
