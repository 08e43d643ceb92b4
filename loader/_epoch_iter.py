"""The iterator of one epoch: what iter(ShmLoader) returns.

An iterator object rather than a generator: an exception raised for one
batch (an error in dataset[i], say) does not end the epoch, so the next
next() goes on with the following batch, as PyTorch's DataLoader does.
Dropping an iterator before its end (break, del, garbage collection)
ends its run; see NOTE [ Runs ] in _control.py.
"""

from __future__ import annotations

import os
import time

from loader import _protocol as P
from loader._errors import WorkerError
from loader._layout import align
from loader._stats import EpochClock
from loader._trace import EPOCH, WAIT


class _Epoch:
    """What the map-style and stream epochs share: their run, the checks
    at every resumption, and the end."""

    def __init__(self, loader, epoch: int, resume: dict | None):
        self.loader, self.epoch, self.resume = loader, epoch, resume
        self.run = self.progress = None  # started by the first next(), as a generator would
        self.clock = None         # made with the run
        self.called = 0           # when the latest next() began
        self.control = loader._shared.control
        self.pending: dict = {}   # batch -> BatchReady received, not yet handed out
        self.errors: dict = {}    # batch -> Failed, raised when its turn comes (in order)
        self.ended = False        # RunEnded received
        self.finished = False     # every batch handed out (or raised)
        self.pid = os.getpid()

    def __iter__(self):
        return self

    def __next__(self):
        t0 = self.called = time.perf_counter_ns()  # all of next() is the loop waiting (stats())
        try:
            return self._next()
        finally:
            if self.clock is not None:
                t1 = time.perf_counter_ns()
                self.clock.loop_wait_ns += t1 - t0
                self.loader._tracer.record(WAIT, t0, t1, self.epoch)

    def start(self) -> None:
        """Start the run now, not at the first next(): loader.DataLoader
        with workers, as torch's iterator starts loading when it is made
        (and so draws the order then: NOTE [ Drawing the order as torch
        does ] in _torch.py)."""
        self.called = time.perf_counter_ns()
        self._resumed()

    def _begin(self) -> None:
        """The first next(): the epoch's run (NOTE [ Runs ])."""
        ld = self.loader
        self.run = ld._run_for(self.epoch, self.resume)
        self.progress = ld._track(self.run.plan)
        self.clock = EpochClock(ld._shared.waited, self.called)
        self.run_ended = None     # its RunEnded, for stats() at the epoch's end
        self._started()

    def _started(self) -> None:
        pass

    def _resumed(self) -> None:
        """What every next() checks first (and the first one starts)."""
        if self.finished:
            raise StopIteration
        self.loader._check_current(self.epoch)
        if self.run is None:
            self._begin()

    def _failed(self, msg: P.Failed) -> None:
        """In order, a batch's error is raised when its turn comes; else at once."""
        if self.loader.in_order and msg.batch >= 0:
            self.errors.setdefault(msg.batch, msg)
        else:
            self.loader._raise_failed(msg)

    def _receive(self):
        ld = self.loader
        deadline = None if ld.timeout is None else time.monotonic() + ld.timeout
        scaler = getattr(ld, "_autoscaler", None)
        if scaler is None:
            return ld._next_of(self.run.id, deadline)
        t0 = time.perf_counter()  # the training loop waits for data from here (_autoscale.py)
        try:
            return ld._next_of(self.run.id, deadline)
        finally:
            scaler.waited_for(time.perf_counter() - t0)

    def _hand_out(self, msg: P.BatchReady):
        scaler = getattr(self.loader, "_autoscaler", None)
        if scaler is not None:
            scaler.batch_handed_out()
        self.clock.bytes += align(msg.tags + 8 * msg.rows)  # the batch, not its whole pages
        self.clock.spilled_bytes += msg.values_bytes
        return self.loader._batch(msg)

    def _run_ended(self, msg: P.RunEnded) -> None:
        self.ended = True
        self.run_ended = msg

    def _done(self):
        self.finished = True
        try:  # (a DataStallWarning may be an error: -W error)
            if self.run_ended is not None:
                self.loader._record_stats(self.epoch, self.run_ended, self.clock)
                self.loader._tracer.record(EPOCH, self.clock.t0, time.perf_counter_ns(),
                                           self.epoch, self.run_ended.batches,
                                           self.run_ended.samples, 1)
        finally:
            self.close()
        raise StopIteration

    def close(self) -> None:
        """End the epoch here: batches received but not handed out go back,
        and the run ends unless it ran to its end."""
        ld = self.loader
        if self.pid != os.getpid() or getattr(self, "_closed", False):
            return  # a forked copy, finalized in a child: not its run
        self._closed = True
        if self.run is None:  # never started
            return
        if not self.finished:  # ended early (break, del): the trace shows where
            ld._tracer.record(EPOCH, self.clock.t0, time.perf_counter_ns(), self.epoch,
                              getattr(self, "yielded", -1), -1, 0)
        if ld._current is self.run and not self.finished:
            for msg in self.pending.values():
                ld._give_back(msg)
            self.pending.clear()
            ld._end(self.run)
            ld._current = None
        elif ld._current is self.run:
            ld._inboxes.pop(self.run.id, None)
        if not ld.persistent_workers and ld._epoch == self.epoch:
            ld._shutdown()  # (a newer iterator, already made, owns the processes)

    def __del__(self):
        if hasattr(self, "finished"):
            self.close()


