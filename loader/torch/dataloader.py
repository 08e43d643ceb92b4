"""`from loader import DataLoader`: torch.utils.data.DataLoader, running on
ShmLoader.

It *is* a torch DataLoader (a subclass), so torch's own argument checks,
samplers, attributes, len() and error messages apply unchanged, and code
that checks isinstance(loader, torch.utils.data.DataLoader) accepts it.
Only loading differs: iterating runs ShmLoader's forked workers, which
write samples straight into shared-memory batch slabs, and yields tensors
viewing them.  Batches are those torch gives: the same order for the same
generator or seeds, torch's default_collate structure and dtypes, worker
seeding by torch's rules (base seed drawn from the generator per iterator;
each worker seeded with base_seed + worker id before worker_init_fn), the
original exception type re-raised in main.

What has no meaning here is accepted and documented:
- multiprocessing_context: None and "fork" fork the workers (ShmLoader's
  start_method="fork"); "spawn" and "forkserver" (a name or a context)
  start them clean, ShmLoader's start_method="spawn": fresh interpreters
  given the dataset by pickle and the shared memory by descriptor (NOTE
  [ Starting clean ] in shared/passable.py), as forkserver's children are
  clean and unpickle it.
- pin_memory without an accelerator: a warning, as torch gives.

One keyword torch does not have: trace=PATH, as ShmLoader's (a Perfetto
trace of the loader's own workers, written when it is closed).

Iterators are torch's: without persistent workers each iter() is its own
pass with its own workers, so several may be live at once (a peek with
next(iter(loader)) inside the loop, zip(loader, loader)); with persistent
workers iter() resets the one iterator, as torch's does.  See NOTE
[ Drawing the order as torch does ] for the sampler's generator.
"""

from __future__ import annotations

import os
import signal
import warnings
import weakref
from typing import NamedTuple, TypeVar

import torch
import numpy as np
from torch.utils.data import BatchSampler, IterDataPipe, SequentialSampler
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.dataloader import (_BaseDataLoaderIter, _DatasetKind,
                                         _MultiProcessingDataLoaderIter,
                                         _SingleProcessDataLoaderIter)

from loader.errors import LoaderTimeout, StateError, WorkerError
from loader.main.lookahead import FrozenState
from loader.main.loader import (ShmLoader, TorchRulesLoader, continue_from, stop_workers,
                                worker_children)
from loader.main.procs import wait_all
from loader.torch.order import TorchOrder, epoch_sampler
from loader.shared.trace import check_path
from loader.torch.integrations import accelerate as _accelerate_integration
from loader.torch.integrations import install_imported

__all__ = ["DataLoader"]

# HF accelerate rebuilds the DataLoaders it prepares as torch's class: make
# it keep this one (loader/torch/integrations/accelerate.py), whenever it is imported.
_accelerate_integration.install_when_imported()


