"""ShmLoader: the main-process side.  See NOTE [ ShmLoader processes and
shutdown ] in _protocol.py for the processes and how they stop."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import secrets
import signal
import tempfile
import threading
import time
import warnings
import weakref
from typing import NamedTuple

import numpy as np

import shmq
from shmq import segment
from loader import _protocol as P
from loader._collate import materialize
from loader._collator import collator_main
from loader._slabs import MAX_LEASES, lease_slab
from loader._table import BatchTable
from loader._worker import worker_main

__all__ = ["ShmLoader", "WorkerError", "LoaderTimeout"]

_fork = mp.get_context("fork")
_live_loaders: "weakref.WeakSet[ShmLoader]" = weakref.WeakSet()


class _Run(NamedTuple):
    id: int
    epoch: int
    n: int | None  # positions; None for an iterable dataset


class WorkerError(RuntimeError):
    """A worker or the collator failed.  The message carries the original
    traceback (or the signal or exit code), the worker id, its pid and the
    sample index."""


class LoaderTimeout(WorkerError, TimeoutError):
    """No batch arrived within the loader's ``timeout``."""


# Ring capacities.  Most samples never enter a ring (NOTE [ Direct row writes ]), so
# all of them fit Docker's default 64 MiB /dev/shm with 8 workers.
TO_COLLATOR_BYTES = 32 << 20  # samples that take the ring: the largest such sample
TO_MAIN_BYTES = 4 << 20       # batch descriptors
TASKS_BYTES = 1 << 20         # per worker: epoch orders, in chunks of P.ORDER_CHUNK


def _default_memory_cap() -> int:
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1 << 30, pages // 4)


