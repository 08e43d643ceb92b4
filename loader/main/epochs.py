"""The iterator of one epoch: what iter(ShmLoader) returns.

An iterator object rather than a generator: an exception raised for one
batch (an error in dataset[i], say) does not end the epoch, so the next
next() goes on with the following batch, as PyTorch's DataLoader does.
Dropping an iterator before its end (break, del, garbage collection)
ends its run; see NOTE [ Runs ] in shared/control.py.

NOTE [ Who decides on main's batch path ]
=========================================

Each decision has one owner, and what an epoch is given never calls back
into the loader:

- which epoch is current: the loader's CurrentEpoch (below).  iter()
  moves it on, so every iterator made before is superseded (its next()
  raises); close() closes it; load_state_dict() sets the epoch a state is
  in.  An epoch reads it at every next(), and puts its plan there as its
  run begins: the one fact of an epoch that outlives a dropped iterator,
  and what state_dict() reads.
- the runs, their LIMITs and their ends, and the processes: Runs
  (main/runs.py).  It also stops the processes when the current epoch's
  iterator is done without persistent workers.
- the figures of an epoch that ran to its end: the StatsBook
  (main/stats.py) the loader keeps and reads, and its epochs record into.
- what the loop has received: the run's progress (order/progress.py),
  marked by the epoch.

An epoch asks its loader's parts for things only through an EpochHost,
made by the loader for each iter() with exactly those parts.  It holds
the loader itself only to keep it alive until the epoch ends (`for b in
ShmLoader(...)` holds nothing else), and never calls it.
"""

from __future__ import annotations

import os
import time

from loader.shared import messages as _protocol
from loader.errors import WorkerError, raise_reported
from loader.shared.layout import align
from loader.shared.spec import LoaderSpec
from loader.main.autoscale import workers_loading
from loader.main.stats import EpochClock, StatsBook

# _next_ready()'s "the next batch is not here yet": never None, which is a
# batch too (a sample of None with batch_size=None, a collate_fn's output)
NOT_READY = object()


# This process's id, kept by a fork hook: an epoch checks it at every next()
# (CurrentEpoch.check_owner), and os.getpid() is a system call each time
# (it is asked too, for a fork from C, which the hook does not see).
_this_pid = os.getpid()


def _note_fork() -> None:
    global _this_pid
    _this_pid = os.getpid()


os.register_at_fork(after_in_child=_note_fork)


class CurrentEpoch:
    """A loader's current epoch, as the loader and its iterators both see
    it (NOTE [ Who decides on main's batch path ])."""

    def __init__(self, owner_pid: int):
        self.owner_pid = owner_pid  # the process the loader belongs to
        self.number = 0             # epochs started by iter(): they pick the order and the seeds
        self.plan = None            # the plan of the epoch state_dict() describes (None: none)
        self.closed = False         # the loader was closed

    def check_owner(self) -> None:
        if _this_pid != self.owner_pid and os.getpid() != self.owner_pid:
            raise RuntimeError(
                f"this ShmLoader belongs to process {self.owner_pid}; a process forked from it "
                f"(this is {os.getpid()}) cannot use it: create a new ShmLoader here")

    def is_current(self, epoch: int) -> bool:
        return self.number == epoch

    def check(self, epoch: int) -> None:
        """An iterator of `epoch` is resumed: it must still be the loader's
        current one, in the process that owns the loader."""
        self.check_owner()
        if self.closed:
            raise ValueError("this ShmLoader is closed; create a new one")
        if self.number != epoch:
            raise RuntimeError("this ShmLoader iterator was superseded: iter(loader) was called "
                               "again, which starts a new epoch; use one iterator at a time")


