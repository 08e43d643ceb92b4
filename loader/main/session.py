"""A started ShmLoader's processes and what they share, in one place.

A Session exists from the loader's first iter() (or the first after a
shutdown) until its shutdown: the shared state (shared/memory.py), the workers
and the batcher (forked processes, or threads: main/procs.py, main/threads.py),
main's lease book of the slabs it hands out (native/leases.pxi) and the pinned
view of the arena.  It starts them, receives the batcher's messages while
watching the children, turns a BatchReady into the user's batch, and stops
everything (NOTE [ ShmLoader processes and shutdown ] in shared/messages.py).
What a pass over the data is and which runs main reads are the loader's
business (main/runs.py, order/planning.py; NOTE [ Runs ] in shared/control.py), not the
session's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np

import shmq
from shmq import sync
from loader.shared import control as _control
from loader.shared import messages as _protocol
from loader.batcher.batcher import batcher_main
from loader.errors import LoaderTimeout, WorkerError
from loader._native import LeaseBook
from loader.main.pinning import PinnedChunks, cuda_available
from loader.main.procs import BATCHER, Role, start_children, start_error, wait_all
from loader.shared.memory import SharedState
from loader.shared.spec import LoaderSpec
from loader.batcher.slabs import CopiedSlab
from loader.main.stats import Task
from loader.main.threads import start_threads
from loader.worker.worker import worker_main



class Session:
    """The processes (or threads) of a started loader and their shared
    memory, from the loader's spec as they start with it (its torch rules:
    torch's words first in errors, torch's seeding advice at fork)."""

    def __init__(self, spec: LoaderSpec):
        self.spec = spec
        try:
            self.shared = SharedState(spec)
        except BaseException as e:
            raise start_error(e, "create its shared memory") from e
        try:
            self.leases = LeaseBook(self.shared.take_arena_fd(), self.shared.arena.nbytes,
                                    self.shared.released, self.shared.control.batcher_bell)
        except BaseException as e:
            self.shared.close()
            raise start_error(e, "create its shared memory") from e
        try:
            workers_spec = self._workers_spec(spec)
            children = [(Role(i), worker_main, (workers_spec, self.shared, i))
                        for i in range(spec.num_workers)]
            children.append((BATCHER, batcher_main, (self._batchers_spec(spec), self.shared)))
            self.procs = (start_threads(children) if spec.threads
                          else start_children(children, spec.start_method, self.shared,
                                              advise=not spec.torch_rules))
        except BaseException:
            self.shared.close()
            raise
        self.pinned = self._pin_chunks()
        self.next_child_check = 0.0
        self.copied_slabs = self.copied_bytes = 0  # batches held back, copied out (copy_out)

    @staticmethod
    def _workers_spec(spec: LoaderSpec) -> LoaderSpec:
        """What a spawned worker is sent of the spec: not what only main
        uses (the sampler, the batch sampler, the generator), which a user
        need not make picklable."""
        if not spec.passable:
            return spec
        return dataclasses.replace(spec, sampler=None, batch_sampler=None, generator=None)

    @staticmethod
    def _batchers_spec(spec: LoaderSpec) -> LoaderSpec:
        """The batcher never calls the dataset or worker_init_fn either: a
        spawned one is not sent them, so it does not import what unpickling
        them imports (torch, for a torch Dataset: seconds per start)."""
        if not spec.passable:
            return spec
        return dataclasses.replace(spec, dataset=None, worker_init_fn=None, sampler=None,
                                   batch_sampler=None, generator=None)

    # --- the children -------------------------------------------------------------------

    def worker_children(self) -> list:
        """The worker processes (or threads), without the batcher
        (loader.DataLoader's iterator shows them as `_workers`)."""
        return [c for c in self.procs if c.role != BATCHER]

    def cpu_tasks(self) -> tuple[dict, list]:
        """(the tasks of each stage of the loading: the workers and the
        batcher, processes or threads, and the training thread that calls
        next(); the loader's pids, this process's first), for NOTE [ CPU
        starvation ] in main/stats.py."""
        threads = self.spec.threads
        stages = {"loop": [Task(threading.get_native_id(), thread=True)],
                  "workers": [Task(c.pid, threads) for c in self.worker_children() if c.pid],
                  "batcher": [Task(c.pid, threads) for c in self.procs
                              if c.role == BATCHER and c.pid]}
        own = [os.getpid()] + ([] if threads else [c.pid for c in self.procs])
        return stages, own

    def add_workers(self, active: int, first_run: int) -> int:
        """num_workers="auto": let `active` workers claim units, starting
        workers the pool never had (they join run `first_run` in progress).
        Returns the number of workers the pool has now."""
        workers = self.worker_children()
        if active > len(workers):
            children = [(Role(i), worker_main, (self._workers_spec(self.spec), self.shared, i,
                                                first_run))
                        for i in range(len(workers), active)]
            started = (start_threads(children) if self.spec.threads else
                       start_children(children, self.spec.start_method, self.shared))
            self.procs[len(workers):len(workers)] = started  # before the batcher
        self.shared.control.set_active(active)
        return max(active, len(workers))

    def check_children(self) -> None:
        dead = [c for c in self.procs if c.exitcode is not None]
        if dead:
            raise WorkerError("\n".join(self._death_report(c) for c in dead))

    def _death_report(self, child) -> str:
        words = child.last_words()
        text = f"ShmLoader: {child.role} (pid {child.pid}) {child.how_it_ended()}"
        code = child.exitcode
        if self.spec.torch_rules and code is not None and child.role != BATCHER:
            # torch's own words first, for code that matches them
            if code < 0:
                torch_text = (f"DataLoader worker (pid {child.pid}) is killed by signal: "
                              f"{signal.strsignal(-code)}.")
            else:
                torch_text = f"DataLoader worker (pid(s) {child.pid}) exited unexpectedly."
            text = f"{torch_text} {text}"
        return f"{text}; it wrote:\n{words}" if words else text

    def _report_dead_children(self, cause: BaseException):
        """to_main's producer is gone: report how the children ended (they
        may still be dying: wait a little for their exit status)."""
        wait_all(self.procs, 1.0)
        self.check_children()
        raise WorkerError(f"ShmLoader: the batcher's ring to main ended ({cause}) while every "
                          f"process is still running") from cause

    def worker_stacks(self) -> str:
        """Each worker's Python stacks, written by faulthandler on SIGUSR1
        (it works even while the worker is stuck inside a C call)."""
        workers = self.worker_children()
        if self.spec.threads:
            return "\n".join(f"--- {c.role} (thread {c.pid}) ---\n{c.stacks()}" for c in workers)
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

    def stop(self, last_run: int) -> None:
        """See NOTE [ ShmLoader processes and shutdown ] in shared/messages.py:
        end the last two runs, stop the children and wait for them (kill
        what does not stop), then free the shared memory.  Interrupted (a
        Ctrl-C while it waits), it is done by the next call."""
        if self.procs:
            control = self.shared.control
            for run in (last_run - 1, last_run):
                if run > 0:
                    control.end_run(run)
            control.stop()
            if not wait_all(self.procs, _protocol.JOIN_TIMEOUT_S):
                for c in self.procs:
                    c.kill()
                wait_all(self.procs, _protocol.JOIN_TIMEOUT_S)
            for c in self.procs:
                c.exitcode  # reaped
                c.close()
            self.procs = []
        self.shared.close()
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None
        self.leases.close()  # the arena's pages no batch you hold uses go back now

    # --- messages and batches -----------------------------------------------------------

    def receive(self, deadline=None, copy_out_held=None):
        """The next message from the batcher.  Waits in bounded slices,
        checking the children and the deadline (the loader's timeout).
        While the batcher waits for memory, what the loop keeps moves out
        of the pool, and so do the batches main holds back, through
        copy_out_held() (NOTE [ Kept batch memory ])."""
        control = self.shared.control
        while True:
            if sync.atomic_load(control.ctl, _control.MEMORY_WAIT):
                try:
                    self.move_kept_out(partial_only=False)  # NOTE [ Kept batch memory ]
                except MemoryError as e:
                    raise MemoryError(
                        f"ShmLoader: the batch pool ({self.shared.arena.nbytes} bytes, "
                        f"memory_cap_bytes) is full and what you hold of its batches could not "
                        f"move out of it: {e}. Every batch you hold keeps its values; drop "
                        f"batches you no longer need or copy what you keep, and the next next() "
                        f"tries again") from None
                if copy_out_held is not None:
                    copy_out_held()
            try:
                msg = self.shared.receive(self.shared.to_main.get(timeout=_protocol.WAIT_SLICE_S))
            except shmq.Empty:
                self.check_children()
                if deadline is not None and time.monotonic() > deadline:
                    torch_text = (f"DataLoader timed out after {self.spec.timeout} seconds. "
                                  if self.spec.torch_rules else "")
                    raise LoaderTimeout(
                        f"{torch_text}ShmLoader: no batch within timeout={self.spec.timeout}s; a "
                        f"worker may be stuck in dataset[...]. Their stacks:\n"
                        f"{self.worker_stacks()}") from None
                continue
            except (shmq.PeerLost, shmq.Closed) as e:
                self._report_dead_children(e)
            if sync.atomic_load(control.ctl, _control.OUTBOX):
                control.batcher_bell.ring()  # it has messages our full ring could not take
            now = time.monotonic()
            if now >= self.next_child_check:
                # Batches may never stop coming while a worker is dead (in
                # first-ready mode the others fill them): look anyway.
                self.next_child_check = now + _protocol.WAIT_SLICE_S
                self.check_children()
            return msg

    def give_back(self, msg: _protocol.BatchReady) -> None:
        """A batch nobody will see: its slab is free at once."""
        if type(msg.slab) is not CopiedSlab:
            sync.atomic_store(self.shared.released, msg.slab.lease, msg.slab.generation)
            self.shared.control.batcher_bell.ring()

    def copy_out(self, msg: _protocol.BatchReady) -> _protocol.BatchReady:
        """A batch main holds back, its slab copied into main's memory and
        given back to the pool (NOTE [ Kept batch memory ])."""
        s = msg.slab
        if type(s) is CopiedSlab:
            return msg
        if self.pinned is not None:  # pin_memory: the copy is page-locked as the arena is
            import torch

            data = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            data = np.empty(s.nbytes, np.uint8)
        data[:] = self.shared.arena[s.offset:s.offset + s.nbytes]
        self.give_back(msg)
        self.copied_slabs += 1
        self.copied_bytes += s.nbytes
        return msg._replace(slab=CopiedSlab(data))

    def tags(self, msg: _protocol.BatchReady) -> np.ndarray:
        """The tags the writers gave the batch's rows (see _layout.Layout)."""
        s = msg.slab
        if type(s) is CopiedSlab:
            return s.data[msg.tags:msg.tags + 8 * msg.rows].view(np.int64).copy()
        off = s.offset + msg.tags
        return self.shared.arena[off:off + 8 * msg.rows].view(np.int64).copy()

    def batch(self, msg: _protocol.BatchReady, build):
        """The user's batch: views of its slab, leased until every array of
        it is gone; build: the loader's Materializer (main/materialize.py)."""
        s = msg.slab
        if type(s) is CopiedSlab:
            return build.from_array(msg.spec, s.data)
        if self.pinned is not None:
            self.pinned.pin(s.offset, s.nbytes)
        slab = self.leases.view(s.lease, s.generation, s.offset, s.nbytes)
        batch = build(msg.spec, slab)
        if self.leases.dropped_bytes * 4 >= self.shared.arena.nbytes:
            # Slabs mostly dropped (targets.append(y)) hold a quarter of the
            # pool: give them back before the pool runs short.  Ahead of need:
            # if the system refuses the memory now, the batch is still the
            # user's, and the move is tried again when the pool is short
            # (receive), where a refusal is raised.
            try:
                self.move_kept_out(partial_only=True)
            except MemoryError:
                pass
        return batch

    def move_kept_out(self, partial_only: bool) -> int:
        """Move the parts of batches the training loop still holds out of
        the pool, at the same addresses, and let the batcher reuse their
        slabs: see NOTE [ Kept batch memory ] in native/leases.pxi.  Returns the
        slabs given back."""
        slabs, _ = self.leases.evict(partial_only)
        if slabs and self.pinned is not None:  # new batches are viewed in a new mapping
            self.pinned.close()
            self.pinned = self._pin_chunks()
        return slabs

    def kept_moved_out(self) -> tuple[int, int]:
        """Slabs (and their bytes) moved out of the pool by this session:
        kept by the loop, or held back by main (copy_out)."""
        return (self.leases.evicted_slabs + self.copied_slabs,
                self.leases.kept_bytes + self.copied_bytes)

    def _pin_chunks(self) -> PinnedChunks | None:
        """pin_memory: the chunks of the mapping new batches are viewed in."""
        if not (self.spec.pin_memory and cuda_available()):
            return None
        return PinnedChunks(self.leases.address, self.shared.arena.nbytes)