class ShmLoader:
    """Batches from arbitrary Python preprocessing, at memory speed.

    Forked workers run ``dataset[i]`` (or iterate an iterable dataset) and
    write each sample into its row of a batch slab in shared memory (a
    collator process lays the slabs out and takes the samples that do not
    fit them); iterating yields numpy arrays (or torch tensors with
    ``output="torch"``) that view those slabs: no copy, no unpickling in
    the training loop.  A slab is reused only when every array of its batch
    is gone, so batches you keep stay intact.
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, num_workers=2,
                 collate_fn=None, drop_last=False, in_order=True, prefetch=None,
                 persistent_workers=True, worker_init_fn=None, seed=None, timeout=None,
                 output="numpy", memory_cap_bytes=None):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1 (ShmLoader always uses worker "
                             f"processes), got {num_workers!r}")
        if output not in ("numpy", "torch"):
            raise ValueError(f"output must be 'numpy' or 'torch', got {output!r}")
        if sampler is not None and shuffle:
            raise ValueError("sampler and shuffle=True are exclusive: shuffle inside the sampler")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 1):
            raise ValueError(f"prefetch must be a positive number of batches or None, got {prefetch!r}")
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
        self._epoch = 0      # epochs started by iter(): they pick the order and the seeds
        self._runs = 0       # passes over the data started (see Passes in _protocol.py)
        self._current = None  # the run of the latest iter()
        self._ahead = None   # the next epoch's run, started before its iter()
        self._early = []     # messages of that run received meanwhile
        self._owner_pid = os.getpid()
        self._procs: list = []
        self._closed = False
        self._stats = None
        _live_loaders.add(self)

    # --- sizes and order -------------------------------------------------------

    def _positions(self, epoch) -> np.ndarray:
        if self.sampler is not None:
            order = np.fromiter((int(i) for i in self.sampler), dtype=np.int64)
        elif self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        else:
            order = np.arange(len(self.dataset), dtype=np.int64)
        return order[:self._kept(len(order))].astype(np.int64, copy=False)

    def _kept(self, n: int) -> int:
        """Of n positions, those an epoch delivers (drop_last drops a short batch)."""
        return n // self.batch_size * self.batch_size if self.drop_last else n

    def stats(self) -> dict | None:
        """How the last epoch whose end was seen was delivered: batches,
        samples, and how many samples workers wrote straight into their
        batch's memory against those that went through the collator's ring
        (varying shapes, a collate_fn, or the first batch of the first
        epoch).  None before the end of the first epoch."""
        return None if self._stats is None else dict(self._stats)

    def __len__(self):
        if self.iterable:
            raise TypeError("an iterable dataset has no length; ShmLoader cannot know its "
                            "number of batches")
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return -(-self._kept(n) // self.batch_size)

    # --- processes -------------------------------------------------------------

    def _start(self):
        if threading.active_count() > 1:
            warnings.warn(
                f"ShmLoader forks {self.num_workers} workers from a process running "
                f"{threading.active_count()} threads; a lock held by another thread at the fork "
                f"stays locked in the workers and can hang them. Create the loader (and "
                f"iterate it once) before starting threads", RuntimeWarning, stacklevel=3)
        self.ctl = shmq.shared_array(P.CTL_WORDS, np.int64)
        self.released = shmq.shared_array(MAX_LEASES, np.int64)
        self.arena = shmq.shared_array(self.memory_cap_bytes, np.uint8)
        self.table = BatchTable(max(64, 2 * P.publish_window(self.prefetch)))
        self._create_rings()
        # Where each worker writes its stacks when asked (R3); unnamed files.
        self._stack_files = [tempfile.TemporaryFile() for _ in range(self.num_workers)]
        parent = os.getpid()
        self._procs = [_fork.Process(
            target=worker_main, name=f"ShmLoader worker {i}", daemon=True,
            args=(i, self.num_workers, self.dataset, self.tasks[i], self.to_collator, self.ctl,
                  self.table, self.arena, self.batch_size, self.in_order, self.collate_fn is None,
                  self.worker_init_fn, self._stack_files[i], parent))
            for i in range(self.num_workers)]
        self._procs.append(_fork.Process(
            target=collator_main, name="ShmLoader collator", daemon=True,
            args=(self.to_collator, self.to_main, self.ctl, self.arena, self.released, self.table,
                  self.batch_size, self.drop_last, self.in_order, self.collate_fn,
                  self.num_workers, self.prefetch, parent)))
        for p in self._procs:
            p.start()

    def _create_rings(self):
        """The rings live in /dev/shm: check its room for all of them first,
        so a small one (Docker's default is 64 MiB) fails here, naming what
        is needed.  Every child inherits the rings by fork, so their names
        are unlinked at once."""
        sizes = [TO_COLLATOR_BYTES, TO_MAIN_BYTES] + [TASKS_BYTES] * self.num_workers
        mpsc = [True] + [False] * (len(sizes) - 1)  # only to_collator has several producers
        needed = sum(map(shmq.Queue.footprint, sizes, mpsc))
        free = segment.free_bytes()
        if needed > free:
            raise shmq.ShmFull(
                f"ShmLoader needs about {needed} bytes in /dev/shm for its rings "
                f"({len(sizes)} rings for {self.num_workers} workers) but /dev/shm has {free} "
                f"free; free space there (stale segments: `python -m shmq clean`), use fewer "
                f"workers, or give the container more shared memory (docker run "
                f"{segment.shm_size_option(needed)})")
        rings = []
        try:
            for size, multi_producer in zip(sizes, mpsc):
                rings.append(shmq.Queue(size, multi_producer=multi_producer))
                rings[-1].unlink()
        except BaseException:
            for q in rings:
                q.close()
            raise
        self.to_collator, self.to_main, *self.tasks = rings

    def _check_children(self):
        for i, p in enumerate(self._procs):
            code = p.exitcode
            if code is None:
                continue
            who = "the collator" if i == self.num_workers else f"worker {i}"
            if code < 0:
                how = f"was killed by signal {signal.Signals(-code).name}"
            else:
                how = f"exited unexpectedly with exit code {code}"
            hint = (" (SIGKILL is often the out-of-memory killer: check `dmesg`, use smaller "
                    "batches or fewer workers)" if code == -signal.SIGKILL else "")
            raise WorkerError(f"ShmLoader: {who} (pid {p.pid}) {how}{hint}")

    def _shutdown(self):
        """See NOTE [ ShmLoader processes and shutdown ] in _protocol.py."""
        if not self._procs:
            return
        for run in (self._runs - 1, self._runs):
            P.end_run(self.ctl, run)  # workers stop pulling positions at once
        for q in (*self.tasks, self.to_collator):
            try:
                q.put((P.STOP,), timeout=0.5)
            except (shmq.ShmqError, ValueError):
                pass  # that process is gone or stuck: join/kill below handles it
        deadline = time.monotonic() + P.JOIN_TIMEOUT_S
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()
        for q in (self.to_collator, self.to_main, *self.tasks):
            q.close()
        for f in self._stack_files:
            f.close()
        self._procs = []

    def close(self):
        """Stop the workers and the collator.  Batches you hold stay valid."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_procs", None) and os.getpid() == self._owner_pid:
            self.close()

    # --- iteration -------------------------------------------------------------

    def __iter__(self):
        if self._closed:
            raise ValueError("this ShmLoader is closed; create a new one")
        if not self._procs:
            self._start()
        self._epoch += 1
        return self._run_epoch(self._epoch)

    def _receive(self):
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                return self.to_main.get(timeout=P.WAIT_SLICE_S)
            except shmq.Empty:
                self._check_children()
                if deadline is not None and time.monotonic() > deadline:
                    raise LoaderTimeout(
                        f"ShmLoader: no batch within timeout={self.timeout}s; a worker may be "
                        f"stuck in dataset[...]. Their stacks:\n{self._worker_stacks()}") from None

    def _worker_stacks(self) -> str:
        """Each worker's Python stacks, written by faulthandler on SIGUSR1
        (it works even while the worker is stuck inside a C call)."""
        for f, p in zip(self._stack_files, self._procs):
            f.seek(0)
            f.truncate()
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.3)
        parts = []
        for i, (f, p) in enumerate(zip(self._stack_files, self._procs)):
            f.seek(0)
            text = f.read().decode(errors="replace").strip() or "(no answer)"
            parts.append(f"--- worker {i} (pid {p.pid}) ---\n{text}")
        return "\n".join(parts)

    def _start_run(self, epoch) -> _Run:
        """Start a pass over the data for `epoch` (see Passes in _protocol.py)."""
        order = None if self.iterable else self._positions(epoch)
        self._runs += 1
        run = _Run(self._runs, epoch, None if order is None else len(order))
        self.ctl[P.slot(run.id, P.LIMIT)] = self.prefetch * self.batch_size
        self.ctl[P.slot(run.id, P.ARRIVED)] = P.tagged(run.id)
        self.ctl[P.slot(run.id, P.CURSOR)] = P.tagged(run.id)  # last: opens the run
        self.to_collator.put((P.EPOCH_START, run.id, run.n))
        chunks = [None] if order is None else [order[i:i + P.ORDER_CHUNK]
                                               for i in range(0, max(run.n, 1), P.ORDER_CHUNK)]
        for q in self.tasks:
            for i, chunk in enumerate(chunks):
                q.put((P.EPOCH_START, run.id, epoch, chunk, self.seed, i == len(chunks) - 1))
        return run

    def _runs_ahead(self) -> bool:
        """Can the next epoch start before this one ends?  Not when the
        next order is the user's to make (a sampler, which may wait for
        set_epoch(); an iterable dataset), nor without persistent workers."""
        return self.persistent_workers and self.sampler is None and not self.iterable

    def _run_for(self, epoch):
        """The run for `epoch` and the messages already received for it: the
        run started ahead, if len(dataset) has not changed since; else a new
        run (the old one ends: its batches are released as they come)."""
        ahead, early = self._ahead, self._early
        self._ahead, self._early = None, []
        if self._current is not None:
            P.end_run(self.ctl, self._current.id)  # an iterator this one supersedes
        if ahead is not None and ahead.epoch == epoch and ahead.n == self._kept(len(self.dataset)):
            self._current = ahead
            return ahead, early
        if ahead is not None:
            P.end_run(self.ctl, ahead.id)
            for msg in early:
                self._drop(msg)
        self._current = self._start_run(epoch)
        return self._current, []

    def _drop(self, msg):
        """A message of a run nobody will read: free its batch."""
        if msg[0] == P.BATCH:
            self.released[msg[3]] = msg[4]

    def _run_epoch(self, epoch):
        run, early = self._run_for(epoch)
        pending = {}
        by_index = self.in_order and not self.iterable  # else: in arrival order
        yielded = 0
        total = None if run.n is None else -(-run.n // self.batch_size)
        ended = finished = False
        try:
            # Until END: it follows every batch, and carries the epoch's stats.
            while not (ended and yielded == total):
                self._check_current(epoch)
                msg = early.pop(0) if early else self._receive()
                kind = msg[0]
                if kind == P.MEMORY_WAIT:
                    warnings.warn(
                        f"ShmLoader: all {msg[2]} bytes of batch memory are held by {msg[3]} "
                        f"batches your code still references ({msg[1]} bytes); waiting for some to "
                        f"be dropped. Keep fewer batches (copy what you keep) or pass a larger "
                        f"memory_cap_bytes", RuntimeWarning, stacklevel=2)
                    continue
                if (self._ahead is None and self._runs_ahead()
                        and P.claimed(self.ctl, run.id) >= run.n):
                    self._ahead = self._start_run(epoch + 1)  # every position is claimed
                if msg[1] != run.id:
                    if self._ahead is not None and msg[1] == self._ahead.id:
                        self._early.append(msg)  # the next epoch, started ahead
                    else:
                        self._drop(msg)  # a run main abandoned
                    continue
                if kind == P.ERROR:
                    _, _, pos, index, wid, pid, text = msg
                    who = "the collator" if wid < 0 else f"worker {wid}"
                    at = f" on sample index {index} (position {pos})" if index >= 0 else ""
                    raise WorkerError(f"ShmLoader: {who} (pid {pid}) raised{at}:\n{text}")
                if kind == P.END:
                    total, ended = msg[2], True
                    self._stats = {"epoch": epoch, "batches": msg[2], "samples": msg[3],
                                   "samples_written_directly": msg[3] - msg[4],
                                   "samples_through_ring": msg[4]}
                    continue
                pending[msg[2]] = msg
                key = yielded if by_index else msg[2]
                while key in pending:
                    batch = self._batch(pending.pop(key))
                    yielded += 1
                    self.ctl[P.slot(run.id, P.LIMIT)] = (yielded + self.prefetch) * self.batch_size
                    yield batch
                    self._check_current(epoch)
                    key = yielded if by_index else None
            finished = True
        finally:
            if not finished:
                for msg in (*pending.values(), *early):  # received but never handed out
                    self._drop(msg)
                if self._procs:
                    P.end_run(self.ctl, run.id)  # workers stop pulling its positions
            if not self.persistent_workers:
                self._shutdown()

    def _check_current(self, epoch):
        if self._epoch != epoch:
            raise RuntimeError("this ShmLoader iterator was superseded: iter(loader) was called "
                               "again, which starts a new epoch; use one iterator at a time")

    def _batch(self, msg):
        _, _, _, lease, generation, offset, nbytes, spec = msg
        slab = lease_slab(self.arena, self.released, lease, generation, offset, nbytes)
        return materialize(spec, slab, self.output == "torch")


def _close_all():
    for loader in list(_live_loaders):
        loader.close()


atexit.register(_close_all)