class EpochHost:
    """What an epoch iterator may ask of its loader's parts, and nothing
    else: the run for its epoch, the next message of that run, batches,
    limits, the run started ahead, and its end.  One per iter(), given by
    the loader exactly what it may use (main/runs.py, main/session.py,
    main/stats.py, main/materialize.py, main/autoscale.py)."""

    def __init__(self, spec: LoaderSpec, *, current: CurrentEpoch, runs, session,
                 stats: StatsBook, tracer, materializer, autoscaler):
        self.current, self.stats, self.tracer = current, stats, tracer
        self._runs, self._session = runs, session
        self._materializer, self._autoscaler = materializer, autoscaler
        self.in_order, self._timeout = spec.in_order, spec.timeout
        self.control = session.shared.control
        self.streams = spec.streams                  # an iterable dataset's: one per worker
        self.per_batch = spec.per_batch              # a row's tag is its unit
        self._workers = spec.num_workers             # (num_workers="auto": the autoscaler's)

    @property
    def wait_clocks(self):
        """The children's wait clocks (NOTE [ Wait clocks ] in main/stats.py)."""
        return self._session.shared.waited

    def cpu_tasks(self) -> tuple[dict, list]:
        """Whose CPU time and waits to read (NOTE [ CPU starvation ] in main/stats.py)."""
        return self._session.cpu_tasks()

    def begin(self, epoch: int, resume: dict | None):
        """The run of the epoch, whose plan state_dict() now describes."""
        run = self._runs.run_for(epoch, resume)
        self.current.plan = run.plan
        return run

    def raise_failed(self, msg: _protocol.Failed):
        index = None
        if msg.index is None and msg.pos is not None:
            index = self._runs.index_at(msg.run, msg.pos)  # the batcher knows positions only
        raise_reported(msg, index)

    def next_message(self, run, held: dict):
        """The run's next message, within the loader's timeout; held: the
        batches the epoch received ahead of their turn (Runs.next_of)."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        scaler = self._autoscaler
        if scaler is None:
            return self._runs.next_of(run.id, deadline, held)
        t0 = time.perf_counter()  # the training loop waits for data from here (main/autoscale.py)
        try:
            return self._runs.next_of(run.id, deadline, held)
        finally:
            scaler.waited_for(time.perf_counter() - t0)

    def hand_out(self, msg: _protocol.BatchReady):
        """The user's batch of msg."""
        if self._autoscaler is not None:
            self._autoscaler.batch_handed_out()
        return self._session.batch(msg, self._materializer)

    def tags(self, msg: _protocol.BatchReady):
        return self._session.tags(msg)

    def advance(self, run, yielded: int, left: int, rowless: int = 0):
        """`yielded` batches of run were handed out (Runs.advance)."""
        return self._runs.advance(run, yielded, left, rowless)

    def run_ahead(self, run, next_epoch: int, left: int) -> None:
        """Every unit of run is claimed (Runs.start_ahead)."""
        self._runs.start_ahead(run, next_epoch, left)

    def epoch_ended(self, epoch: int, msg: _protocol.RunEnded, clock: EpochClock) -> None:
        """The epoch ran to its end: its figures for stats() and the trace."""
        self.stats.record(epoch, msg, clock, workers_loading(self._autoscaler, self._workers))
        self.tracer.epoch(clock.t0, time.perf_counter_ns(), epoch=epoch, batches=msg.batches,
                          samples=msg.samples, complete=True)

    def epoch_closed(self, epoch: int, run, *, finished: bool, pending) -> None:
        """The iterator is done (ran to its end, or dropped early): Runs.epoch_closed."""
        self._runs.epoch_closed(epoch, run, finished=finished, pending=pending)