_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(FrozenState, _TorchDataLoader[_T_co]):
    """torch.utils.data.DataLoader's signature, defaults and batches, with
    ShmLoader's shared-memory workers underneath.  See the module docstring
    for what differs (nothing a training loop sees)."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, trace=None):
        install_imported()  # NOTE [ Installing the integrations ]
        self._user_collate_fn = collate_fn
        self._trace = trace        # ShmLoader(trace=...): the loader's own workers' run
        if trace is not None:
            check_path(trace)      # a bad path fails here, as ShmLoader's does
        self._pool = None          # the loader's own ShmLoader: state_dict() is its
        self._pool_user = None     # (weakref) the iterator using it, without persistent workers
        self._loaded = None        # a state load_state_dict() gave, until a pass takes it
        self._extra_pools = weakref.WeakSet()  # ShmLoaders of further live iterators
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
                         collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
                         multiprocessing_context, generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        _accelerate_integration.remember_samplers(self)  # a rebuild as torch's class warns

    def __getstate__(self):
        # A copy (pickle, deepcopy: Lightning, spawn) gets the arguments, not
        # this process's workers or iterators: it starts its own when iterated.
        state = self.__dict__.copy()
        state.update(_pool=None, _pool_user=None, _extra_pools=None, _iterator=None,
                     _frozen_state=None, _loaded=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._extra_pools = weakref.WeakSet()

    @property
    def _shm(self) -> ShmLoader | None:
        return None if self._pool is None else self._pool.shm

    def _shm_loader(self) -> ShmLoader:
        """The ShmLoader that loads for this DataLoader, made when first
        needed (torch's attributes may be read until then), following the
        samplers while no pass of its own is in progress (NOTE [ The
        samplers a pass takes ])."""
        if self._pool is None:
            self._pool = self._new_pool()
        elif not self._own_pass_live():
            self._follow_samplers()
        return self._pool.shm

    def _own_pass_live(self) -> bool:
        """Is a pass on the loader's own ShmLoader begun and not ended?"""
        if self.persistent_workers and self.num_workers > 0:
            it = self._iterator
        else:
            it = None if self._pool_user is None else self._pool_user()
        return it is not None and not it.finished

    def _new_pool(self, traced: bool = True) -> _Pool:
        sampling = self._sampling()
        order = None
        if sampling.source is not None:
            order = TorchOrder(sampling.source, self._index_sampler, self._generators(),
                               self._prefetched_batches())
        custom = self._user_collate_fn not in (None, default_collate, default_convert)
        workers = self.num_workers
        pipe = _PipeEpochs(self.dataset) if isinstance(self.dataset, IterDataPipe) else None
        shm = TorchRulesLoader(
            self.dataset if pipe is None else pipe, num_workers=workers,
            collate_fn=self.collate_fn if custom else None,
            in_order=self.in_order,
            prefetch=(self.prefetch_factor or 2) * max(workers, 1) if workers else None,
            persistent_workers=self.persistent_workers, worker_init_fn=self.worker_init_fn,
            generator=self.generator, reproducible=False,
            timeout=self.timeout if self.timeout > 0 else None,
            output="keep" if custom else "torch", pin_memory=self.pin_memory,
            trace=self._trace if traced else None, start_method=self._start_method(),
            **sampling.loader_arguments(order))
        return _Pool(shm, order, pipe, sampling)

    def _start_method(self) -> str:
        """ShmLoader's start_method for torch's multiprocessing_context
        (torch's setter has made it a context, or left it None)."""
        context = self.multiprocessing_context
        if context is None or context.get_start_method() == "fork":
            return "fork"
        return "spawn"  # spawn, forkserver: children that start clean

    def _sampling(self) -> _Sampling:
        """The samplers as they are now, as ShmLoader takes them: the order's
        source is None for an iterable dataset and for torch's default
        sequential order over this dataset (workers compute it), else the
        sampler (or batch sampler) iterated in main at each epoch as torch
        iterates it (NOTE [ Drawing the order as torch does ])."""
        if self._dataset_kind == _DatasetKind.Iterable:
            return _Sampling(self.batch_size, self.drop_last, False, None)
        bs = self.batch_sampler
        if bs is None:  # batch_size=None: one sample at a time, not collated
            return _Sampling(None, False, False, self._order_source(self.sampler))
        if type(bs) is BatchSampler:  # torch's own: batches are cut from the order
            return _Sampling(bs.batch_size, bs.drop_last, False, self._order_source(bs.sampler))
        return _Sampling(None, False, True, bs)  # a user's batch sampler: its batches as they come

    def _order_source(self, sampler):
        if type(sampler) is SequentialSampler and sampler.data_source is self.dataset:
            return None
        return sampler

    def _prefetched_batches(self) -> int:
        return (self.prefetch_factor or 2) * self.num_workers if self.num_workers else 1

    def _follow_samplers(self) -> None:
        """The own ShmLoader takes the samplers as they are now (NOTE [ The
        samplers a pass takes ]): a new source of the order goes to its
        TorchOrder; a change of what it was made with makes a new one,
        which a loaded state no pass took yet goes to."""
        pool, now = self._pool, self._sampling()
        if now.shape() == pool.sampling.shape():
            if pool.order is not None:
                pool.order.follow(now.source, self._index_sampler, self._generators())
            self._pool = pool._replace(sampling=now)
            return
        pool.shm.close()
        self._pool = self._new_pool()
        continue_from(self._pool.shm, pool.shm)
        if self._loaded is not None:
            self._load(self._loaded)

    def _generators(self) -> list:
        """The generators drawing an order can consume: torch's global one,
        the loader's, and those of its samplers."""
        found = [torch.default_generator]
        for g in (self.generator, getattr(self.sampler, "generator", None),
                  getattr(getattr(self.batch_sampler, "sampler", None), "generator", None)):
            if isinstance(g, torch.Generator) and all(g is not h for h in found):
                found.append(g)
        return found

    def __iter__(self):
        self.thaw_state()  # a pass of its own, or a wrapper's (which freezes it again)
        if self.num_workers > 0:
            self.check_worker_number_rationality()  # torch warns at each iterator too
        if self.pin_memory and not torch.accelerator.is_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=2)
        if self.persistent_workers and self.num_workers > 0:
            # torch keeps one iterator and resets it: an older reference to it
            # goes on with the new epoch, on the same workers
            pool = self._pool_for_a_pass()
            if self._iterator is None:
                self._iterator = _new_iterator(self, pool)
            else:
                self._iterator._reset(self, pool)
            return self._iterator
        user = None if self._pool_user is None else self._pool_user()
        if user is None or user.finished:
            it = _new_iterator(self, self._pool_for_a_pass())
            self._pool_user = weakref.ref(it)
            return it
        # another iterator is live: this one has its own workers, as in torch
        pool = self._new_pool(traced=False)  # the trace is of the loader's own workers
        self._extra_pools.add(pool.shm)
        return _new_iterator(self, pool, owned=True)

    def _pool_for_a_pass(self) -> _Pool:
        """The own ShmLoader, for a pass starting on it now: it takes the
        samplers as they are (NOTE [ The samplers a pass takes ])."""
        if self._pool is None:
            self._pool = self._new_pool()
        else:
            self._follow_samplers()
        self._loaded = None  # the pass takes it
        return self._pool

    def close(self) -> None:
        """Stop the workers now (they also stop when the DataLoader is
        garbage collected, and at interpreter exit)."""
        for shm in list(self._extra_pools):
            shm.close()
        if self._pool is not None:
            self._pool.shm.close()

    def state_dict(self) -> dict:
        """The position of the current epoch, to resume it exactly: see
        ShmLoader.state_dict.  With several live iterators, the state is
        of the one the loader's own workers serve (the first).  Behind a
        wrapper that looks ahead: freeze_state() (main/lookahead.py)."""
        frozen = self._frozen_state_copy()
        if frozen is not None:
            return frozen
        state = self._shm_loader().state_dict()
        order = self._pool.order
        if order is not None and order.sampler_epoch is not None and not state.get("complete"):
            # the epoch's order came from a sampler's set_epoch (DistributedSampler):
            # see NOTE [ The sampler's epoch in a state ]
            state["sampler_epoch"] = order.sampler_epoch
        return state

    def load_state_dict(self, state: dict) -> None:
        self._shm_loader()
        self._load(state)
        self._loaded = state

    def _load(self, state: dict) -> None:
        """load_state_dict() into the own ShmLoader as it is now."""
        shm = self._pool.shm
        sampler_epoch = None
        if isinstance(state, dict) and "sampler_epoch" in state:
            state = dict(state)
            sampler_epoch = state.pop("sampler_epoch")
            if not isinstance(sampler_epoch, int) or isinstance(sampler_epoch, bool):
                raise StateError(f"load_state_dict: field 'sampler_epoch' is {sampler_epoch!r}, "
                                 f"but it must be an int; load a state from state_dict() of a "
                                 f"loader of the same dataset and arguments")
            if self._pool.order is None or epoch_sampler(self._pool.order.source) is None:
                raise StateError("load_state_dict: the state records the epoch of a sampler "
                                 "with set_epoch (sampler_epoch), but this loader's sampler has "
                                 "none; load a state of a loader with the same sampler")
        shm.load_state_dict(state)
        self._freeze_loaded(state if sampler_epoch is None else {**state,
                                                                 "sampler_epoch": sampler_epoch})
        if self._pool.order is not None and not state.get("complete", True):
            self._pool.order.resuming = True
            self._pool.order.resume_epoch = sampler_epoch

    def stats(self) -> dict | None:
        """Where the last complete epoch's time went: see ShmLoader.stats
        (None before one ended)."""
        return None if self._pool is None else self._pool.shm.stats()


