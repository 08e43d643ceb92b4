"""ShmLoader: the main-process side.  See NOTE [ ShmLoader processes and
shutdown ] in _protocol.py for the processes and how they stop, and NOTE
[ Runs ] in _control.py for how passes over the data are started."""

from __future__ import annotations

import atexit
import collections
import os
import secrets
import signal
import time
import warnings
import weakref
from typing import NamedTuple

import numpy as np

import shmq
from loader import _control as C
from loader import _protocol as P
from loader._collator import collator_main
from loader._layout import materialize
from loader._procs import LoaderStartError, fork_children, start_error, wait_all
from loader._shared import LoaderConfig, SharedState
from loader._native import LeaseBook
from loader._worker import worker_main

__all__ = ["ShmLoader", "WorkerError", "LoaderTimeout", "LoaderStartError"]

_live_loaders: "weakref.WeakSet[ShmLoader]" = weakref.WeakSet()


class WorkerError(RuntimeError):
    """A worker or the collator failed.  The message carries the original
    traceback (or the signal or exit code), the worker id, its pid and the
    sample index."""


class LoaderTimeout(WorkerError, TimeoutError):
    """No batch arrived within the loader's ``timeout``."""


class _Run(NamedTuple):
    id: int
    epoch: int
    kept: int       # positions delivered; -1 for an iterable dataset
    units: int      # what workers claim: positions, or batches with a collate_fn; -1 iterable
    batches: int    # -1 for an iterable dataset


def _default_memory_cap() -> int:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1 << 30, pages // 4)