class _Epoch:
    """What the map-style and stream epochs share: their run, the checks
    at every resumption, and the end."""

    def __init__(self, host, epoch: int, resume: dict | None):
        self.host, self.epoch, self.resume = host, epoch, resume
        self.in_order = host.in_order
        self.run = self.progress = None  # started by the first next(), as a generator would
        self.clock = None         # made with the run
        self.called = 0           # when the latest next() began
        self.control = host.control
        self.pending: dict = {}   # batch -> BatchReady received, not yet handed out
        self.errors: dict = {}    # batch -> Failed, raised when its turn comes (in order)
        self.ended = False        # RunEnded received
        self.finished = False     # every batch handed out (or raised)
        self.fatal = None         # a Failed that ended the run (raised at every next())
        self.pid = os.getpid()
        self.keep_alive = None    # its loader until the end, for lifetime only (ShmLoader.__iter__)

    def __iter__(self):
        return self

    def __next__(self):
        t0 = self.called = time.perf_counter_ns()  # all of next() is the loop waiting (stats())
        try:
            if self.fatal is not None:
                self.host.raise_failed(self.fatal)
            return self._next()
        finally:
            if self.clock is not None:
                t1 = time.perf_counter_ns()
                self.clock.loop_wait_ns += t1 - t0
                self.host.tracer.wait(t0, t1, epoch=self.epoch)

    def start(self) -> None:
        """Start the run now, not at the first next(): loader.DataLoader
        with workers, as torch's iterator starts loading when it is made
        (and so draws the order then: NOTE [ Drawing the order as torch
        does ] in torch/order.py)."""
        self.called = time.perf_counter_ns()
        self._resumed()

    def _begin(self) -> None:
        """The first next(): the epoch's run (NOTE [ Runs ])."""
        self.run = self.host.begin(self.epoch, self.resume)
        self.progress = self.run.plan.progress
        self.clock = EpochClock(self.host.wait_clocks, self.called, self.host.cpu_tasks)
        self.run_ended = None     # its RunEnded, for stats() at the epoch's end
        self._started()

    def _started(self) -> None:
        pass

    def _resumed(self) -> None:
        """What every next() checks first (and the first one starts)."""
        if self.finished:
            raise StopIteration
        self.host.current.check(self.epoch)
        if self.run is None:
            self._begin()

    def _next(self):
        """The next batch: handed out if it is here, else the run's
        messages taken until it is (or the epoch ends)."""
        self._resumed()
        while True:
            batch = self._next_ready()
            if batch is not NOT_READY:
                return batch
            self._nothing_ready()
            self._file(self._receive())

    def _next_ready(self):
        """The next batch to hand out, if it is here, else NOT_READY (or
        raise its error: the next call goes on with the following batch)."""
        raise NotImplementedError

    def _nothing_ready(self) -> None:
        """No batch to hand out yet: end the epoch if nothing more can come
        (StopIteration), or raise what stops it."""
        raise NotImplementedError

    def _file(self, msg) -> None:
        """A message of the run: a batch kept until its turn, a failure, an end."""
        raise NotImplementedError

    def _take(self, turn: int):
        """The BatchReady to hand out next (in order: batch `turn`;
        first-ready: the first here), taken from pending, or None."""
        if self.in_order:
            return self.pending.pop(turn, None)
        key = next(iter(self.pending), None)
        return None if key is None else self.pending.pop(key)

    def _failed(self, msg: _protocol.Failed) -> None:
        """In order, a batch's error is raised when its turn comes; else at
        once (and again at every next() if it ends the run)."""
        if msg.ends_run:
            self.fatal = msg
        if self.in_order and msg.batch is not None:
            self.errors.setdefault(msg.batch, msg)
        else:
            self.host.raise_failed(msg)

    def _receive(self):
        return self.host.next_message(self.run, self.pending)

    def _hand_out(self, msg: _protocol.BatchReady):
        self.clock.bytes += align(msg.tags + 8 * msg.rows)  # the batch, not its whole pages
        self.clock.spilled_bytes += msg.values_bytes
        return self.host.hand_out(msg)

    def _run_ended(self, msg: _protocol.RunEnded) -> None:
        self.ended = True
        self.run_ended = msg

    def _done(self):
        self.finished = True
        try:  # (a DataStallWarning may be an error: -W error)
            if self.run_ended is not None:
                self.host.epoch_ended(self.epoch, self.run_ended, self.clock)
        finally:
            self.close()
            # ended, the iterator no longer keeps its loader alive (main/loader.py,
            # __iter__): the loader goes when the loop's own reference does
            self.keep_alive = None
        raise StopIteration

    def close(self) -> None:
        """End the epoch here: batches received but not handed out go back,
        and the run ends unless it ran to its end."""
        if self.pid != os.getpid() or getattr(self, "_closed", False):
            return  # a forked copy, finalized in a child: not its run
        self._closed = True
        if self.run is None:  # never started
            return
        if not self.finished:  # ended early (break, del): the trace shows where
            # (no clock: a Ctrl-C landed between the run's start and its clock's)
            t0 = self.clock.t0 if self.clock is not None else self.called
            self.host.tracer.epoch(t0, time.perf_counter_ns(), epoch=self.epoch,
                                   batches=getattr(self, "yielded", None), samples=None,
                                   complete=False)
        pending = list(self.pending.values())
        self.pending.clear()
        self.host.epoch_closed(self.epoch, self.run, finished=self.finished, pending=pending)

    def __del__(self):
        if hasattr(self, "finished"):
            self.close()