class _Sampling(NamedTuple):
    """What a DataLoader's ShmLoader is made with from its samplers (see
    DataLoader._sampling)."""
    batch_size: int | None
    drop_last: bool
    by_batch: bool  # the order is a batch sampler's: its batches as they come
    source: object  # what the order is drawn from (None: none to ship)

    def shape(self) -> tuple:
        """What a ShmLoader cannot change once made (NOTE [ The samplers a
        pass takes ])."""
        return self.batch_size, self.drop_last, self.by_batch, self.source is None

    def loader_arguments(self, order: "TorchOrder | None") -> dict:
        if self.by_batch:
            return {"batch_sampler": order}
        return {"batch_size": self.batch_size, "drop_last": self.drop_last, "sampler": order}


class _Pool(NamedTuple):
    """A ShmLoader serving a DataLoader, and the order it ships (None: the
    default sequential order, computed by its workers); pipe: the wrapper
    of an IterDataPipe dataset (NOTE [ IterDataPipes as torch runs them ]);
    sampling: what it was made with from the samplers."""
    shm: ShmLoader
    order: "TorchOrder | None"
    pipe: "_PipeEpochs | None"
    sampling: _Sampling


# NOTE [ The samplers a pass takes ]
# ==================================
#
# torch's iterator takes the loader's index sampler as it starts (each
# iter(), each _reset of a persistent one): iter(batch_sampler) reads the
# BatchSampler's sampler, batch_size and drop_last then.  A DataLoader's
# sampler and batch_sampler cannot be set once it is made, but what they
# hold can change: accelerate's prepare() puts its SeedableRandomSampler
# into the BatchSampler (DataLoaderShard.set_sampler) right after its
# DataLoaderAdapter called state_dict(), which made this loader's
# ShmLoader.  So the ShmLoader follows the samplers whenever no pass of
# its own is in progress: as a pass starts (iter()), and at state_dict()
# and load_state_dict() between passes.  A new source of the order goes to
# its TorchOrder (follow()); a change of what the ShmLoader was made with
# (_Sampling.shape(): a batch_size or drop_last set on the BatchSampler,
# the default sequential order replaced) makes a new ShmLoader, which goes
# on counting the epochs and keeps the base seed a persistent iterator drew
# (continue_from), and a state load_state_dict() gave that no pass took
# yet is loaded into it.  With persistent workers, that ShmLoader's
# workers are new: seeded as at a new iterator, where torch's workers go
# on with the random state they had (the order is torch's; random
# augmentation in dataset[i] restarts).  A sampler replaced during a pass
# orders the next one, as in torch.


