"""num_workers=0: the epoch is loaded in the main process, in the order and
with the collate rules the workers follow, as PyTorch's DataLoader does
without workers."""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np

from loader.shared.spec import LoaderSpec
from loader.worker import fetch as _fetch
from loader.order import indices as _order
from loader.main.epochs import CurrentEpoch
from loader.main.stats import EpochClock, StatsBook, Task
from loader.shared.layout import LayoutCache, signature_and_leaves, stack
from loader.main.materialize import materialize
from loader.order.planning import order_of, settled_plan
from loader.order.feed import BatchFeed
from loader.worker.seeding import SampleSeeder
from loader.shared.optional import imported_torch
from loader.datasets.own_state import CopyState


def _raise(exc: BaseException, where: str, run: int):
    """num_workers=0: an error of the dataset's state_dict() is raised as it is."""
    raise exc


def _training_thread() -> tuple[dict, list]:
    """num_workers=0: the thread that loads is the training loop's
    (NOTE [ CPU starvation ] in main/stats.py)."""
    return {"loop": [Task(threading.get_native_id(), thread=True)]}, [os.getpid()]


class _SavedGenerators:
    """reproducible=True seeds the global generators before each sample;
    in the main process they are the training loop's too (dropout, its own
    shuffles), so their states are put back after each batch."""

    def __init__(self):
        torch = imported_torch()
        self.torch = torch
        self.states = (random.getstate(), np.random.get_state(),
                       torch.get_rng_state() if torch is not None else None)

    def restore(self):
        random.setstate(self.states[0])
        np.random.set_state(self.states[1])
        if self.torch is not None:
            self.torch.set_rng_state(self.states[2])