class MapEpoch(_Epoch):
    """A map-style epoch: batches in order, or as they are ready."""

    def __init__(self, host, epoch: int, resume: dict | None):
        super().__init__(host, epoch, resume)
        self.yielded = 0                    # batches handed out or raised
        self.failed: set = set()            # batches an error was reported for
        self.rowless = 0  # first-ready: samples failed before taking a row (they widen its LIMIT)

    def _started(self) -> None:
        self.total = self.run.plan.nbatches

    def _nothing_ready(self) -> None:
        if self.ended:
            if not self.in_order or self.yielded == self.total:
                self._done()
            raise WorkerError(f"ShmLoader: the run ended without batch {self.yielded} of "
                              f"{self.total} and without an error for it")
        self._raise_feed_failure()

    def _file(self, msg) -> None:
        self._maybe_run_ahead()
        kind = type(msg)
        if kind is _protocol.Failed:
            self._batch_lost(msg)
            self._failed(msg)
        elif kind is _protocol.RunEnded:
            if self.in_order and msg.batches != self.total - len(self.failed):
                raise WorkerError(
                    f"ShmLoader: epoch {self.epoch} ended after {msg.batches} of "
                    f"{self.total - len(self.failed)} batches without an error; its shared "
                    f"state was changed from outside (another process writing into this "
                    f"process's memory?)")
            self._run_ended(msg)
            if not self.in_order:  # fewer batches than planned came: _left() is exact now
                self.run = self.host.advance(self.run, self.yielded, self._left(),
                                             self.rowless)
        else:
            self.pending[msg.batch] = msg

    def _batch_lost(self, msg: _protocol.Failed) -> None:
        """A batch the failure spoils will never come.  In order, it counts
        when its turn comes; first-ready, it counts now (once, however
        many of its samples failed), else the workers would wait for a
        LIMIT that only the batches handed out raise.  First-ready, a
        worker's sample that failed before it took a row spoils no batch:
        one more position may load instead (Runs.limit)."""
        if msg.batch is None:
            if not self.in_order and msg.worker is not None and msg.pos is not None \
                    and not self.run.plan.claims_batches:
                self.rowless += 1
                self.run = self.host.advance(self.run, self.yielded, self._left(), self.rowless)
            return
        if msg.batch in self.failed:
            return
        self.failed.add(msg.batch)
        if not self.in_order:
            self._advance()

    def _raise_feed_failure(self) -> None:
        """The loop asks for the run's batch `yielded` (first-ready: one
        more than the `yielded` it had): if its streamed sampler failed
        before that batch, raise what it raised (NOTE [ Int indices ])."""
        feed = self.run.plan.feed
        if feed is not None and feed.failure is not None and \
                self.yielded >= feed.whole_batches(self.run.batches):
            raise feed.failure.with_traceback(None)

    def _maybe_run_ahead(self) -> None:
        if self.control.claimed(self.run.id) >= self.run.plan.units:
            # every unit is claimed; the batches this epoch has left count
            # against the next one's prefetch
            self.host.run_ahead(self.run, self.epoch + 1, self._left())

    def _left(self) -> int:
        """Minus the batches of this run still to be handed out (the run
        started ahead may load that many fewer: Runs.limit())."""
        if self.ended:  # every batch of the run came: those here are all that is left
            return -(len(self.pending) + len(self.errors))
        batches = self.run.batches
        # first-ready, rows fill in arrival order: each batch's worth of
        # samples that failed before taking a row is a batch that never comes
        never = self.rowless // batches.size if self.rowless and batches.offsets is None else 0
        return self.yielded - self.run.plan.nbatches + never

    def _advance(self) -> None:
        self.yielded += 1
        self.run = self.host.advance(self.run, self.yielded, self._left(), self.rowless)
        self.total = self.run.plan.nbatches  # a run settled once its sampler ended

    def _next_ready(self):
        if self.in_order:
            failed = self.errors.pop(self.yielded, None)
            if failed is not None:
                self._advance()
                self.host.raise_failed(failed)
        msg = self._take(self.yielded)
        if msg is None:
            return NOT_READY
        batch = self._hand_out(msg)
        if self.in_order:
            self.progress.mark_batch(msg.batch)
        else:
            self.progress.mark_tags(self.host.tags(msg))
        self._advance()
        return batch