# NOTE [ IterDataPipes as torch runs them ]
# =========================================
#
# torch's DataLoader treats an IterDataPipe specially (dataloader.py:
# _BaseDataLoaderIter, _sharding_worker_init_fn; _utils/worker.py):
# - each iterator (and each _reset of a persistent one) draws a "shared
#   seed" from the loader's generator (before the workers' base seed;
#   broadcast from rank 0 under torch.distributed) and every worker reseeds
#   the pipe's random datapipes (shuffle) from it with apply_random_seed,
#   so all workers shuffle alike and torch.manual_seed before an epoch
#   fixes its order;
# - each worker applies sharding_filter with apply_sharding over
#   num_workers * world_size instances, instance worker_id * world_size +
#   rank (num_workers=0: world_size instances, instance rank), so every
#   sample comes from exactly one worker of one rank.
# ShmLoader iterates its dataset afresh in each worker at each epoch, so
# the DataLoader hands it _PipeEpochs, which does both as iteration starts.
# The epoch's seed, world size and rank reach the (forked, possibly
# persistent) workers through three int64 words of an anonymous shared
# mapping, written by main before the epoch's run is published (the run's
# publication is the release store that makes them visible).

class _PipeEpochs(torch.utils.data.IterableDataset):
    """An IterDataPipe, sharded and reseeded per epoch as torch's workers
    do (NOTE [ IterDataPipes as torch runs them ])."""

    def __init__(self, pipe):
        import mmap

        self.pipe = pipe
        # MAP_SHARED | MAP_ANONYMOUS: shared with the forked workers, no name to leak
        self._words = np.frombuffer(mmap.mmap(-1, 24), np.int64)

    def new_epoch(self, generator, group) -> None:
        """In main, as torch's iterator starts or resets: draw the shared seed."""
        import torch.distributed as dist

        seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
        world, rank = 1, 0
        if dist.is_available() and dist.is_initialized():
            dist.broadcast(seed, src=0, group=group)
            world, rank = dist.get_world_size(), dist.get_rank()
        self._words[:] = (int(seed.item()), world, rank)

    def __iter__(self):
        from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

        seed, world, rank = (int(w) for w in self._words)
        info = torch.utils.data.get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        # torch applies it once per worker; the same values again change nothing
        apply_sharding(self.pipe, workers * world, wid * world + rank)
        rng = torch.Generator()
        rng.manual_seed(seed)
        apply_random_seed(self.pipe, rng)
        return iter(self.pipe)


