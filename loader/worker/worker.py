"""Worker processes: claim units of a run, load them, and place each sample
in its row (NOTE [ Direct row writes ] in shared/table.py).  See NOTE [ Runs ] in
shared/control.py for how runs are started and ended without messages."""

from __future__ import annotations

import ctypes
import os

import numpy as np

from shmq import sync
from loader.shared import control as _control
from loader.worker import fetch as _fetch
from loader.order import indices as _order
from loader.shared import messages as _protocol
from loader._native import DROPPED, ENDED, RowWriter, RunCounters, StreamSlots, derived_seeds
from loader.order.progress import stream_skips
from loader.order.feed import ObjectOrder
from loader.worker.seeding import (U64, Generators, SampleSeeder, WorkerInfo, seed_worker,
                             set_worker_info)
from loader.shared.memory import SharedState
from loader.shared.spec import LoaderSpec
from loader.main.stats import WaitClock
from loader.shared.table import SEQ
from loader.shared.trace import TracedWriter, now
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


def exit_if_orphaned(parent_pid: int) -> None:
    """The fallback to the parent-death signal, checked between bounded
    waits (0: a thread of the main process, which has no parent to lose)."""
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


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
                exit_if_orphaned(self.parent_pid)
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
        self.tracer = None
        if cfg.trace is not None:  # NOTE [ Trace records ]: the hot paths, wrapped only if traced
            self.tracer = cfg.trace.tracer(worker_id)
            self._load = self.tracer.traced_load(self._load)
            if cfg.collate_fn is not None:
                self._collate = self.tracer.traced_collate(self._collate)
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
        set_worker_info(info)
        if cfg.worker_init_fn is not None:
            try:
                cfg.worker_init_fn(self.id)
            except Exception as e:
                self.broken = True
                self.channel.failed(e, f"in worker_init_fn of worker {self.id}", run=run)

    def _one_run(self, run: int) -> _protocol.StreamEnd:
        """Load this worker's part of the run.  Returns how an iterable run's
        stream ended (see _stream_run), else NO_STREAM_END."""
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
        if self.cfg.iterable:
            return self._stream_run(run, None if points is None else points[self.id % len(points)])
        epoch = self.control.read(run, _control.EPOCH)
        order, batches = self._order(run)
        if self.cfg.whole_batches or self.cfg.batched_fetch:
            self._whole_batch_run(run, epoch, order, batches)
        elif self.cfg.per_batch:
            self._batch_run(run, epoch, order, batches)
        else:
            self._sample_run(run, epoch, order, batches)
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

    def _wait_to_load(self, run: int, unit: int) -> bool:
        """Until unit is below main's limit (prefetch); False if the run ended."""
        c, counters = self.control, self.counters
        if counters.below_limit(run, unit):
            return True
        # (an OPEN run: a unit past the end settled meanwhile is never loaded)
        self.sleeper.until(c.limit_bell, lambda: counters.below_limit(run, unit)
                           or not c.live(run) or c.stopped or unit >= c.units(run))
        return counters.below_limit(run, unit) and c.live(run) and not c.stopped

    def _load(self, epoch: int, index, pos: int):
        if self.seeder is not None:  # a sampler's non-int index: seeded by its position
            self.seeder(epoch, 0, index if type(index) is int else pos | (1 << 62))
        return self.cfg.dataset[index]

    def _may_claim(self, run: int, units: int) -> bool:
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

    def _sample_run(self, run: int, epoch: int, order, batches: _order.Batches) -> None:
        """Default collate: claim a position, load it, place it in its row."""
        index_of = _order.index_getter(order)
        counters, place, in_order = self.counters, self.writer.place, self.cfg.in_order
        units = self.control.read(run, _control.UNITS)
        while self._may_claim(run, units):
            if self.own is not None:
                self.own.loaded_a_unit(run, self.cfg.rows)
            pos = counters.claim(run)
            if pos < 0 or pos >= units:  # a unit past the end is never waited for
                return
            if not counters.below_limit(run, pos) and not self._wait_to_load(run, pos):
                return
            index = index_of(pos)
            try:
                sample = self._load(epoch, index, pos)
            except Exception as e:
                batch = batches.locate(pos)[0] if in_order else None  # first-ready: no slot yet
                self.channel.failed(e, f"in worker {self.id}", run=run, batch=batch, pos=pos,
                                    index=index)
                continue
            slot = pos if in_order else counters.claim(run, True)  # first-ready: arrival order
            if slot < 0:
                return
            batch, row = batches.locate(slot)
            try:
                if place(run, batch, row, batches.rows(batch), pos, sample) == ENDED:
                    return
            except Exception as e:  # a CollateError, or a file read failing (FileDataset)
                # (first-ready too: the batch's slot is taken, so the batcher must give
                # the batch up; main raises at once all the same)
                self.channel.failed(e, f"in worker {self.id}, placing sample {index} in its batch",
                                    run=run, batch=batch, pos=pos, index=index)

    def _batch_run(self, run: int, epoch: int, order, batches: _order.Batches) -> None:
        """A collate_fn (or batch_size=None): claim a batch, load its
        samples, collate them here (as PyTorch's workers do), place the
        output as the batch."""
        index_of = _order.index_getter(order)
        cfg, counters = self.cfg, self.counters
        units = self.control.read(run, _control.UNITS)
        while self._may_claim(run, units):
            if self.own is not None:
                self.own.loaded_a_unit(run)
            unit = counters.claim(run)
            if unit < 0 or unit >= units or not self._wait_to_load(run, unit):
                return
            batch = unit if cfg.in_order else None  # first-ready: its slot is claimed once placed
            samples = []
            start, stop = batches.span(unit)
            for pos in range(start, stop):
                index = index_of(pos)
                try:
                    samples.append(self._load(epoch, index, pos))
                except Exception as e:
                    self.channel.failed(e, f"in worker {self.id}", run=run, batch=batch, pos=pos,
                                        index=index)
                    break
            else:
                output = self._collate(run, batch, samples)
                if output is _FAILED:
                    continue
                slot = unit if cfg.in_order else counters.claim(run, True)
                if slot < 0 or not self._place_output(run, slot, output, unit):
                    return

    def _next_batches(self, run: int, count: int):
        """The batches this worker loads whole: DataLoader in order, id,
        id + W, id + 2W... as torch assigns them (so that what a dataset
        draws from the generators torch seeded per worker lands in the same
        samples); else as claimed, so that a slow batch never holds up the
        batches behind it."""
        if self.cfg.in_order and self.cfg.whole_batches:
            yield from range(self.id, count, self.cfg.streams)
            return
        while self._may_claim(run, count) and 0 <= (unit := self.counters.claim(run)) < count:
            yield unit

    def _whole_batch_run(self, run: int, epoch: int, order, batches: _order.Batches) -> None:
        """DataLoader: a worker loads whole batches (their composition is
        the sampler's, in either ordering mode), writing each sample into
        its row."""
        index_of = _order.index_getter(order)
        cfg = self.cfg
        for batch in self._next_batches(run, batches.count):
            if self.own is not None:
                self.own.loaded_a_unit(run)
            if not self._wait_to_load(run, batch):
                return
            start, stop = batches.span(batch)
            if cfg.batched_fetch:
                if not self._fetched_batch(run, epoch, batch, _fetch.indices_of(order, start, stop),
                                           start):
                    return
                continue
            samples = []
            for row, pos in enumerate(range(start, stop)):
                index = index_of(pos)
                try:
                    sample = self._load(epoch, index, pos)
                except Exception as e:
                    self.channel.failed(e, f"in worker {self.id}", run=run, batch=batch, pos=pos,
                                        index=index)
                    break
                if cfg.per_batch:
                    samples.append(sample)
                    continue
                try:
                    if self.writer.place(run, batch, row, stop - start, pos, sample) == ENDED:
                        return
                except Exception as e:  # a CollateError, or a file read failing (FileDataset)
                    self.channel.failed(e, f"in worker {self.id}, placing sample {index} in its "
                                        f"batch", run=run, batch=batch, pos=pos, index=index)
                    break
            else:
                if cfg.per_batch:
                    output = self._collate(run, batch, samples)
                    if output is not _FAILED and not self._place_output(run, batch, output, batch):
                        return

    def _fetched_batch(self, run: int, epoch: int, batch: int, indices: list,
                       start: int) -> bool:
        """Load a batch with one __getitems__ call and place its samples in
        their rows (or its collated output: a collate_fn).  False once the
        run ended.  See NOTE [ Batched fetch ] in worker/fetch.py."""
        dataset = self.cfg.dataset
        if self.seeder is not None:
            _fetch.seed_call(self.seeder, epoch, indices, start)
        t0 = now()
        try:
            samples = _fetch.checked(dataset, indices, dataset.__getitems__(indices))
        except Exception as e:
            self.channel.failed(e, f"{_fetch.where(dataset, indices)}, in worker {self.id}",
                                run=run, batch=batch)
            return True
        if self.tracer is not None:
            self.tracer.load(t0, now(), index=None, position=start, samples=len(samples),
                             epoch=epoch)
        if self.cfg.per_batch:
            output = self._collate(run, batch, samples)
            return output is _FAILED or self._place_output(run, batch, output, batch)
        rows, place = len(samples), self.writer.place
        for row, sample in enumerate(samples):
            try:
                if place(run, batch, row, rows, start + row, sample) == ENDED:
                    return False
            except Exception as e:  # a CollateError, or a file read failing (FileDataset)
                self.channel.failed(e, f"in worker {self.id}, placing sample {indices[row]!r} "
                                    f"(returned by __getitems__) in its batch",
                                    run=run, batch=batch, pos=start + row)
                return True
        return True

    def _collate(self, run: int, batch: int | None, samples: list):
        if self.cfg.collate_fn is None:  # batch_size=None: the sample is the batch
            return samples[0]
        try:
            return self.cfg.collate_fn(samples)
        except Exception as e:
            self.channel.failed(e, f"in collate_fn in worker {self.id}", run=run, batch=batch)
            return _FAILED

    def _place_output(self, run: int, slot: int, output, tag: int) -> bool:
        """Place a collated batch as batch `slot`, tagged (its unit, or its
        number in the worker's stream); False once the run ended."""
        try:
            return self.writer.place(run, slot, 0, 1, tag, output, batched=False) != ENDED
        except Exception as e:  # a CollateError, or a file read failing
            self.channel.failed(e, f"in worker {self.id}, placing the output of batch {slot}",
                                run=run, batch=slot if self.cfg.in_order else None)
            return True

    # --- iterable datasets ---------------------------------------------------------

    def _wait_for_room(self, run: int, j: int) -> bool:
        """Until this worker may fill its j-th batch of the run; False if
        the run ended."""
        c = self.control
        i = (run % 2) * c.streams + self.id

        def ready():
            return sync.atomic_load(c.limits, i) > j or not c.live(run) or c.stopped

        self.sleeper.until(c.limit_bell, ready)
        return c.live(run) and not c.stopped

    def _stream_run(self, run: int, point: dict | None) -> _protocol.StreamEnd:
        """This worker's own pass over an iterable dataset, into its own
        batches (see NOTE [ Runs ]).  Returns how it ended (StreamEnd): its
        short last batch and its rows when rows fill in order, none when
        there is none or the run ended first; with a shuffle buffer, holes
        in its last batches for the batcher to close up.  point: where its
        copy of the dataset resumes from (NOTE [ Datasets that keep their
        own state ])."""
        cfg, c, N, w = self.cfg, self.control, self.cfg.streams, self.id
        epoch = c.read(run, _control.EPOCH)
        j0, done_below, done_past = 0, 0, set()   # a resumed epoch: what was delivered
        if c.read(run, _control.ORDER) == _order.ORDER_SHIPPED:
            words, _ = self.shared.read_order(run, c.read(run, _control.KEPT), 0, False)
            j0, done_below, done_past = stream_skips(words, N, w)
        slots = None if cfg.per_batch else StreamSlots(
            j0, cfg.rows, cfg.shuffle_batches,
            derived_seeds(cfg.seed & U64, epoch, w + 1, 1 << 62)[0],
            lambda j: self._wait_for_room(run, j))
        batches = _StreamBatches(j0)   # per_batch: this worker's batch j's samples so far
        ended = _protocol.NO_STREAM_END
        try:  # seq: the samples of the stream read before it
            it, seq = (iter(cfg.dataset), 0) if self.own is None else \
                self.own.open_stream(run, point)
        except Exception as e:
            self.channel.failed(e, f"in iter(dataset), in worker {w}",
                                run=run, batch=j0 * N + w if cfg.in_order else None)
            return ended
        while True:
            try:
                sample = self._next_of_stream(it, epoch, seq)
            except StopIteration:
                if self.own is not None:
                    self.own.stream_ended(run, it, seq)
                break
            except Exception as e:  # the stream is over; its batches in progress are dropped
                at = (batches.j if slots is None else slots.current) * N + w
                self.channel.failed(e, f"while iterating the dataset, in worker {w}",
                                    run=run, batch=at if cfg.in_order else None)
                return ended
            seq += 1
            if self.own is not None:  # before the sample can be in a batch main hands out
                self.own.read(run, it, seq)
            if seq - 1 < done_below or seq - 1 in done_past:
                continue  # read (and seeded) as before, so the stream goes on where it was
            placed = (self._add_to_stream_batch(run, batches, sample) if slots is None
                      else self._place_in_slot(run, slots, seq - 1, sample))
            if not placed:
                return ended
        return self._stream_ended(run, slots, batches)

    def _next_of_stream(self, it, epoch: int, seq: int):
        """The stream's next sample (seeded by its number, when reproducible)."""
        if self.seeder is not None:
            self.seeder(epoch, self.id + 1, seq)
        tracer = self.tracer
        t0 = now() if tracer is not None else 0
        sample = next(it)
        if tracer is not None:  # the stream's sample number as its position
            tracer.load(t0, now(), index=None, position=seq, samples=1, epoch=epoch)
        return sample

    def _add_to_stream_batch(self, run: int, batches: "_StreamBatches", sample) -> bool:
        """per_batch: collect the sample; place the batch once it is full.
        False: the run ended (or the batch could not be placed)."""
        batches.pending.append(sample)
        if len(batches.pending) < self.cfg.rows:
            return True
        if not self._wait_for_room(run, batches.j) or not self._place_stream_batch(
                run, batches.j, batches.pending):
            return False
        batches.pending, batches.j = [], batches.j + 1
        return True

    def _place_in_slot(self, run: int, slots: StreamSlots, pos: int, sample) -> bool:
        """Write the sample into its row (a shuffle buffer's random one).
        False: the stream is over for this epoch."""
        cfg, N, w = self.cfg, self.cfg.streams, self.id
        slot = slots.next()
        if slot is None:
            return False
        batch, row = slot[0] * N + w, slot[1]
        try:
            if self.writer.place(run, batch, row, cfg.rows, pos, sample) in (ENDED,
                                                                                     DROPPED):
                # ended, or the batcher gave up a batch of this stream (it cannot
                # collate it): the stream is over for this epoch; main raises the
                # batch's error and goes on with the other workers' batches
                return False
        except Exception as e:  # a CollateError, or a file read failing (FileDataset)
            self.channel.failed(e, f"in worker {w}, placing a sample in its batch",
                                run=run, batch=batch if cfg.in_order else None)
        return True

    def _stream_ended(self, run: int, slots: StreamSlots | None,
                      batches: "_StreamBatches") -> _protocol.StreamEnd:
        """What Done says once the stream ended (see _stream_run)."""
        cfg, N, w = self.cfg, self.cfg.streams, self.id
        ended = _protocol.NO_STREAM_END
        if slots is None:
            if batches.pending and not cfg.drop_last:
                if self._wait_for_room(run, batches.j):
                    self._place_stream_batch(run, batches.j, batches.pending)
            return ended
        written = slots.written()
        if not written:
            return ended
        if cfg.shuffle_batches:
            return _protocol.StreamEnd(holes_to_close=True)  # the batcher closes them up
        return _protocol.StreamEnd(last_batch=slots.current * N + w, last_rows=written)

    def _place_stream_batch(self, run: int, j: int, samples: list) -> bool:
        """Place this worker's j-th batch of a stream (collated here)."""
        batch = j * self.cfg.streams + self.id
        output = self._collate(run, batch, samples)
        return output is _FAILED or self._place_output(run, batch, output, j)


_FAILED = object()  # a collate_fn raised (and it was reported)


class _StreamBatches:
    """per_batch streams: the samples of this worker's batch j so far."""
    __slots__ = ("j", "pending")

    def __init__(self, j: int):
        self.j, self.pending = j, []


def worker_main(cfg: LoaderSpec, shared: SharedState, worker_id: int,
                joining_run: int = 0) -> None:
    Worker(cfg, shared, worker_id, joining_run).run()
    shared.to_batcher.close()