class MapEpoch(_Epoch):
    """A map-style epoch: batches in order, or as they are ready."""

    def __init__(self, loader, epoch: int, resume: dict | None):
        super().__init__(loader, epoch, resume)
        self.yielded = 0                    # batches handed out or raised
        self.failed: set = set()            # in order: batches an error was reported for

    def _started(self) -> None:
        self.total = self.run.plan.nbatches

    def _next(self):
        ld = self.loader
        self._resumed()
        while True:
            batch = self._next_ready()
            if batch is not None:
                return batch
            if self.ended:
                if not ld.in_order or self.yielded == self.total:
                    self._done()
                raise WorkerError(f"ShmLoader: the run ended without batch {self.yielded} of "
                                  f"{self.total} and without an error for it")
            msg = self._receive()
            self._maybe_run_ahead()
            kind = type(msg)
            if kind is P.Failed:
                if ld.in_order and msg.batch >= 0:
                    self.failed.add(msg.batch)
                self._failed(msg)
            elif kind is P.RunEnded:
                if ld.in_order and msg.batches != self.total - len(self.failed):
                    raise WorkerError(
                        f"ShmLoader: epoch {self.epoch} ended after {msg.batches} of "
                        f"{self.total - len(self.failed)} batches without an error; its shared "
                        f"state was changed from outside (another process writing into this "
                        f"process's memory?)")
                self._run_ended(msg)
            else:
                self.pending[msg.batch] = msg

    def _maybe_run_ahead(self) -> None:
        ld, run = self.loader, self.run
        if (ld._ahead is None and ld._runs_ahead() and run.id - 1 not in ld._unended
                and self.control.claimed(run.id) >= run.plan.units):
            # every unit is claimed; the batches this epoch has left count
            # against the next one's prefetch
            ld._ahead = ld._start_run(self.epoch + 1, yielded=self._left())

    def _left(self) -> int:
        """Minus the batches of this run still to be handed out."""
        return self.yielded - self.run.plan.nbatches

    def _advance(self) -> None:
        self.yielded += 1
        ld = self.loader
        self.control.set_limit(self.run.id, ld._open_limit(self.run, self.yielded))
        if ld._current is not self.run and ld._current is not None \
                and ld._current.id == self.run.id:  # settled: its sampler ended (NOTE [ Runs ])
            self.run, self.total = ld._current, ld._current.plan.nbatches
        if ld._ahead is not None and ld._current is self.run:
            self.control.set_limit(ld._ahead.id, ld._open_limit(ld._ahead, self._left()))

    def _next_ready(self):
        """The next batch to hand out, if it is here (or raise its error:
        the next call goes on with the following batch)."""
        ld = self.loader
        if ld.in_order:
            failed = self.errors.pop(self.yielded, None)
            if failed is not None:
                self._advance()
                ld._raise_failed(failed)
            key = self.yielded if self.yielded in self.pending else None
        else:
            key = next(iter(self.pending), None)
        if key is None:
            return None
        msg = self.pending.pop(key)
        batch = self._hand_out(msg)
        if ld.in_order:
            self.progress.mark_batch(msg.batch)
        else:
            self.progress.mark_tags(ld._tags(msg))
        self._advance()
        return batch


class StreamEpoch(_Epoch):
    """An iterable dataset's epoch: each worker fills its own batches; in
    order, they come round-robin over the workers still going, as
    PyTorch delivers them (see NOTE [ Runs ])."""

    def __init__(self, loader, epoch: int, resume: dict | None):
        super().__init__(loader, epoch, resume)
        self.workers = max(loader.num_workers, 1)
        self.ends: dict = {}  # worker -> (its batch count, those it left empty)

    def _started(self) -> None:
        # a resumed epoch goes on where the round-robin was (NOTE [ Resuming an epoch ])
        self.next_id = min(j * self.workers + w
                           for w, j in enumerate(self.progress.first_batches()))

    def _skipped(self, batch: int) -> bool:
        w, j = batch % self.workers, batch // self.workers
        return w in self.ends and (j >= self.ends[w][0] or j in self.ends[w][1])

    def _all_over(self) -> bool:
        return len(self.ends) == self.workers and self.next_id > max(
            (k - 1) * self.workers + w for w, (k, _) in self.ends.items())

    def _next(self):
        ld = self.loader
        self._resumed()
        while True:
            batch = self._next_ready()
            if batch is not None:
                return batch
            if self.ended and not self.pending:
                if self.errors:
                    ld._raise_failed(self.errors.pop(min(self.errors)))
                self.progress.complete = True
                self._done()
            msg = self._receive()
            kind = type(msg)
            if kind is P.Failed:
                self._failed(msg)
            elif kind is P.StreamEnded:
                self.ends[msg.worker] = (msg.batches, set(msg.dropped))
            elif kind is P.RunEnded:
                self._run_ended(msg)
            else:
                self.pending[msg.batch] = msg

    def _next_ready(self):
        ld = self.loader
        if ld.in_order:
            while True:
                failed = self.errors.pop(self.next_id, None)
                if failed is not None:
                    self.next_id += 1
                    ld._raise_failed(failed)
                if self._skipped(self.next_id) and not self._all_over():
                    self.next_id += 1  # a batch that stream will never fill
                    continue
                break
            key = self.next_id if self.next_id in self.pending else None
        else:
            key = next(iter(self.pending), None)
        if key is None:
            return None
        msg = self.pending.pop(key)
        batch = self._hand_out(msg)
        if ld.in_order:
            self.next_id += 1
        worker = key % self.workers
        self.control.raise_worker_limit(self.run.id, worker)
        if ld._cfg.per_batch:
            self.progress.mark_batch(worker)
        else:
            self.progress.mark_tags(worker, ld._tags(msg))
        return batch
