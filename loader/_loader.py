"""ShmLoader: the main-process side.  See NOTE [ ShmLoader processes and
shutdown ] in _protocol.py for the processes and how they stop, and NOTE
[ Runs ] in _control.py for how passes over the data are started."""

from __future__ import annotations

import atexit
import collections
import os
import secrets
import signal
import sys
import time
import warnings
import weakref
from typing import NamedTuple

import numpy as np

import shmq
from loader import _control as C
from loader import _fetch as F
from loader import _order as O
from loader import _protocol as P
from loader._autoscale import Autoscaler, cpu_count, default_max_workers
from loader._collator import collator_main
from loader._epoch_iter import MapEpoch, StreamEpoch
from loader._errors import LoaderTimeout, WorkerError
from loader._frozen_state import FrozenState
from loader._epochs import EpochInfo
from loader._inline import InlineEpoch
from loader._layout import Materializer
from loader._native import LeaseBook, derived_seeds
from loader._pinning import PinnedChunks, cuda_available
from loader._procs import LoaderStartError, fork_children, start_error, this_pid, wait_all
from loader._progress import STATE_FORMAT, MapProgress, StreamProgress
from loader._sampler_feed import SamplerFeed, streamable
from loader._shared import LoaderConfig, SharedState
from loader._slabs import ram_bytes
from loader._state import Expected, check_state
from loader._stats import EpochClock, stall_advice, summary_line, warn_stalled
from loader._threads import start_threads
from loader._trace import ROLE_MAIN, TraceLog, tracer_of
from loader._worker import worker_main

__all__ = ["ShmLoader", "WorkerError", "LoaderTimeout", "LoaderStartError"]

_live_loaders: "weakref.WeakSet[ShmLoader]" = weakref.WeakSet()


class _KeyErrorMessage(str):
    """KeyError shows repr() of its argument; this keeps a traceback
    readable (PyTorch does the same)."""

    def __repr__(self):
        return self


class _Plan(NamedTuple):
    """What main decided about one pass: see NOTE [ Runs ]."""
    epoch: int
    size: int                  # the dataset's length (a computed order), or the shipped
                               # order's; -1 iterable
    kept: int                  # positions delivered
    units: int                 # what workers claim
    nbatches: int              # -1 iterable
    order_kind: int
    order_seed: int
    shipped: np.ndarray | None  # the order written out for the workers (iterable: skips)
    offsets: np.ndarray | None  # a batch sampler's batch offsets
    base_seed: int
    rng: dict                  # generator states at the epoch's start (state_dict)
    progress: object           # MapProgress or StreamProgress of the run
    snapshot: object = None    # the dataset's snapshot of the epoch (FileDataset: its files)
    remaining: O.Remaining | None = None  # a resumed computed order: the positions left
    feed: SamplerFeed | None = None  # a streamed sampler (NOTE [ Streamed samplers ])


class _Run(NamedTuple):
    id: int
    plan: _Plan
    batches: O.Batches | None  # None for an iterable dataset