class StreamEpoch(_Epoch):
    """An iterable dataset's epoch: each worker fills its own batches; in
    order, they come round-robin over the workers still going, as
    PyTorch delivers them (see NOTE [ Runs ])."""

    def __init__(self, host, epoch: int, resume: dict | None):
        super().__init__(host, epoch, resume)
        self.workers = host.streams
        self.ends: dict = {}  # worker -> (its batch count, those it left empty)
        self.lost: set = set()  # batches a failure spoiled, counted as handed out

    def _started(self) -> None:
        # a resumed epoch goes on where the round-robin was (NOTE [ Resuming an epoch ])
        self.next_id = min(j * self.workers + w
                           for w, j in enumerate(self.progress.first_batches()))

    def _batch_lost(self, batch: int | None) -> None:
        """A batch a failure spoils counts as handed out (in order when its
        turn comes, first-ready at once): its worker may fill one more, else
        it would wait for a limit only the batches handed out raise."""
        if batch is None or batch in self.lost:
            return
        self.lost.add(batch)
        self.control.raise_worker_limit(self.run.id, batch % self.workers)

    def _skipped(self, batch: int) -> bool:
        w, j = batch % self.workers, batch // self.workers
        return w in self.ends and (j >= self.ends[w][0] or j in self.ends[w][1])

    def _all_over(self) -> bool:
        return len(self.ends) == self.workers and self.next_id > max(
            (k - 1) * self.workers + w for w, (k, _) in self.ends.items())

    def _nothing_ready(self) -> None:
        if self.ended and not self.pending:
            if self.errors:
                self.host.raise_failed(self.errors.pop(min(self.errors)))
            self.progress.complete = True
            self._done()

    def _file(self, msg) -> None:
        kind = type(msg)
        if kind is _protocol.Failed:
            if not self.in_order:
                self._batch_lost(msg.batch)
            self._failed(msg)
        elif kind is _protocol.StreamEnded:
            self.ends[msg.worker] = (msg.batches, set(msg.dropped))
        elif kind is _protocol.RunEnded:
            self._run_ended(msg)
        else:
            self.pending[msg.batch] = msg

    def _next_ready(self):
        if self.in_order:
            while True:
                failed = self.errors.pop(self.next_id, None)
                if failed is not None:
                    self._batch_lost(self.next_id)
                    self.next_id += 1
                    self.host.raise_failed(failed)
                if self._skipped(self.next_id) and not self._all_over():
                    self.next_id += 1  # a batch that stream will never fill
                    continue
                break
        msg = self._take(self.next_id)
        if msg is None:
            return NOT_READY
        batch = self._hand_out(msg)
        if self.in_order:
            self.next_id += 1
        worker = msg.batch % self.workers
        self.control.raise_worker_limit(self.run.id, worker)
        if self.host.per_batch:
            self.progress.mark_batch(worker)
        else:
            self.progress.mark_tags(worker, self.host.tags(msg))
        return batch