class InlineEpoch:
    """One epoch loaded in the main process.  An iterator (not a generator)
    so that an error for one batch does not end the epoch: the next next()
    goes on with the following batch, as PyTorch's DataLoader does."""

    def __init__(self, spec: LoaderSpec, epoch: int, resume: dict | None, *, planner, tracer,
                 current: CurrentEpoch, stats: StatsBook):
        """spec: the loader's (shared/spec.py) as the epoch begins; planner,
        tracer, current, stats: what the loader gives its epochs
        (main/planner.py, shared/trace.py; NOTE [ Who decides on main's
        batch path ] in main/epochs.py)."""
        self.spec, self.epoch, self.resume = spec, epoch, resume
        self.planner, self.tracer, self.current, self.stats = planner, tracer, current, stats
        self.torch_rules = spec.torch_rules
        self.cache = LayoutCache()
        self.seeder = SampleSeeder(spec.seed) if spec.reproducible else None
        # as a worker loads (worker/fetch.py); __getitems__'s error is raised as it
        # is, as torch raises it, with a note naming the batch's indices
        self.fetcher = _fetch.Fetcher(spec.dataset, self.seeder, noted=True)
        self.plan = None  # made at the first next()
        self.clock = None
        self.batches = self.samples = 0   # delivered (a batch that raised is not)
        self.keep_alive = None  # its loader, for lifetime only (ShmLoader.__iter__)

    def __iter__(self):
        return self

    def close(self) -> None:
        """Nothing runs between batches in the main process: nothing to stop."""

    def _begin(self) -> None:
        ld = self.spec
        plan = self.plan = self.planner.plan(self.epoch, self.resume)
        self.planner.tell_order(plan)
        self.current.plan = plan  # the plan state_dict() now describes
        self.progress = plan.progress
        self.k = 0                      # the next batch
        own = None  # NOTE [ Datasets that keep their own state ]: main's copy
        if plan.own is not None and not ld.iterable:
            plan.own.begin_in_main(ld.dataset, plan.own_load)
        if ld.iterable:
            if plan.own is not None:  # its stream reports to the run's book as a worker's does
                own = CopyState(ld.dataset, 0, True, self.rows, plan.own.record, _raise)
                point = None if plan.own_load is None else plan.own_load[0]
                self.stream, self.seq = own.open_stream(0, point)
            else:
                self.stream, self.seq = iter(ld.dataset), 0
            self.own, self.ended = own, False
            self.load = self.fetcher.stream(self.stream, self.epoch, 1)
            return
        order = order_of(plan, ld.rank, ld.world)
        self.geometry = plan.progress.batches  # (a streamed batch sampler's: as it is pulled)
        self.index_of = _order.index_getter(order)
        self.order = order
        self.batched = _fetch.batch_fetcher(ld.dataset, ld.batch_size, False) is not None
        self.load = self.fetcher.positions(self.epoch, self.index_of)

    def __next__(self):
        t0 = time.perf_counter_ns()  # all of next() is the training loop waiting
        if self.plan is None:
            self.clock = EpochClock(None, t0, _training_thread)
        try:
            if self.plan is None:
                self._begin()
            batch, rows = self._next()
            self.batches += 1
            self.samples += rows
            return batch
        except StopIteration:
            clock, self.clock = self.clock, None
            if clock is not None:  # the first StopIteration: the epoch's end
                t1 = time.perf_counter_ns()
                clock.loop_wait_ns += t1 - t0
                self.tracer.wait(t0, t1, epoch=self.epoch)
                self.stats.record(self.epoch, None, clock, self.spec.num_workers, self.batches,
                                  self.samples)
                self.tracer.epoch(clock.t0, t1, epoch=self.epoch, batches=self.batches,
                                  samples=self.samples, complete=True)
            raise
        finally:
            if self.clock is not None:
                t1 = time.perf_counter_ns()
                self.clock.loop_wait_ns += t1 - t0
                self.tracer.wait(t0, t1, epoch=self.epoch)

    def _next(self):
        if self.spec.iterable:
            return self._next_of_stream()
        k = self.k
        if self.plan.feed is not None and self.plan.feed.open and not self.plan.feed.settled:
            self._learn_end(k)
        if k >= self.plan.nbatches:
            raise StopIteration
        self.k += 1  # (an error in this batch leaves the next one to the next call)
        start, stop = self.geometry.span(k)
        saved = _SavedGenerators() if self.seeder is not None else None
        try:
            if self.batched:
                samples = self.fetcher.batch(self.epoch, _fetch.indices_of(self.order, start, stop),
                                             start)
            else:
                samples = [self.load(pos) for pos in range(start, stop)]
        finally:
            if saved is not None:
                saved.restore()
        batch = self._collate(k, samples, lambda row: self.index_of(start + row))
        self.progress.mark_batch(k)
        return batch, len(samples)

    def _learn_end(self, k: int) -> None:
        """A sampler without len(): pull it through batch k, and if it
        ended, take the epoch's final length (NOTE [ Streamed samplers ])."""
        feed = self.plan.feed
        if isinstance(feed, BatchFeed):
            feed.feed_batches(k + 1)
        else:
            feed.feed(self.geometry.span(k)[1] if k < self.geometry.count else self.plan.kept)
        plan = settled_plan(self.plan, self.spec)
        if plan is not None:
            self.plan, self.geometry = plan, plan.progress.batches

    @property
    def rows(self) -> int:
        return self.spec.rows

    def _next_of_stream(self):
        ld = self.spec
        B = self.rows
        skip = self.progress.prefix[0]  # a resumed epoch: samples delivered already
        pending = []
        while len(pending) < B and not self.ended:
            saved = _SavedGenerators() if self.seeder is not None else None
            try:
                try:
                    sample = self.load(self.seq)
                except StopIteration:
                    self.ended = True
                    if self.own is not None:
                        self.own.stream_ended(0, self.stream, self.seq)
                    break
            finally:
                if saved is not None:
                    saved.restore()
            self.seq += 1
            if self.own is not None:
                self.own.read(0, self.stream, self.seq)
            if self.seq > skip:
                pending.append(sample)
        if not pending or (len(pending) < B and ld.drop_last):
            self.progress.complete = True
            raise StopIteration
        self.k += 1
        batch = self._collate(self.k - 1, pending)
        self.progress.mark_batch(0)
        return batch, len(pending)

    def _collate(self, k: int, samples: list, index_of=None):
        ld = self.spec
        if ld.collate_fn is not None:
            out = ld.collate_fn(samples)
            if self.torch_rules:
                return out  # as PyTorch returns it
            return self._convert(out)
        if ld.batch_size is None:
            return self._convert(samples[0])
        spec, buf = stack(samples, self.cache, batch=k, index_of=index_of)
        if self.clock is not None:
            self.clock.bytes += buf.nbytes
        return materialize(spec, buf, ld.output, self.torch_rules)

    def _convert(self, obj):
        """An unbatched value (batch_size=None, or a collate_fn's output)
        with its arrays made what the loader's output asks for."""
        sig, leaves = signature_and_leaves(obj)
        layout = self.cache.get(sig, 1, batched=False)
        buf = np.empty(layout.nbytes, np.uint8)
        values = layout.write_row(buf, 0, leaves)
        return materialize(layout.spec(1, {0: values}), buf, self.spec.output,
                           self.torch_rules)