def _default_memory_cap() -> int:
    return max(1 << 30, ram_bytes() // 4)


def _positive_int(name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def is_iterable_dataset(dataset) -> bool:
    """As PyTorch decides: a torch IterableDataset is iterable (even with
    __len__); any other object is iterable when it has __iter__ and no
    __getitem__."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) of this process: from the initialised
    torch.distributed process group, else the RANK and WORLD_SIZE
    environment variables torchrun sets, else (0, 1)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"distributed=True: RANK and WORLD_SIZE must be integers ({e})") from None
    if not 0 <= rank < world:
        raise ValueError(f"distributed=True: RANK={rank} is not in 0..WORLD_SIZE-1 "
                         f"(WORLD_SIZE={world})")
    return rank, world


class ShmLoader(FrozenState):
    """Batches from arbitrary Python preprocessing, at memory speed.

    Forked workers run ``dataset[i]`` (or iterate an iterable dataset) and
    write each sample straight into its row of a batch slab in shared
    memory (a collator process lays the slabs out); iterating yields numpy
    arrays (or torch tensors with ``output="torch"``) that view those slabs:
    no copy, no unpickling in the training loop.  A slab is reused only when
    every array of its batch is gone, so batches you keep stay intact.

    dataset: map-style (``__len__`` and ``__getitem__``; a torch Dataset, a
        FileDataset) or iterable (``__iter__`` only; a torch IterableDataset,
        a ParquetDataset), each worker iterating its own copy (split it with
        ``get_worker_info()``).
    batch_size: samples per batch (None: samples unbatched, one at a time).
    shuffle, sampler, batch_sampler, drop_last, collate_fn, timeout,
    worker_init_fn, persistent_workers, pin_memory, in_order, generator: as
        in torch's DataLoader (timeout=None waits for ever; persistent_workers
        defaults to True, so that the next epoch starts loading before this
        one ends).  in_order=False hands out batches as they are ready.
    num_workers: worker processes (default 2; 0 loads in the training
        process; "auto" grows and shrinks the pool from what it measures,
        up to max_workers).
    prefetch: batches loaded ahead of the training loop (default 3; for an
        iterable dataset, shared among the workers' streams).
    seed: the base of every random choice: the shuffle order, the workers'
        generators.  With a seed, reproducible=True by default: the global
        generators are seeded from (seed, epoch, index) before each
        dataset[i], so batches do not depend on the number of workers.
    output: "numpy" (default), "torch" (tensors viewing the same memory) or
        "keep" (each leaf as dataset or collate_fn gave it).
    memory_cap_bytes: the most batch memory in use at once (default a
        quarter of RAM): batches loaded ahead and batches you still hold.
    distributed: True (ranks from torch.distributed or torchrun's RANK and
        WORLD_SIZE) or (rank, world_size): each rank gets a disjoint share
        of every epoch.
    shuffle_buffer: iterable datasets: place each sample in a random row of
        the next this-many samples' batches.
    worker_mode: "process" (default, forked) or "thread" (for preprocessing
        that releases the GIL, or that cannot be forked).
    trace: a path: close() writes a Chrome-trace / Perfetto JSON of the
        run there (each sample's load and write, the batches, the loop's
        waits in next(), epochs, the slab pool); open it in
        https://ui.perfetto.dev.

    stats() says where the last epoch's time went; state_dict() and
    load_state_dict() resume mid-epoch; steps(n) runs n batches across
    epoch boundaries.  Close it (or use ``with``) to stop the workers at
    once; garbage collection and interpreter exit do it too.
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, batch_sampler=None,
                 num_workers=2, collate_fn=None, drop_last=False, in_order=True, prefetch=None,
                 persistent_workers=True, worker_init_fn=None, seed=None, generator=None,
                 reproducible=None, timeout=None, output="numpy", pin_memory=False,
                 memory_cap_bytes=None, distributed=False, shuffle_buffer=None,
                 worker_mode="process", max_workers=None, trace=None):
        if batch_size is not None:
            _positive_int("batch_size", batch_size)
        self.auto = num_workers == "auto"
        if self.auto:
            max_workers = default_max_workers() if max_workers is None else max_workers
            _positive_int("max_workers", max_workers)
            num_workers = min(cpu_count(), max_workers)  # where the pool starts (_autoscale.py)
        elif max_workers is not None:
            raise ValueError("max_workers caps num_workers='auto'; with a fixed num_workers, "
                             "leave it out")
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0 (0 loads in the main process) or "
                             f"'auto', got {num_workers!r}")
        self.max_workers = max_workers or 0
        if worker_mode not in ("process", "thread"):
            raise ValueError(f"worker_mode must be 'process' or 'thread', got {worker_mode!r}")
        if output not in ("numpy", "torch", "keep"):
            raise ValueError(f"output must be 'numpy', 'torch' or 'keep' (each leaf as the "
                             f"dataset or collate_fn gave it), got {output!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if prefetch is not None:
            _positive_int("prefetch", prefetch)
        if memory_cap_bytes is not None:
            _positive_int("memory_cap_bytes", memory_cap_bytes, 4096)
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
        if sampler is not None and shuffle:
            raise ValueError("sampler and shuffle=True are exclusive: shuffle inside the sampler")
        if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None
                                          or drop_last):
            raise ValueError("batch_sampler makes the batches: it is exclusive with batch_size, "
                             "shuffle, sampler and drop_last")
        if generator is not None:
            torch = sys.modules.get("torch")
            if torch is None or not isinstance(generator, torch.Generator):
                raise TypeError(f"generator must be a torch.Generator, got "
                                f"{type(generator).__name__}")
        self.iterable = is_iterable_dataset(dataset)
        if self.auto and self.iterable:
            raise ValueError("num_workers='auto' needs a map-style dataset: an iterable dataset "
                             "is split into one stream per worker, so its workers are fixed")
        if shuffle_buffer is not None:
            _positive_int("shuffle_buffer", shuffle_buffer)
            if not self.iterable:
                raise ValueError("shuffle_buffer shuffles a stream (an iterable dataset); a "
                                 "map-style dataset is shuffled by shuffle=True")
            if collate_fn is not None or batch_size is None:
                raise ValueError("shuffle_buffer places samples in random rows of pending "
                                 "batches: it needs the default collate and a batch_size")
        # a bad path fails here, not at close(); NOTE [ Trace records ] in _trace.py
        self._trace = None if trace is None else TraceLog(trace)
        self._tracer = tracer_of(self._trace, ROLE_MAIN)
        if self.iterable and (sampler is not None or batch_sampler is not None or shuffle):
            raise ValueError("an iterable dataset orders its own samples: sampler, batch_sampler "
                             "and shuffle apply to map-style datasets (with __getitem__) only")
        if not isinstance(distributed, bool):
            ok = (isinstance(distributed, tuple) and len(distributed) == 2
                  and all(isinstance(v, int) for v in distributed)
                  and 0 <= distributed[0] < distributed[1])
            if not ok:
                raise ValueError(f"distributed must be True, False or (rank, world_size) with "
                                 f"0 <= rank < world_size, got {distributed!r}")
        if distributed and (sampler is not None or batch_sampler is not None):
            raise ValueError("distributed=True shards the loader's own order across ranks; with "
                             "a sampler, shard in the sampler (torch's DistributedSampler)")
        self.dataset, self.batch_size, self.shuffle = dataset, batch_size, shuffle
        self.sampler, self.batch_sampler = sampler, batch_sampler
        self.num_workers, self.collate_fn, self.drop_last, self.in_order = (
            num_workers, collate_fn, drop_last, in_order)
        self.prefetch = prefetch if prefetch is not None else 3
        self.persistent_workers, self.worker_init_fn, self.timeout = (
            persistent_workers, worker_init_fn, timeout)
        self.output, self.pin_memory, self.distributed = output, pin_memory, distributed
        self.generator = generator
        self.shuffle_buffer = shuffle_buffer or 0
        self.worker_mode = worker_mode
        self._seed_given = seed is not None  # else a resumed state brings its own
        self.seed = seed if seed is not None else secrets.randbits(63)
        self.reproducible = (seed is not None) if reproducible is None else bool(reproducible)
        self.memory_cap_bytes = memory_cap_bytes or _default_memory_cap()
        self._torch_rules = False  # DataLoader: torch's seeding and collate structure
        self._epoch = 0          # epochs started by iter(): they pick the order and the seeds
        self._runs = 0           # runs started (see NOTE [ Runs ])
        self._current = None     # the run of the latest iter()
        self._ahead = None       # the next epoch's run, started before its iter()
        self._inboxes: dict[int, collections.deque] = {}  # messages of the runs main reads
        self._unended: set[int] = set()                     # runs whose RunEnded has not come
        self._owner_pid = os.getpid()
        self._procs: list = []
        self._shared = None
        self._pinned = None
        self._drawn_base_seed = None  # torch's rules: drawn once with persistent workers
        self._early_base_seed = None  # torch's rules: drawn by iter(), taken by the epoch's plan
        self._resume = None           # a state to resume at the next iter()
        self._steps_epoch = None      # (epoch, its iterator) that steps() goes on with
        self._progress = self._progress_plan = None  # of the epoch state_dict() describes
        self._closed = False
        self._stats = None
        self._moved_out = (0, 0)  # kept slabs and bytes moved out by lease books closed
        self._warned_stall = False
        self._rank, self._world = (0, 1)
        _live_loaders.add(self)

    # --- sizes ----------------------------------------------------------------------

    @property
    def _rows(self) -> int:
        """Samples per batch (1 unbatched: batch_size=None)."""
        return 1 if self.batch_size is None else self.batch_size

    def _dataset_len(self) -> int:
        try:
            return len(self.dataset)
        except TypeError:
            raise TypeError(f"this map-style dataset ({type(self.dataset).__name__}) has no "
                            f"__len__: pass a sampler that says which indices to load") from None

    def __len__(self):
        if self.iterable:
            raise TypeError("an iterable dataset has no length; ShmLoader cannot know its "
                            "number of batches")
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.sampler) if self.sampler is not None else self._dataset_len()
        n = O.shard_size(n, self._ranks()[1])
        if self.batch_size is None:
            return n
        return -(-O.kept_of(n, self.batch_size, self.drop_last) // self.batch_size)

    def stats(self) -> dict | None:
        """How the last epoch that ran to its end was delivered, and where
        its time went; None before the end of the first epoch.

        - "summary": all of it in one line, for a log.
        - "epoch", "batches", "samples"; "seconds" from the epoch's first
          next() to its end; "bytes" of batch memory handed out (slabs, with
          their row tags, and "spilled_bytes": large bytes and str leaves,
          which come through the spill heap) and "bytes_per_second".
        - "kept_slabs_moved_out", "kept_bytes_moved_out": since the loader
          started, slabs whose parts you still held were moved out of the
          pool when it ran short, copying that many bytes (NOTE [ Kept batch
          memory ]).
        - "loop_wait_seconds", "loop_wait_share": how long the training loop
          waited in next() for a batch (num_workers=0: loading them).  Above
          half of an epoch of 5 s or more, a DataStallWarning says why, once.
        - "workers_busy_share", "collator_busy_share": the share of the
          epoch the workers (on average) and the collator were not waiting;
          None with num_workers=0.
        - "peak_slab_bytes" of "memory_cap_bytes": the most batch memory in
          use (batches being filled, ready, or still referenced by you).
        - "samples_written_by_workers" / "samples_written_by_collator":
          samples whose dtypes or structure differ from the batch's layout
          are written by the collator, slower; "relayouts": batches laid out
          again (shapes that change between batches, promotions).
        - "workers": the workers loading now (num_workers="auto": the count
          it chose, and "worker_counts": the counts it went through).

        The busy shares include the next epoch's loading once it starts
        early (persistent workers run ahead into it)."""
        if self._stats is None:
            return None
        out = dict(self._stats)
        out["workers"] = self._workers_loading()
        out["kept_slabs_moved_out"], out["kept_bytes_moved_out"] = self._kept_moved_out()
        scaler = getattr(self, "_autoscaler", None)
        if scaler is not None:
            out["worker_counts"] = list(scaler.history)
        return out

    def _kept_moved_out(self) -> tuple[int, int]:
        slabs, nbytes = self._moved_out
        if self._shared is not None:  # the pool's book now
            slabs, nbytes = slabs + self._leases.evicted_slabs, nbytes + self._leases.kept_bytes
        return slabs, nbytes

    # --- processes ----------------------------------------------------------------------

    def _check_owner(self):
        if this_pid() != self._owner_pid and os.getpid() != self._owner_pid:
            raise RuntimeError(
                f"this ShmLoader belongs to process {self._owner_pid}; a process forked from it "
                f"(this is {os.getpid()}) cannot use it: create a new ShmLoader here")

    def _batched_fetch(self) -> bool:
        """One dataset.__getitems__ call per batch (NOTE [ Batched fetch ])."""
        return F.batch_fetcher(self.dataset, self.batch_size, self.iterable) is not None

    def _ranks(self) -> tuple[int, int]:
        """(rank, world size) this loader shards epochs for."""
        if self.distributed is True:
            return distributed_rank()
        if self.distributed:
            return self.distributed
        return 0, 1

    def _start(self):
        cfg = LoaderConfig(
            dataset=self.dataset, batch_size=None if self.batch_size is None else self._rows,
            num_workers=self.num_workers, prefetch=self.prefetch, drop_last=self.drop_last,
            in_order=self.in_order, iterable=self.iterable, collate_fn=self.collate_fn,
            worker_init_fn=self.worker_init_fn, seed=self.seed, reproducible=self.reproducible,
            torch_seeding=self._torch_rules, memory_cap_bytes=self.memory_cap_bytes,
            parent_pid=0 if self._threads else os.getpid(), rank=self._rank, world=self._world,
            threads=self._threads, max_workers=self.max_workers,
            whole_batches=self._torch_rules and not self.iterable,
            batched_fetch=self._batched_fetch(),
            shuffle_buffer=self.shuffle_buffer, trace=self._trace)
        try:
            shared = SharedState(cfg)
        except BaseException as e:
            raise start_error(e, "create its shared memory") from e
        try:
            leases = LeaseBook(shared.take_arena_fd(), shared.arena.nbytes, shared.released,
                               shared.control.collator_bell)
        except BaseException as e:
            shared.close()
            raise start_error(e, "create its shared memory") from e
        try:
            specs = [(f"worker {i}", worker_main, (cfg, shared, i)) for i in range(self.num_workers)]
            specs.append(("the collator", collator_main, (cfg, shared)))
            self._procs = (start_threads(specs) if self._threads
                           else fork_children(specs, advise=not self._torch_rules))
        except BaseException:
            shared.close()
            raise
        self._cfg, self._shared = cfg, shared
        if self.auto:
            shared.control.set_active(self.num_workers)
            self._autoscaler = Autoscaler(self, self.num_workers, self.max_workers)
        self._leases = leases
        self._pinned = self._pin_chunks()
        self._next_child_check = 0.0

    def _pin_chunks(self) -> PinnedChunks | None:
        """pin_memory: the chunks of the mapping new batches are viewed in."""
        if not (self.pin_memory and cuda_available()):
            return None
        return PinnedChunks(self._leases.address, self._shared.arena.nbytes)

    def _worker_children(self) -> list:
        """The worker processes (or threads) of the pool, without the
        collator (loader.DataLoader's iterator shows them as `_workers`)."""
        return [c for c in self._procs if c.role != "the collator"]

    def _set_active_workers(self, active: int) -> None:
        """num_workers="auto": let `active` workers claim units, starting
        workers the pool never had (they join the run in progress)."""
        workers = self._worker_children()
        if active > len(workers):
            first_run = self._current.id if self._current is not None else max(self._runs, 1)
            specs = [(f"worker {i}", worker_main, (self._cfg, self._shared, i, first_run))
                     for i in range(len(workers), active)]
            started = start_threads(specs) if self._threads else fork_children(specs)
            self._procs[len(workers):len(workers)] = started  # before the collator
            self.num_workers = active
        self._shared.control.set_active(active)

    def _check_children(self):
        dead = [c for c in self._procs if c.exitcode is not None]
        if dead:
            raise WorkerError("\n".join(self._death_report(c) for c in dead))

    def _death_report(self, child) -> str:
        words = child.last_words()
        text = f"ShmLoader: {child.role} (pid {child.pid}) {child.how_it_ended()}"
        code = child.exitcode
        if self._torch_rules and code is not None and child.role != "the collator":
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
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        self._moved_out = self._kept_moved_out()
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
        if self._trace is not None:  # every writer is gone now (NOTE [ Trace records ])
            self._trace.write()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        trace = getattr(self, "_trace", None)
        unwritten = trace is not None and not trace.written  # (workers stopped after each epoch)
        if (getattr(self, "_shared", None) is not None or unwritten) and \
                os.getpid() == self._owner_pid:
            self.close()

    # --- receiving --------------------------------------------------------------------

    def _receive(self, deadline=None):
        """The next message from the collator.  Waits in bounded slices,
        checking the children and the deadline (the loader's timeout)."""
        control = self._shared.control
        while True:
            if shmq.atomic_load(control.ctl, C.MEMORY_WAIT):
                self._move_kept_out(partial_only=False)  # NOTE [ Kept batch memory ]
            try:
                msg = self._shared.receive(self._shared.to_main.get(timeout=P.WAIT_SLICE_S))
            except shmq.Empty:
                self._check_children()
                if deadline is not None and time.monotonic() > deadline:
                    torch_text = (f"DataLoader timed out after {self.timeout} seconds. "
                                  if self._torch_rules else "")
                    raise LoaderTimeout(
                        f"{torch_text}ShmLoader: no batch within timeout={self.timeout}s; a "
                        f"worker may be stuck in dataset[...]. Their stacks:\n"
                        f"{self._worker_stacks()}") from None
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

    @property
    def _threads(self) -> bool:
        return self.worker_mode == "thread"

    def _worker_stacks(self) -> str:
        """Each worker's Python stacks, written by faulthandler on SIGUSR1
        (it works even while the worker is stuck inside a C call)."""
        workers = self._worker_children()
        if self._threads:
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

    def _route(self, msg) -> None:
        """File a message under its run: the runs main still reads get it;
        a batch of a run main abandoned is released at once."""
        kind = type(msg)
        if kind is P.MemoryWait:
            # A wake-up only: every caller receives again, and _receive
            # moves what the loop keeps out of the pool while MEMORY_WAIT is
            # set.  (If the loop keeps nothing, the pool is full of batches
            # loading ahead, a cap under prefetch's needs: stats() says so.)
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

    # --- planning a pass ------------------------------------------------------------

    def _base_seed(self, epoch: int, resumed: int | None = None) -> int:
        """The seed workers take for an epoch (see seed_worker): drawn from
        the generator as torch's DataLoader draws it (once per iterator it
        makes: each epoch, or once with persistent workers), else from the
        seed.  A resumed epoch takes the one its state recorded (`resumed`),
        drawing nothing: the recorded generator states are those after it
        was drawn (NOTE [ Resuming an epoch ])."""
        early, self._early_base_seed = self._early_base_seed, None
        if resumed is None:
            resumed = early
        if resumed is not None:
            self._drawn_base_seed = resumed
            return resumed
        if self._torch_rules or self.generator is not None:
            if self._drawn_base_seed is not None and self.persistent_workers and self.num_workers:
                return self._drawn_base_seed
            import torch

            seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
            self._drawn_base_seed = seed
            return seed
        return int(derived_seeds(self.seed & ((1 << 64) - 1), epoch, 0, 0)[0])

    def _rng_states(self) -> dict:
        """The states of the torch generators an epoch's order and base
        seed are drawn from, as bytes (see NOTE [ Resuming an epoch ])."""
        states = {}
        if self.generator is not None:
            states["generator"] = self.generator.get_state().numpy().tobytes()
        elif self._torch_rules:  # DataLoader draws from torch's global generator
            import torch

            states["global"] = torch.get_rng_state().numpy().tobytes()
        sampler_gen = getattr(self.sampler, "generator", None)
        if sampler_gen is not None and hasattr(sampler_gen, "get_state"):
            states["sampler"] = sampler_gen.get_state().numpy().tobytes()
        return states

    def _set_rng_states(self, states: dict) -> None:
        import torch

        def tensor(b):
            return torch.from_numpy(np.frombuffer(b, np.uint8).copy())

        if "generator" in states and self.generator is not None:
            self.generator.set_state(tensor(states["generator"]))
        if "global" in states:
            torch.set_rng_state(tensor(states["global"]))
        if "sampler" in states:
            self.sampler.generator.set_state(tensor(states["sampler"]))

    def _snapshot(self, epoch: int):
        """The dataset's own view of the epoch starting, or None: see NOTE
        [ Datasets that change with the epoch ] in _epochs.py."""
        take = getattr(self.dataset, "epoch_snapshot", None)
        if not callable(take):
            return None
        return take(EpochInfo(epoch, self.seed, self._rank, self._world))

    def _plan(self, epoch: int, resume: dict | None = None, snapshot=None) -> _Plan:
        """Decide epoch's pass: which indices in which order (see NOTE
        [ Runs ]); with `resume`, only what the state says is left of it
        (NOTE [ Resuming an epoch ])."""
        if snapshot is None:
            snapshot = self._snapshot(epoch)
        if resume is None or "global" not in resume["rng"]:
            plan = self._plan_drawn(epoch, resume)
        else:
            import torch

            with torch.random.fork_rng(devices=[]):  # the user's global generator is left alone
                plan = self._plan_drawn(epoch, resume)
        return plan._replace(snapshot=snapshot)

    def _plan_drawn(self, epoch: int, resume: dict | None) -> _Plan:
        if resume is not None:
            if (resume["rank"], resume["world"]) != (self._rank, self._world):
                raise ValueError(f"this state is of rank {resume['rank']} of {resume['world']}; "
                                 f"this loader is rank {self._rank} of {self._world}: each rank "
                                 f"resumes from its own state")
            self._set_rng_states(resume["rng"])
        base_seed = self._base_seed(epoch, None if resume is None else resume.get("base_seed"))
        # after the base seed, as torch draws it before the order: these are
        # the states the order is drawn from (NOTE [ Resuming an epoch ])
        rng = self._rng_states()
        if self.iterable:
            progress = StreamProgress(max(self.num_workers, 1), self._rows,
                                      None if resume is None else resume["stream"])
            shipped = None if resume is None else progress.skips()
            return _Plan(epoch, -1, -1 if shipped is None else len(shipped), -1, -1,
                         O.ORDER_RANGE if shipped is None else O.ORDER_SHIPPED, 0, shipped, None,
                         base_seed, rng, progress)
        shipped = offsets = stream = None
        if self.sampler is not None and not self._torch_rules:
            streamed, stream = streamable(self.sampler)
            if not streamed:  # drawn whole, from what streamable() started
                stream = list(stream) if stream is not None else None
        if self.batch_sampler is not None:
            batches = [np.asarray(list(b), np.int64).reshape(-1) for b in self.batch_sampler]
            shipped = np.concatenate(batches) if batches else np.zeros(0, np.int64)
            offsets = np.zeros(len(batches) + 1, np.int64)
            np.cumsum([len(b) for b in batches], out=offsets[1:])
            kind, order_seed, size = O.ORDER_SHIPPED, 0, len(shipped)
        elif self.sampler is not None and not isinstance(stream, (list, type(None))):
            kind, order_seed, size = O.ORDER_SHIPPED, 0, len(self.sampler)  # streamed
        elif self.sampler is not None:
            items = stream if stream is not None else list(self.sampler)
            if all(isinstance(i, (int, np.integer)) for i in items):
                shipped, kind = np.asarray(items, np.int64).reshape(-1), O.ORDER_SHIPPED
            else:  # indices of other kinds (lists, keys): dataset[...] gets them as they are
                shipped, kind = items, O.ORDER_OBJECTS
            order_seed, size = 0, len(shipped)
        elif self.shuffle and self.generator is not None:
            import torch

            # torch's RandomSampler(generator=...) yields randperm(n) of its
            # generator (and draws the next randperm only once exhausted,
            # which this loader, like np.fromiter of it, never asks for):
            # the same draw, in one call, with no Python int per index
            n = self._dataset_len()
            shipped = torch.randperm(n, generator=self.generator).numpy()
            shipped = O.shard(shipped, self._rank, self._world)
            kind, order_seed, size = O.ORDER_SHIPPED, 0, len(shipped)
        else:
            # computed by the workers from the dataset's length (SIZE), then
            # cut into this rank's share
            kind = O.ORDER_PERMUTATION if self.shuffle else O.ORDER_RANGE
            order_seed = O.order_seed_word(self.seed) if self.shuffle else 0
            size = self._dataset_len()
        share = size if kind in (O.ORDER_SHIPPED, O.ORDER_OBJECTS) else O.shard_size(
            size, self._world)
        if offsets is not None:
            kept = share
        else:
            kept = share if self.batch_size is None else O.kept_of(share, self.batch_size,
                                                                   self.drop_last)
            if shipped is not None:
                shipped = shipped[:kept]
        done = remaining = None
        if resume is not None:  # the epoch's remaining positions, in its order
            done = MapProgress.done_of(resume["map"])
            positions = resume["map"]["positions"]
            if positions != kept:
                raise ValueError(f"this state is of an epoch of {positions} samples, but the "
                                 f"loader's epoch {epoch} has {kept}: load it into a loader of "
                                 f"the same dataset, sampler and batching")
            remaining = O.Remaining(kept, *done.state())
            if shipped is not None:  # written out anyway: write out what is left of it
                remap = remaining.original(np.arange(remaining.count, dtype=np.int64))
                if isinstance(shipped, list):
                    shipped = [shipped[i] for i in remap]
                else:
                    shipped = np.ascontiguousarray(shipped[:kept][remap], np.int64)
                if offsets is not None:  # each batch keeps its remaining positions
                    counts = np.diff(np.searchsorted(remap, offsets))
                    counts = counts[counts > 0]
                    offsets = np.zeros(len(counts) + 1, np.int64)
                    np.cumsum(counts, out=offsets[1:])
                kind = O.ORDER_OBJECTS if isinstance(shipped, list) else O.ORDER_SHIPPED
                order_seed, size = 0, remaining.count
            # else a computed order stays computed: the workers get the few
            # numbers of `remaining` (NOTE [ The seeded order ]); a streamed
            # sampler skips the delivered positions as it is pulled
            kept = remaining.count
            if kind == O.ORDER_SHIPPED and shipped is None:
                size = kept
        feed = None
        if kind == O.ORDER_SHIPPED and shipped is None:
            feed = SamplerFeed(stream, self._sampler_name(), len(self.sampler), kept, remaining)
        nbatches = len(offsets) - 1 if offsets is not None else (
            kept if self.batch_size is None else -(-kept // self.batch_size))
        per_batch = self.collate_fn is not None or self.batch_size is None  # tags are units
        claims_batches = per_batch or (
            (self._torch_rules or self._batched_fetch()) and self.num_workers > 0)
        units = nbatches if claims_batches else kept
        if units >= 1 << C.RUN_SHIFT:  # the cursor counts a run's units in 32 bits
            raise ValueError(f"an epoch of {kept:,} samples is {units:,} units for the workers "
                             f"to claim, and a run holds fewer than 2**32: pass a larger "
                             f"batch_size with a collate_fn (workers then claim whole batches), "
                             f"or split the dataset")
        progress = MapProgress(kept if resume is None else resume["map"]["positions"], done,
                               remaining, O.Batches(kept, self._rows, offsets), per_batch)
        return _Plan(epoch, size, kept, units, nbatches, kind, order_seed, shipped, offsets,
                     base_seed, rng, progress,
                     remaining=remaining if kind in (O.ORDER_RANGE, O.ORDER_PERMUTATION) else None,
                     feed=feed)

    def _limit(self, run: _Run, yielded: int) -> int:
        """Units workers may load once `yielded` batches were yielded: those
        of the next `prefetch` batches.  (Iterable runs: per worker.)  A run
        started ahead shares `prefetch` with the epoch still running: it is
        given a negative `yielded`, minus the batches that epoch has left."""
        if run.batches is None:  # each stream's next batches (a resumed one starts further)
            ahead = self._cfg.worker_prefetch + self._cfg.shuffle_batches
            return [j + ahead for j in run.plan.progress.first_batches()]
        upto = max(min(yielded + self.prefetch, run.plan.nbatches), 0)
        if run.plan.units == run.plan.nbatches:  # workers claim whole batches
            return upto
        return run.batches.span(upto - 1)[1] if upto > 0 else 0

    def _open_limit(self, run: _Run, yielded: int) -> int:
        """_limit(), once a streamed sampler has written the indices of
        every position below it (NOTE [ Streamed samplers ])."""
        limit = self._limit(run, yielded)
        feed = run.plan.feed
        if feed is not None and run.batches is not None:
            upto = limit if run.plan.units != run.plan.nbatches else (
                run.batches.span(limit - 1)[1] if limit > 0 else 0)
            feed.feed(upto)
            feed.release_below(run.plan.progress.run_prefix())
        return limit

    def _start_run(self, epoch, resume: dict | None = None, snapshot=None,
                   yielded: int = 0) -> _Run:
        """Start a pass over the data for `epoch` (see NOTE [ Runs ]);
        yielded: see _limit."""
        run_id = self._runs + 1
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while run_id - 2 in self._unended:  # its block is about to be reused
            self._route(self._receive(deadline))
        plan = self._plan(epoch, resume, snapshot)
        if isinstance(plan.shipped, list):
            self._shared.write_objects(run_id, plan.shipped)
        elif plan.shipped is not None:
            self._shared.write_order(run_id, plan.shipped, plan.offsets)
        elif plan.remaining is not None:
            self._shared.write_order(run_id, plan.remaining.words(), None)
        elif plan.feed is not None:
            plan.feed.attach(self._shared.order_fd(run_id))
        if plan.snapshot is not None:
            self._shared.write_snapshot(run_id, plan.snapshot)
        batches = None if self.iterable else O.Batches(plan.kept, self._rows, plan.offsets)
        run = _Run(run_id, plan, batches)
        self._runs = run_id
        self._unended.add(run_id)
        self._inboxes[run_id] = collections.deque()
        self._shared.control.start_run(
            run_id, epoch, plan.size, plan.kept, plan.units, plan.nbatches, plan.order_kind,
            plan.order_seed, int(plan.offsets is not None), plan.base_seed,
            self._open_limit(run, yielded),
            int(plan.snapshot is not None), int(plan.remaining is not None))
        return run

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
        set_epoch(); an iterable dataset), nor without persistent workers,
        nor for DataLoader (torch draws its seeds at iter(), maybe after
        the user reseeded the generator)."""
        return (self.persistent_workers and self.sampler is None and self.batch_sampler is None
                and not self.iterable and not self._torch_rules)

    def _run_for(self, epoch, resume: dict | None) -> _Run:
        """The run for `epoch`: the one started ahead if len(dataset) has not
        changed since, else a new one."""
        ahead, self._ahead = self._ahead, None
        self._end(self._current)  # an iterator this one supersedes
        self._current = None
        snapshot = self._snapshot(epoch)  # the dataset as this epoch starts
        if ahead is not None and resume is None and ahead.plan.epoch == epoch and \
                ahead.plan.size == self._dataset_len() and ahead.plan.snapshot == snapshot:
            self._current = ahead
            return ahead
        self._end(ahead)
        self._current = self._start_run(epoch, resume, snapshot)
        return self._current

    # --- iteration ----------------------------------------------------------------------

    def __iter__(self):
        if self._closed:
            raise ValueError("this ShmLoader is closed; create a new one")
        self._check_owner()
        self.thaw_state()  # a pass of its own, or a wrapper's (which freezes it again)
        if self._shared is None:  # (re)starting: the ranks are taken now (torchrun may have
            self._rank, self._world = self._ranks()  # initialised its process group since)
        resume, self._resume = self._resume, None
        if resume is not None:
            self._epoch = resume["epoch"] - 1  # the epoch the state is in
        self._epoch += 1
        if self._torch_rules and resume is None:  # torch draws it as the iterator is made
            self._early_base_seed = None
            self._early_base_seed = self._base_seed(self._epoch)
        if self.pin_memory and not self._torch_rules and not cuda_available():
            warnings.warn("ShmLoader: pin_memory=True, but CUDA is not available: batches are not "
                          "pinned (pin_memory=False says the same without this warning)",
                          UserWarning, stacklevel=2)
        if self.num_workers == 0:
            return InlineEpoch(self, self._epoch, resume)
        if self._shared is None:
            self._start()
        return (StreamEpoch if self.iterable else MapEpoch)(self, self._epoch, resume)

    def steps(self, n: int | None = None):
        """Yield n batches (None: for ever), going from one epoch into the
        next with no pause (the next epoch's first batches are loaded
        before the current one ends) and advancing the epoch, and so its
        shuffle and seeds, at each boundary.  steps() called again goes on
        where the last call stopped, mid-epoch included; state_dict() and
        load_state_dict() work between and within calls."""
        if n is not None:
            _positive_int("n", n, 0)
        count = 0
        while n is None or count < n:
            current = self._steps_epoch
            if current is None or current[0] != self._epoch or self._resume is not None:
                it = iter(self)  # the next epoch (or the one a loaded state is in)
                current = self._steps_epoch = (self._epoch, it)
            got = False
            for batch in current[1]:
                got = True
                count += 1
                yield batch
                if n is not None and count >= n:
                    return  # the epoch's iterator stays suspended here for the next call
            self._steps_epoch = None
            if not got and current[0] == self._epoch:
                raise ValueError("ShmLoader.steps(): an epoch yielded no batch (an empty dataset, "
                                 "or drop_last with fewer samples than a batch); there is nothing "
                                 "to step through")

    def _workers_loading(self) -> int:
        scaler = getattr(self, "_autoscaler", None)
        return scaler.active if scaler is not None else self.num_workers

    def _record_stats(self, epoch: int, msg: P.RunEnded | None, clock: EpochClock,
                      batches: int = 0, samples: int = 0) -> None:
        """An epoch ran to its end: keep its figures for stats() (msg: the
        collator's account; None when the epoch was loaded in this process,
        which counted `batches` and `samples` itself)."""
        by_collator = relayouts = peak = cap = 0
        if msg is not None:
            batches, samples, by_collator, relayouts = (msg.batches, msg.samples,
                                                        msg.rows_by_collator, msg.relayouts)
            peak, cap = msg.peak_slab_bytes, self.memory_cap_bytes
        workers = self._workers_loading()
        s = {"epoch": epoch, "batches": batches, "samples": samples,
             "samples_written_by_workers": samples - by_collator,
             "samples_written_by_collator": by_collator, "relayouts": relayouts,
             "workers": workers, **clock.figures(workers, peak, cap)}
        s["summary"] = summary_line(s)
        self._stats = s
        # once per loader; loader.DataLoader keeps torch's behaviour (no warning)
        if not self._warned_stall and not self._torch_rules:
            advice = stall_advice(s)
            if advice is not None:
                self._warned_stall = True  # (before: with -W error the warning raises)
                warn_stalled(advice)

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
        """Raise what a worker (or the collator) reported: its exception's
        own type when main can build one with a message, as PyTorch does,
        with the worker's traceback in the message; else WorkerError."""
        err = msg.error
        index = msg.index if msg.index >= 0 else None
        if index is None and msg.pos >= 0:
            index = self._index_at(msg.run, msg.pos)  # the collator knows positions only
        if index is not None:
            at = f" on sample index {index} (position {msg.pos})"
        elif msg.batch >= 0:
            at = f" on batch {msg.batch}"
        else:
            at = ""
        text = f"Caught {err.type_name} {err.where} (pid {msg.pid}){at}.\nOriginal {err.text}"
        exc_type = err.exception_type()
        if exc_type is KeyError:
            text = _KeyErrorMessage(text)
        try:
            exc = exc_type(text) if exc_type is not None else None
        except Exception:
            exc = None
        if not isinstance(exc, BaseException):
            raise WorkerError(text)
        raise exc

    def _index_at(self, run_id: int, pos: int):
        """The dataset index at position pos of a map-style run main still
        has (the current one, or the one started ahead), else None."""
        run = next((r for r in (self._current, self._ahead) if r is not None and r.id == run_id),
                   None)
        if run is None or run.batches is None or not 0 <= pos < run.plan.kept:
            return None
        if run.plan.feed is not None:
            return run.plan.feed.index(pos)
        return O.index_getter(self._order_of(run.plan))(pos)

    def _order_of(self, plan: _Plan):
        """The order of a map-style plan's run: its shipped indices, a
        computed order, or None (the position is the index)."""
        if plan.shipped is not None:
            return plan.shipped
        if plan.feed is not None:
            return plan.feed
        return O.computed_order(plan.order_kind, plan.size, plan.order_seed, plan.epoch,
                                self._rank, self._world, plan.kept, plan.remaining)

    def _tags(self, msg: P.BatchReady) -> np.ndarray:
        """The tags the writers gave the batch's rows (see _layout.Layout)."""
        off = msg.slab.offset + msg.tags
        return self._shared.arena[off:off + 8 * msg.rows].view(np.int64).copy()

    # --- resuming ---------------------------------------------------------------------

    def _track(self, plan: _Plan):
        """The epoch of this plan is the one state_dict() describes now."""
        self._progress, self._progress_plan = plan.progress, plan
        return plan.progress

    def state_dict(self) -> dict:
        """Where the loader is: the epoch in progress and which of its
        samples the training loop has received (a few numbers: no sample
        data, cheap enough to take every step).  A new loader of the same
        dataset and arguments given it by load_state_dict() yields exactly
        the rest of that epoch, then the following epochs as this one
        would.  See NOTE [ Resuming an epoch ] in _progress.py; behind a
        wrapper that looks ahead, freeze_state() (NOTE [ A state through a
        look-ahead wrapper ] in _frozen_state.py)."""
        frozen = self._frozen_state_copy()
        if frozen is not None:
            return frozen
        progress = self._progress
        state = {"format": STATE_FORMAT, "epoch": self._epoch, "seed": self.seed,
                 "rank": self._rank, "world": self._world, "workers": self.num_workers,
                 "iterable": self.iterable, "rng": {}, "base_seed": None, "map": None,
                 "stream": None, "batch_size": self.batch_size, "dataset_len": self._map_len(),
                 "sampler": self._sampler_name()}
        if progress is None:  # no epoch started: the next is the first
            state["complete"] = True
            return state
        plan = self._progress_plan
        state["rng"] = dict(plan.rng)
        state["base_seed"] = plan.base_seed
        if isinstance(progress, MapProgress):
            state["map"] = progress.state()
            state["complete"] = progress.complete()
        else:
            state["stream"] = progress.state()
            state["complete"] = progress.complete
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(): the next iter() yields the rest of the
        epoch the state was taken in (or the next epoch, if it was over)."""
        self._check_owner()
        check_state(state, self._expected_state())  # before anything changes (_state.py)
        self._freeze_loaded(state)
        if self._shared is not None:
            self._end(self._current)
            self._end(self._ahead)
            if state["seed"] != self.seed:
                self._shutdown()  # the workers know the old seed: new ones start at iter()
        self._current = self._ahead = None
        self._steps_epoch = None
        self.seed = state["seed"]
        if state["complete"]:
            self._epoch, self._resume = state["epoch"], None
        else:
            self._resume = state
        self._progress = None

    def _sampler_name(self) -> str | None:
        s = self.batch_sampler if self.batch_sampler is not None else self.sampler
        return None if s is None else getattr(s, "sampler_name", type(s).__name__)

    def _map_len(self) -> int | None:
        """The dataset's length (None: iterable, or none)."""
        if self.iterable:
            return None
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def _epoch_positions(self, world: int) -> int | None:
        """The positions of a map-style epoch of this rank, as _plan counts
        them (None: a batch sampler's, known only by iterating it)."""
        if self.iterable or self.batch_sampler is not None:
            return None
        n = len(self.sampler) if self.sampler is not None else self._map_len()
        if n is None:
            return None
        share = n if self.sampler is not None else O.shard_size(n, world)
        return share if self.batch_size is None else O.kept_of(share, self.batch_size,
                                                                  self.drop_last)

    def _expected_state(self) -> Expected:
        rank, world = self._ranks()
        return Expected(
            iterable=self.iterable, num_workers=self.num_workers, rank=rank, world=world,
            seed=self.seed if self._seed_given else None, batch_size=self.batch_size,
            positions=self._epoch_positions(world), dataset_len=self._map_len(),
            sampler=self._sampler_name(),
            rng_bytes={k: len(v) for k, v in self._rng_states().items()},
            seeded_shuffle=(self.shuffle and self.generator is None and self.sampler is None
                            and self.batch_sampler is None and not self.iterable))

    def _batch(self, msg: P.BatchReady):
        s = msg.slab
        if self._pinned is not None:
            self._pinned.pin(s.offset, s.nbytes)
        slab = self._leases.view(s.lease, s.generation, s.offset, s.nbytes)
        batch = self._materializer(msg.spec, slab)
        if self._leases.dropped_bytes * 4 >= self._shared.arena.nbytes:
            # Slabs mostly dropped (targets.append(y)) hold a quarter of the
            # pool: give them back before the pool runs short.
            self._move_kept_out(partial_only=True)
        return batch

    @property
    def _materializer(self) -> Materializer:
        """Builds batches for this loader's output (its leaf plans kept
        across batches); made again if output or torch's rules changed."""
        m = self.__dict__.get("_materializer_made")
        if m is None or m.output != self.output or m.torch_rules != self._torch_rules:
            m = self.__dict__["_materializer_made"] = Materializer(self.output, self._torch_rules)
        return m

    def _move_kept_out(self, partial_only: bool) -> int:
        """Move the parts of batches the training loop still holds out of
        the pool, at the same addresses, and let the collator reuse their
        slabs: see NOTE [ Kept batch memory ] in _leases.pxi.  Returns the
        slabs given back."""
        slabs, _ = self._leases.evict(partial_only)
        if slabs and self._pinned is not None:  # new batches are viewed in a new mapping
            self._pinned.close()
            self._pinned = self._pin_chunks()
        return slabs


def _close_all():
    for loader in list(_live_loaders):
        if loader._owner_pid == os.getpid():
            loader.close()


atexit.register(_close_all)