def _positive_int(name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class ShmLoader:
    """Batches from arbitrary Python preprocessing, at memory speed.

    Forked workers run ``dataset[i]`` (or iterate an iterable dataset) and
    write each sample straight into its row of a batch slab in shared
    memory (a collator process lays the slabs out); iterating yields numpy
    arrays (or torch tensors with ``output="torch"``) that view those slabs:
    no copy, no unpickling in the training loop.  A slab is reused only when
    every array of its batch is gone, so batches you keep stay intact.
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, num_workers=2,
                 collate_fn=None, drop_last=False, in_order=True, prefetch=None,
                 persistent_workers=True, worker_init_fn=None, seed=None, timeout=None,
                 output="numpy", memory_cap_bytes=None):
        _positive_int("batch_size", batch_size)
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1 (ShmLoader always uses worker "
                             f"processes), got {num_workers!r}")
        if output not in ("numpy", "torch"):
            raise ValueError(f"output must be 'numpy' or 'torch', got {output!r}")
        if sampler is not None and shuffle:
            raise ValueError("sampler and shuffle=True are exclusive: shuffle inside the sampler")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if prefetch is not None:
            _positive_int("prefetch", prefetch)
        if memory_cap_bytes is not None:
            _positive_int("memory_cap_bytes", memory_cap_bytes, 4096)
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
        self.iterable = not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))
        if self.iterable and (sampler is not None or shuffle):
            raise ValueError("an iterable dataset orders its own samples: sampler and shuffle "
                             "apply to map-style datasets (with __getitem__ and __len__) only")
        self.dataset, self.batch_size, self.shuffle, self.sampler = dataset, batch_size, shuffle, sampler
        self.num_workers, self.collate_fn, self.drop_last, self.in_order = (
            num_workers, collate_fn, drop_last, in_order)
        self.prefetch = prefetch if prefetch is not None else 3
        self.persistent_workers, self.worker_init_fn, self.timeout = (
            persistent_workers, worker_init_fn, timeout)
        self.output = output
        self.seed = seed if seed is not None else secrets.randbits(63)
        self.memory_cap_bytes = memory_cap_bytes or _default_memory_cap()
        self._epoch = 0          # epochs started by iter(): they pick the order and the seeds
        self._runs = 0           # runs started (see NOTE [ Runs ])
        self._current = None     # the run of the latest iter()
        self._ahead = None       # the next epoch's run, started before its iter()
        self._inboxes: dict[int, collections.deque] = {}  # messages of the runs main reads
        self._unended: set[int] = set()                     # runs whose RunEnded has not come
        self._owner_pid = os.getpid()
        self._procs: list = []
        self._shared = None
        self._closed = False
        self._stats = None
        _live_loaders.add(self)

    # --- sizes ----------------------------------------------------------------------

    def _kept(self, n: int) -> int:
        """Of n positions, those an epoch delivers (drop_last drops a short batch)."""
        return n // self.batch_size * self.batch_size if self.drop_last else n

    def __len__(self):
        if self.iterable:
            raise TypeError("an iterable dataset has no length; ShmLoader cannot know its "
                            "number of batches")
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return -(-self._kept(n) // self.batch_size)

    def stats(self) -> dict | None:
        """How the last epoch whose end was seen was delivered: batches,
        samples, rows the collator had to write itself (samples of a batch
        whose dtypes differ) and batches laid out again (shapes that change
        between batches, promotions).  None before the end of the first
        epoch."""
        return None if self._stats is None else dict(self._stats)

    # --- processes ----------------------------------------------------------------------

    def _check_owner(self):
        if os.getpid() != self._owner_pid:
            raise RuntimeError(
                f"this ShmLoader belongs to process {self._owner_pid}; a process forked from it "
                f"(this is {os.getpid()}) cannot use it: create a new ShmLoader here")

    def _start(self):
        cfg = LoaderConfig(
            dataset=self.dataset, batch_size=self.batch_size, num_workers=self.num_workers,
            prefetch=self.prefetch, drop_last=self.drop_last, in_order=self.in_order,
            iterable=self.iterable, collate_fn=self.collate_fn,
            worker_init_fn=self.worker_init_fn, seed=self.seed,
            memory_cap_bytes=self.memory_cap_bytes, parent_pid=os.getpid())
        try:
            shared = SharedState(cfg)
        except BaseException as e:
            raise start_error(e, "create its shared memory") from e
        try:
            specs = [(f"worker {i}", worker_main, (cfg, shared, i)) for i in range(self.num_workers)]
            specs.append(("the collator", collator_main, (cfg, shared)))
            self._procs = fork_children(specs)
        except BaseException:
            shared.close()
            raise
        self._cfg, self._shared = cfg, shared
        self._leases = LeaseBook(shared.arena, shared.released, shared.control.collator_bell)
        self._next_child_check = 0.0

    def _check_children(self):
        dead = [c for c in self._procs if c.exitcode is not None]
        if dead:
            raise WorkerError("\n".join(self._death_report(c) for c in dead))

    def _death_report(self, child) -> str:
        words = child.last_words()
        text = f"ShmLoader: {child.role} (pid {child.pid}) {child.how_it_ended()}"
        return f"{text}; it wrote:\n{words}" if words else text

    def _report_dead_children(self, cause: BaseException):
        """to_main's producer is gone: report how the children ended (they
        may still be dying: wait a little for their exit status)."""
        wait_all(self._procs, 1.0)
        self._check_children()
        raise WorkerError(f"ShmLoader: the collator's ring to main ended ({cause}) while every "
                          f"process is still running") from cause

    def _shutdown(self):
        """See NOTE [ ShmLoader processes and shutdown ] in _protocol.py.
        Interrupted (a Ctrl-C while it waits for the children), it is done
        by the next call: close() again, __del__ or interpreter exit."""
        shared = self._shared
        if shared is None:
            return
        if self._procs:
            control = shared.control
            for run in (self._runs - 1, self._runs):
                if run > 0:
                    control.end_run(run)
            control.stop()
            if not wait_all(self._procs, P.JOIN_TIMEOUT_S):
                for c in self._procs:
                    c.kill()
                wait_all(self._procs, P.JOIN_TIMEOUT_S)
            for c in self._procs:
                c.exitcode  # reaped
                c.close()
            self._procs = []
        shared.close()
        self._leases.close()  # the arena's pages no batch you hold uses go back now
        self._shared = None
        self._inboxes.clear()
        self._unended.clear()
        self._current = self._ahead = None

    def close(self):
        """Stop the workers and the collator.  Batches you hold stay valid.
        Safe to call again, e.g. after a Ctrl-C interrupted it."""
        self._closed = True
        if os.getpid() != self._owner_pid:
            self._procs, self._shared = [], None  # a forked copy: its parent's processes
            return
        self._shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_shared", None) is not None and os.getpid() == self._owner_pid:
            self.close()

    # --- receiving --------------------------------------------------------------------

    def _receive(self, deadline=None):
        """The next message from the collator.  Waits in bounded slices,
        checking the children and the deadline (the loader's timeout)."""
        control = self._shared.control
        while True:
            try:
                msg = self._shared.to_main.get(timeout=P.WAIT_SLICE_S)
            except shmq.Empty:
                self._check_children()
                if deadline is not None and time.monotonic() > deadline:
                    raise LoaderTimeout(
                        f"ShmLoader: no batch within timeout={self.timeout}s; a worker may be "
                        f"stuck in dataset[...]. Their stacks:\n{self._worker_stacks()}") from None
                continue
            except (shmq.PeerLost, shmq.Closed) as e:
                self._report_dead_children(e)
            if shmq.atomic_load(control.ctl, C.OUTBOX):
                control.collator_bell.ring()  # it has messages our full ring could not take
            now = time.monotonic()
            if now >= self._next_child_check:
                # Batches may never stop coming while a worker is dead (in
                # first-ready mode the others fill them): look anyway.
                self._next_child_check = now + P.WAIT_SLICE_S
                self._check_children()
            return msg

    def _worker_stacks(self) -> str:
        """Each worker's Python stacks, written by faulthandler on SIGUSR1
        (it works even while the worker is stuck inside a C call)."""
        workers = [c for c in self._procs if c.role != "the collator"]
        for c in workers:
            c.report.seek(0)
            c.report.truncate()
            try:
                os.kill(c.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.3)  # faulthandler writes from a signal handler; give it a moment
        return "\n".join(f"--- {c.role} (pid {c.pid}) ---\n{c.last_words() or '(no answer)'}"
                         for c in workers)

    def _route(self, msg) -> None:
        """File a message under its run: the runs main still reads get it;
        a batch of a run main abandoned is released at once."""
        kind = type(msg)
        if kind is P.MemoryWait:
            warnings.warn(
                f"ShmLoader: all {msg.cap_bytes} bytes of batch memory are held ({msg.held_bytes} "
                f"bytes in {msg.held_batches} batches in flight or still referenced by your "
                f"code), and the next batch needs {msg.need_bytes}; waiting for some to be "
                f"dropped. Keep fewer batches (copy what you keep) or pass a larger "
                f"memory_cap_bytes", RuntimeWarning, stacklevel=4)
            return
        if kind is P.RunEnded:
            self._unended.discard(msg.run)
        inbox = self._inboxes.get(msg.run)
        if inbox is not None:
            inbox.append(msg)
        elif kind is P.BatchReady:
            self._give_back(msg)

    def _next_of(self, run: int, deadline):
        inbox = self._inboxes[run]
        while not inbox:
            self._route(self._receive(deadline))
        return inbox.popleft()

    # --- runs ------------------------------------------------------------------------

    def _order(self, epoch):
        """(size, order kind, seed, order to ship or None) of an epoch."""
        if self.sampler is not None:
            order = np.fromiter((int(i) for i in self.sampler), dtype=np.int64)
            return len(order), C.ORDER_SHIPPED, 0, order
        if self.shuffle:
            return len(self.dataset), C.ORDER_PERMUTATION, self.seed, None
        return len(self.dataset), C.ORDER_RANGE, 0, None

    def _units_per_batch(self) -> int:
        return 1 if self.collate_fn is not None else self.batch_size

    def _start_run(self, epoch) -> _Run:
        """Start a pass over the data for `epoch` (see NOTE [ Runs ])."""
        run = self._runs + 1
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while run - 2 in self._unended:  # its block is about to be reused
            self._route(self._receive(deadline))
        if self.iterable:
            size = kept = units = batches = -1
            kind, order_seed, order = C.ORDER_RANGE, 0, None
        else:
            size, kind, order_seed, order = self._order(epoch)
            kept = self._kept(size)
            batches = -(-kept // self.batch_size)
            units = batches if self.collate_fn is not None else kept
        if order is not None:
            self._shared.write_order(run, order)
        self._runs = run
        self._unended.add(run)
        self._inboxes[run] = collections.deque()
        self._shared.control.start_run(run, epoch, size, kept, units, kind, order_seed,
                                       self.prefetch * self._units_per_batch())
        return _Run(run, epoch, kept, units, batches)

    def _end(self, run: _Run | None) -> None:
        """Main will read no more of this run: its workers stop, and its
        batches are released as they come."""
        if run is None:
            return
        self._shared.control.end_run(run.id)
        for msg in self._inboxes.pop(run.id, ()):
            if type(msg) is P.BatchReady:
                self._give_back(msg)

    def _give_back(self, msg: P.BatchReady) -> None:
        """A batch nobody will see: its slab is free at once."""
        shmq.atomic_store(self._shared.released, msg.slab.lease, msg.slab.generation)
        self._shared.control.collator_bell.ring()

    def _runs_ahead(self) -> bool:
        """Can the next epoch start before this one ends?  Not when the
        next order is the user's to make (a sampler, which may wait for
        set_epoch(); an iterable dataset), nor without persistent workers."""
        return self.persistent_workers and self.sampler is None and not self.iterable

    def _run_for(self, epoch) -> _Run:
        """The run for `epoch`: the one started ahead if len(dataset) has not
        changed since, else a new one."""
        ahead, self._ahead = self._ahead, None
        self._end(self._current)  # an iterator this one supersedes
        self._current = None
        if ahead is not None and ahead.epoch == epoch and ahead.kept == self._kept(len(self.dataset)):
            self._current = ahead
            return ahead
        self._end(ahead)
        self._current = self._start_run(epoch)
        return self._current

    # --- iteration ----------------------------------------------------------------------

    def __iter__(self):
        if self._closed:
            raise ValueError("this ShmLoader is closed; create a new one")
        self._check_owner()
        if self._shared is None:
            self._start()
        self._epoch += 1
        return self._epoch_batches(self._epoch)

    def _epoch_batches(self, epoch):
        run = self._run_for(epoch)
        control = self._shared.control
        pending, errors = {}, {}
        by_index = self.in_order and not self.iterable  # else: in arrival order
        yielded = 0
        total = None if run.batches < 0 else run.batches
        ended = finished = False
        per_batch = self._units_per_batch()
        try:
            while not (ended and yielded == total):
                self._check_current(epoch)
                deadline = None if self.timeout is None else time.monotonic() + self.timeout
                msg = self._next_of(run.id, deadline)
                if (self._ahead is None and self._runs_ahead() and run.id - 1 not in self._unended
                        and control.claimed(run.id) >= run.units):
                    self._ahead = self._start_run(epoch + 1)  # every unit is claimed
                kind = type(msg)
                if kind is P.Failed:
                    if by_index and msg.batch >= 0:
                        errors[msg.batch] = msg  # raised when its turn comes
                    else:
                        self._raise_failed(msg)
                elif kind is P.RunEnded:
                    if total is not None and msg.batches != total and not errors:
                        raise WorkerError(
                            f"ShmLoader: epoch {epoch} ended after {msg.batches} of {total} "
                            f"batches without an error; its shared state was changed from outside "
                            f"(another process writing into this process's memory?)")
                    total, ended = msg.batches, True
                    self._stats = {"epoch": epoch, "batches": msg.batches, "samples": msg.samples,
                                   "samples_written_by_workers": msg.samples - msg.rows_by_collator,
                                   "samples_written_by_collator": msg.rows_by_collator,
                                   "relayouts": msg.relayouts}
                else:
                    pending[msg.batch] = msg
                while True:
                    if by_index:
                        if yielded in errors:
                            self._raise_failed(errors[yielded])
                        key = yielded if yielded in pending else None
                    else:
                        key = next(iter(pending), None)
                    if key is None:
                        break
                    batch = self._batch(pending.pop(key))
                    yielded += 1
                    control.set_limit(run.id, (yielded + self.prefetch) * per_batch)
                    yield batch
                    self._check_current(epoch)
                if ended and by_index and yielded != total and yielded not in pending:
                    raise WorkerError(f"ShmLoader: the run ended without batch {yielded} of "
                                      f"{total} and without an error for it")
            finished = True
        finally:
            if os.getpid() == self._owner_pid:  # not a forked copy finalized in a child
                self._finish_iterator(run, pending, finished)

    def _finish_iterator(self, run: _Run, pending: dict, finished: bool) -> None:
        """An epoch's iterator ends (exhausted, broken out of, dropped)."""
        if self._current is run and not finished:
            for msg in pending.values():  # received but never handed out
                self._give_back(msg)
            self._end(run)
            self._current = None
        elif self._current is run:
            self._inboxes.pop(run.id, None)
        if not self.persistent_workers:
            self._shutdown()

    def _check_current(self, epoch):
        """An iterator is resumed: it must still be the loader's current one,
        in the process that owns the loader."""
        self._check_owner()
        if self._closed:
            raise ValueError("this ShmLoader is closed; create a new one")
        if self._epoch != epoch:
            raise RuntimeError("this ShmLoader iterator was superseded: iter(loader) was called "
                               "again, which starts a new epoch; use one iterator at a time")

    def _raise_failed(self, msg: P.Failed):
        who = "the collator" if msg.worker < 0 else f"worker {msg.worker}"
        if msg.index >= 0:
            at = f" on sample index {msg.index} (position {msg.pos})"
        elif msg.batch >= 0:
            at = f" on batch {msg.batch}"
        else:
            at = ""
        raise WorkerError(f"ShmLoader: {who} (pid {msg.pid}) raised {msg.error.type_name}{at}:\n"
                          f"{msg.error.text}")

    def _batch(self, msg: P.BatchReady):
        s = msg.slab
        slab = self._leases.view(s.lease, s.generation, s.offset, s.nbytes)
        return materialize(msg.spec, slab, self.output == "torch")


def _close_all():
    for loader in list(_live_loaders):
        if loader._owner_pid == os.getpid():
            loader.close()


atexit.register(_close_all)