class _Iterator(_BaseDataLoaderIter):
    """What iter(DataLoader) returns: torch's iterator protocol (len(),
    the warning for an IterableDataset that yields more than its len, the
    worker processes as `_workers`, `_shutdown_workers()`), pulling the
    order as torch's iterator does (NOTE [ Drawing the order as torch
    does ]).  It holds no reference to the DataLoader, as torch's does not:
    dropping both frees the workers at once.  It is an instance of the
    class of torch's iterator for the same loader (see _new_iterator), whose
    methods it replaces: none of torch's __init__ or loading runs."""

    def __init__(self, loader: DataLoader, pool: _Pool, owned: bool = False):
        self._pool, self._owned = pool, owned  # owned: a ShmLoader of this iterator alone
        self._index_sampler = loader._index_sampler
        self._dataset, self._iterable = loader.dataset, loader._dataset_kind == _DatasetKind.Iterable
        self._num_workers = loader.num_workers
        self._batches = None
        self._workers = []  # NOTE [ An iterator's workers ]
        self._pipe_group = None
        if pool.pipe is not None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._pipe_group = dist.new_group(backend="gloo")  # as torch's iterator makes
        self._reset(loader)

    def _reset(self, loader: DataLoader, pool: _Pool | None = None) -> None:
        """Start a new epoch (persistent workers: torch's _reset) on `pool`
        (the loader's own ShmLoader may be a new one: NOTE [ The samplers a
        pass takes ])."""
        if self._batches is not None:
            self._batches.close()
        if pool is not None:
            self._pool = pool
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        if self._pool.pipe is not None:  # drawn before the base seed, as torch draws it
            self._pool.pipe.new_epoch(loader.generator, self._pipe_group)
        self._batches = iter(self._pool.shm)
        if self._num_workers:
            self._batches.start()  # torch's iterator prefetches as it is made
            self._workers = [_WorkerProcess(c) for c in worker_children(self._pool.shm)]
        self._num_yielded = self._calls = 0
        self.finished = self._shut_down = False

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _shutdown_workers(self) -> None:
        """Stop this iterator's workers now and free what they used, as the
        end of a pass without persistent workers, or close(), does (torch's
        iterator method of this name: Lightning and other tools call it,
        then set the loader's _iterator to None); the loader's next iter()
        starts new ones.  Once more, or on an iterator whose workers another
        has since replaced, it does nothing (NOTE [ An iterator's workers ])."""
        if self._shut_down:
            return
        self._shut_down = True
        running = self._runs_the_loaders_workers()
        self.close()
        if running and not self._owned:
            stop_workers(self._pool.shm)
        self.finished = True

    def _runs_the_loaders_workers(self) -> bool:
        """Whether the loader's live workers are the ones this iterator's
        epoch started on (not those of a later iterator's epoch)."""
        return any(w.is_for(c) for c in worker_children(self._pool.shm) for w in self._workers)

    def __next__(self):
        if self.finished:
            raise StopIteration
        order = self._pool.order
        if order is not None and self._calls and not self._num_workers:
            order.pull()  # torch takes the next index before loading it
        self._calls += 1
        try:
            data = next(self._batches)
        except StopIteration:
            self._finish()
            raise
        except (WorkerError, LoaderTimeout):
            raise  # no batch came: torch's iterator takes no index either
        except Exception:
            if order is not None and self._num_workers:
                order.pull()  # a batch's error: torch takes an index before re-raising it
            raise
        if order is not None and self._num_workers:
            order.pull()
        self._num_yielded += 1
        self._check_length()
        return data

    def _check_length(self) -> None:
        if not self._iterable or self._IterableDataset_len_called is None:
            return
        if self._num_yielded > self._IterableDataset_len_called:
            msg = (f"Length of IterableDataset {self._dataset} was reported to be "
                   f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                   f"{self._num_yielded} samples have been fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly "
                        "configuring the IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                        "for examples.")
            warnings.warn(msg, stacklevel=3)

    def _finish(self) -> None:
        self.finished = True
        if self._pool.order is not None:
            self._pool.order.drain()
        if self._owned:
            self._pool.shm.close()

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
        if self._owned:
            self._pool.shm.close()

    def __del__(self):
        if getattr(self, "_batches", None) is not None:
            self.close()


def _new_iterator(loader: DataLoader, pool: _Pool, owned: bool = False) -> _Iterator:
    """An iterator of the class torch's DataLoader would make for `loader`:
    tools test it (Lightning calls _shutdown_workers() only on a
    _MultiProcessingDataLoaderIter)."""
    kind = _WorkersIterator if loader.num_workers > 0 else _InlineIterator
    return kind(loader, pool, owned)


class _InlineIterator(_Iterator, _SingleProcessDataLoaderIter):
    """num_workers=0: torch's _SingleProcessDataLoaderIter."""


class _WorkersIterator(_Iterator, _MultiProcessingDataLoaderIter):
    """num_workers > 0: torch's _MultiProcessingDataLoaderIter."""


# NOTE [ An iterator's workers ]
# ==============================
#
# torch's iterator lists the worker processes it started in `_workers`, by
# worker id, from the moment it is made until it is dropped: after its
# epoch ended, after _shutdown_workers(), whatever other iterators of the
# loader do (upstream's test_get_worker_info reads their pids once the
# epoch is over; test_iterable_style_dataset joins them once the iterator
# is gone).  This one keeps the handles of the processes its epoch started
# on (a persistent iterator: those of its last epoch), taken as the epoch
# starts.  Without persistent workers the loader's own ShmLoader starts new
# workers for each pass, so an iterator whose pass is over is no longer the
# one those workers serve: its _shutdown_workers() leaves them alone, where
# stopping the loader's workers would end another iterator's pass.


class _WorkerProcess:
    """One worker as torch's iterator shows it in `_workers`: pid,
    is_alive(), join(timeout), exitcode, terminate(), kill()."""

    def __init__(self, child):
        self._child = child

    def is_for(self, child) -> bool:
        """Whether this is the handle of that child of the pool."""
        return self._child is child

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def exitcode(self) -> int | None:
        return self._child.exitcode

    def is_alive(self) -> bool:
        return self._child.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._child.exitcode is None:
            wait_all([self._child], float("inf") if timeout is None else timeout)

    def terminate(self) -> None:
        """SIGTERM, as multiprocessing.Process.terminate; nothing once it
        has exited (an unreaped child's pid cannot be reused), nor for a
        thread worker (worker_mode="thread"), which no signal stops.  The
        loader reports the death as any worker's."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, as multiprocessing.Process.kill (see terminate)."""
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self._child.exitcode is None and self._child.pid != os.getpid():
            try:
                os.kill(self._child.pid, sig)
            except ProcessLookupError:
                pass

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else f"exitcode={self.exitcode}"
        return f"<loader worker pid={self.pid} {state}>"
