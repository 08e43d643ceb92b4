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
- multiprocessing_context: workers are always forked (the loader's design:
  see NOTE [ ShmLoader processes and shutdown ]); "spawn" and
  "forkserver" are accepted and fork is used.
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

import itertools
import os
import signal
import warnings
import weakref
from typing import NamedTuple, TypeVar

import torch
import numpy as np
from torch.utils.data import BatchSampler, IterDataPipe, RandomSampler, SequentialSampler
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.dataloader import _DatasetKind

from loader._errors import LoaderTimeout, WorkerError
from loader._frozen_state import FrozenState
from loader._loader import ShmLoader
from loader._procs import wait_all
from loader._trace import check_path
from loader.integrations import accelerate as _accelerate_integration

__all__ = ["DataLoader"]

# HF accelerate rebuilds the DataLoaders it prepares as torch's class: make
# it keep this one (loader/integrations/accelerate.py), whenever it is imported.
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
        self._user_collate_fn = collate_fn
        self._trace = trace        # ShmLoader(trace=...): the loader's own workers' run
        if trace is not None:
            check_path(trace)      # a bad path fails here, as ShmLoader's does
        self._pool = None          # the loader's own ShmLoader: state_dict() is its
        self._pool_user = None     # (weakref) the iterator using it, without persistent workers
        self._extra_pools = weakref.WeakSet()  # ShmLoaders of further live iterators
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
                         collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
                         multiprocessing_context, generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)

    def __getstate__(self):
        # A copy (pickle, deepcopy: Lightning, spawn) gets the arguments, not
        # this process's workers or iterators: it starts its own when iterated.
        state = self.__dict__.copy()
        state.update(_pool=None, _pool_user=None, _extra_pools=None, _iterator=None,
                     _frozen_state=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._extra_pools = weakref.WeakSet()

    @property
    def _shm(self) -> ShmLoader | None:
        return None if self._pool is None else self._pool.shm

    def _shm_loader(self) -> ShmLoader:
        """The ShmLoader that loads for this DataLoader, made at the first
        iteration (torch's attributes may be read until then)."""
        if self._pool is None:
            self._pool = self._new_pool()
        return self._pool.shm

    def _new_pool(self, traced: bool = True) -> _Pool:
        kwargs = {}
        order = None
        custom = self._user_collate_fn not in (None, default_collate, default_convert)
        if self._dataset_kind == _DatasetKind.Iterable:
            kwargs["batch_size"] = self.batch_size
            kwargs["drop_last"] = self.drop_last
        else:
            bs = self.batch_sampler
            if bs is None:  # batch_size=None: one sample at a time, not collated
                kwargs["batch_size"] = None
                kwargs["sampler"] = order = self._order_source(self.sampler)
            elif type(bs) is BatchSampler:  # torch's own: batches are cut from the order
                kwargs["batch_size"] = bs.batch_size
                kwargs["drop_last"] = bs.drop_last
                kwargs["sampler"] = order = self._order_source(bs.sampler)
            else:  # a user's batch sampler: its batches as they come
                kwargs["batch_sampler"] = order = self._order_source(bs)
        workers = self.num_workers
        pipe = _PipeEpochs(self.dataset) if isinstance(self.dataset, IterDataPipe) else None
        shm = ShmLoader(
            self.dataset if pipe is None else pipe, num_workers=workers,
            collate_fn=self.collate_fn if custom else None,
            in_order=self.in_order,
            prefetch=(self.prefetch_factor or 2) * max(workers, 1) if workers else None,
            persistent_workers=self.persistent_workers, worker_init_fn=self.worker_init_fn,
            generator=self.generator, reproducible=False,
            timeout=self.timeout if self.timeout > 0 else None,
            output="keep" if custom else "torch", pin_memory=self.pin_memory,
            trace=self._trace if traced else None, **kwargs)
        shm._torch_rules = True
        return _Pool(shm, order, pipe)

    def _order_source(self, source):
        """What ShmLoader takes as its sampler (or batch sampler): None for
        torch's default sequential order over this dataset (workers compute
        it), else the source, iterated in main at each epoch as torch
        iterates it (NOTE [ Drawing the order as torch does ])."""
        if type(source) is SequentialSampler and source.data_source is self.dataset:
            return None
        prefetched = (self.prefetch_factor or 2) * self.num_workers if self.num_workers else 1
        return _TorchOrder(source, self._index_sampler, self._generators(), prefetched)

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
            if self._iterator is None:
                self._iterator = _Iterator(self, self._own_pool())
            else:
                self._iterator._reset(self)
            return self._iterator
        user = None if self._pool_user is None else self._pool_user()
        if user is None or user.finished:
            it = _Iterator(self, self._own_pool())
            self._pool_user = weakref.ref(it)
            return it
        # another iterator is live: this one has its own workers, as in torch
        pool = self._new_pool(traced=False)  # the trace is of the loader's own workers
        self._extra_pools.add(pool.shm)
        return _Iterator(self, pool, owned=True)

    def _own_pool(self) -> _Pool:
        self._shm_loader()
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
        wrapper that looks ahead: freeze_state() (_frozen_state.py)."""
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
        shm = self._shm_loader()
        sampler_epoch = None
        if isinstance(state, dict) and "sampler_epoch" in state:
            state = dict(state)
            sampler_epoch = state.pop("sampler_epoch")
            if not isinstance(sampler_epoch, int) or isinstance(sampler_epoch, bool):
                raise ValueError(f"load_state_dict: field 'sampler_epoch' is {sampler_epoch!r}, "
                                 f"but it must be an int; load a state from state_dict() of a "
                                 f"loader of the same dataset and arguments")
            if self._pool.order is None or _epoch_sampler(self._pool.order.source) is None:
                raise ValueError("load_state_dict: the state records the epoch of a sampler "
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


class _Pool(NamedTuple):
    """A ShmLoader serving a DataLoader, and the order it ships (None: the
    default sequential order, computed by its workers); pipe: the wrapper
    of an IterDataPipe dataset (NOTE [ IterDataPipes as torch runs them ])."""
    shm: ShmLoader
    order: "_TorchOrder | None"
    pipe: "_PipeEpochs | None" = None


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


# NOTE [ Drawing the order as torch does ]
# ========================================
#
# torch's iterator pulls batches of indices from its sampler lazily: its
# prefetch (prefetch_factor * num_workers batches) when it starts, then one
# for each batch it returns or error it raises (num_workers=0: one at each
# next()).  A sampler draws from its generator as it is pulled:
# RandomSampler draws each permutation at its first index and a trailing
# randperm(n)[:0] only once exhausted; with replacement, 32 indices at a
# time.  So after a break, a next(iter(loader)) peek or an exception, the
# shared generator is where those pulls left it, and every later epoch
# (and base seed) depends on it.
#
# ShmLoader pulls a user's sampler a window ahead of its workers (NOTE
# [ Streamed samplers ] in _sampler_feed.py), which is not when torch's
# iterator pulls it.  So _TorchOrder pulls it in generator states of its
# own (_GeneratorSandbox: each pull swaps the states in and out, a few
# microseconds), which start as the generators are at the epoch's start:
# the indices are those the source gives from there, and the generators
# the loop sees do not move.  The first time a pull draws from any of them,
# a second iterator over the same samplers (the "mirror") starts, in the
# generators themselves, and takes the pulls torch's iterator has taken so
# far (they drew nothing, or this is the first); from then on the
# DataLoader iterator pulls it exactly as torch's would, so the generators
# go through the states torch's go through, at the same moments, whatever
# the loop does.  The mirror's indices are the order again and are
# dropped.  Cost: the sampler is iterated twice (in main, where torch
# iterates it once); nothing when no generator moved (a fixed sampler).
# The sandbox's pulls run ahead of the mirror's, never behind, as LIMIT
# runs `prefetch` (= prefetch_factor * num_workers) batches ahead as
# torch's prefetch does.  What no loader that loads ahead can give: a
# sampler whose indices depend on draws the training loop makes
# meanwhile from the same generator gets the indices it would give
# without those draws (the generators still end where torch's do).  A
# resumed epoch has no sandbox and no mirror: its order is pulled in the
# generators themselves from the recorded states, and leaves them, once it
# ends, as the whole epoch would.
#
# torch's own RandomSampler (without replacement, one pass over its data
# source: DataLoader(shuffle=True)) and SequentialSampler are not iterated
# at all: the order is what RandomSampler.__iter__ draws at its first
# index, in one call (a seed from the default generator when it has no
# generator of its own, then randperm(n, generator)), an int64 array
# written once to the run's order file.  The generators are then exactly
# where torch's first pull leaves them, and the mirror is a _Replay: the
# same BatchSampler code over n placeholders (itertools.repeat), which
# makes the trailing randperm(n)[:0] draw at the pull where torch's
# sampler is exhausted.  No Python int per index, no second permutation.

# NOTE [ The sampler's epoch in a state ]
# =======================================
#
# A DistributedSampler (any sampler with set_epoch) draws its order from
# its seed and the epoch it was last given.  A resumed loader draws the
# epoch's order again when it is iterated, but frameworks do not call
# set_epoch before that: Lightning iterates the loader (setup_data), then
# sets the epoch, so a state of epoch 1 resumed with the sampler still at
# epoch 0 (1/4 of the samples twice, 1/4 never, measured with 2 ranks).
# So a state records the epoch the order was drawn with, and the resumed
# epoch sets it on the sampler before drawing.  Under Lightning every rank
# loads rank 0's state: the positions (one count per rank, in order) and
# the epoch are the same on every rank, and each rank's own sampler draws
# its own shard, so the resume is exact on every rank.

def _vectorised(source) -> bool:
    """Is source one of torch's own samplers whose order is drawn in one
    call: SequentialSampler, or RandomSampler without replacement over its
    data source's length once?"""
    if type(source) is SequentialSampler:
        return True
    return (type(source) is RandomSampler and not source.replacement
            and source.num_samples == len(source.data_source))


class _TrailingDraw:
    """What RandomSampler draws once its permutation is exhausted:
    randperm(n)[:0] of its own generator (nothing anyone sees when it made
    a generator of its own from a seed)."""

    def __init__(self, n: int, generator):
        self.n, self.generator = n, generator

    def draw(self) -> None:
        if self.generator is not None:
            torch.randperm(self.n, generator=self.generator)


class _Replay:
    """A RandomSampler already drawn: its n indices as placeholders (the
    order is held elsewhere), then its trailing draw, pulled as torch pulls
    the real one (NOTE [ Drawing the order as torch does ])."""

    def __init__(self, trailing: _TrailingDraw):
        self.trailing = trailing

    def __len__(self) -> int:
        return self.trailing.n

    def __iter__(self):
        yield from itertools.repeat(0, self.trailing.n)
        self.trailing.draw()


def _replay_of(index_sampler, trailing: _TrailingDraw):
    """The index sampler torch's iterator pulls, over a _Replay of its
    RandomSampler: batched as torch batches it (BatchSampler's own code)."""
    if type(index_sampler) is BatchSampler:
        return BatchSampler(_Replay(trailing), index_sampler.batch_size, index_sampler.drop_last)
    return _Replay(trailing)


def _epoch_sampler(source):
    """The sampler whose set_epoch decides source's order (source, or the
    sampler of a batch sampler), or None."""
    for s in (source, getattr(source, "sampler", None)):
        if s is not None and callable(getattr(s, "set_epoch", None)) and isinstance(
                getattr(s, "epoch", None), int):
            return s
    return None


class _TorchOrder:
    """The sampler (or batch sampler) ShmLoader iterates at each epoch,
    drawing from the generators as torch's iterator would: see NOTE
    [ Drawing the order as torch does ]."""

    def __init__(self, source, index_sampler, generators: list, prefetched: int):
        self.source, self.index_sampler = source, index_sampler
        self.generators, self.prefetched = generators, prefetched
        self.generator = getattr(source, "generator", None)  # ShmLoader's resume records it
        self.resuming = False  # the next epoch is a resumed one: no mirror
        self.resume_epoch = None  # its sampler's epoch (NOTE [ The sampler's epoch in a state ])
        self.sampler_epoch = None  # the epoch the current order was drawn with
        self._mirror = None
        self.torch_pulls = 0   # pulls torch's iterator made that no mirror has replayed yet

    def __len__(self) -> int:
        return len(self.source)

    @property
    def sampler_name(self) -> str:
        """What a state records of the sampler (ShmLoader.state_dict)."""
        return type(self.source).__name__

    def draw(self):
        """The epoch's order, as (indices, what each pull of them runs
        inside): an int64 array (and None) when torch's own sampler types
        are drawn in one vectorised call, else an iterator of the source
        and the _GeneratorSandbox it is pulled in (None for a resumed
        epoch): see NOTE [ Drawing the order as torch does ]."""
        epoch_sampler = _epoch_sampler(self.source)
        if self.resuming and self.resume_epoch is not None:
            epoch_sampler.set_epoch(self.resume_epoch)
        self.resume_epoch = None
        self.sampler_epoch = None if epoch_sampler is None else epoch_sampler.epoch
        resuming, self.resuming = self.resuming, False
        self._mirror = None
        self.torch_pulls = self.prefetched  # what torch's iterator takes as it starts
        if _vectorised(self.source):
            return self._draw_vectorised(resuming), None
        if resuming:  # pulled in the generators themselves: no mirror (see the note)
            return iter(self.source), None
        sandbox = _GeneratorSandbox(self.generators, self._start_mirror)
        with sandbox:
            it = iter(self.source)
        return it, sandbox

    def _start_mirror(self) -> None:
        """Pulling the source drew from a generator: from now on the mirror
        draws in the generators themselves, as torch's iterator would, and
        first takes what that iterator has taken so far (pulls that drew
        nothing, or the first)."""
        self._mirror = iter(self.index_sampler)
        pulls, self.torch_pulls = self.torch_pulls, 0
        self.pull(pulls)

    def _draw_vectorised(self, resuming: bool) -> np.ndarray:
        """torch's RandomSampler or SequentialSampler: the order in one
        call, the generators left where torch's first pull leaves them, and
        a mirror that replays the rest of torch's pulls without the order."""
        source = self.source
        if type(source) is SequentialSampler:
            return np.arange(len(source.data_source), dtype=np.int64)
        n, generator = len(source.data_source), source.generator
        if generator is None:  # as RandomSampler.__iter__ draws it, at its first index
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        order = torch.randperm(n, generator=generator).numpy()
        trailing = _TrailingDraw(n, source.generator)
        if resuming:  # no mirror: the generators as the whole epoch leaves them
            trailing.draw()
            return order
        self._mirror = iter(_replay_of(self.index_sampler, trailing))
        pulls, self.torch_pulls = self.torch_pulls, 0
        self.pull(pulls)
        return order

    def pull(self, n: int = 1) -> None:
        """Take n batches of indices from the mirror, as torch's iterator
        takes them from its sampler (drawing what the sampler draws); with
        no mirror (yet), count them."""
        for _ in range(n):
            if self._mirror is None:
                self.torch_pulls += 1
                continue
            try:
                next(self._mirror)
            except StopIteration:
                self._mirror = None

    def drain(self) -> None:
        """The epoch ended: torch's sampler was exhausted by now."""
        while self._mirror is not None:
            self.pull()


class _GeneratorSandbox:
    """Generator states of their own, for the code run inside `with`: the
    source's pulls in main, a window ahead of the workers, draw from these
    and never from the states the training loop sees, which only the
    mirror moves (NOTE [ Drawing the order as torch does ]).  They start as
    the generators are at the epoch's start.  The first time a pull draws
    from any of them, `on_first_draw` is called (outside the sandbox)."""

    def __init__(self, generators: list, on_first_draw):
        self.generators, self.on_first_draw = generators, on_first_draw
        self.start = [g.get_state() for g in generators]
        self.states = self.start
        self.outside = None

    def __enter__(self):
        gens = self.generators
        self.outside = [g.get_state() for g in gens]
        for g, state in zip(gens, self.states):
            g.set_state(state)
        return self

    def __exit__(self, *exc):
        gens = self.generators
        self.states = [g.get_state() for g in gens]
        for g, state in zip(gens, self.outside):
            g.set_state(state)
        self.outside = None
        if self.on_first_draw is not None and not all(
                torch.equal(a, b) for a, b in zip(self.start, self.states)):
            first_draw, self.on_first_draw = self.on_first_draw, None
            first_draw()


class _Iterator:
    """What iter(DataLoader) returns: torch's iterator protocol (len(),
    the warning for an IterableDataset that yields more than its len, the
    worker processes as `_workers`), pulling the order as torch's iterator
    does (NOTE [ Drawing the order as torch does ]).  It holds no reference
    to the DataLoader, as torch's does not: dropping both frees the
    workers at once."""

    def __init__(self, loader: DataLoader, pool: _Pool, owned: bool = False):
        self._pool, self._owned = pool, owned  # owned: a ShmLoader of this iterator alone
        self._index_sampler = loader._index_sampler
        self._dataset, self._iterable = loader.dataset, loader._dataset_kind == _DatasetKind.Iterable
        self._num_workers = loader.num_workers
        self._batches = None
        self._pipe_group = None
        if pool.pipe is not None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._pipe_group = dist.new_group(backend="gloo")  # as torch's iterator makes
        self._reset(loader)

    def _reset(self, loader: DataLoader) -> None:
        """Start a new epoch (persistent workers: torch's _reset)."""
        if self._batches is not None:
            self._batches.close()
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        if self._pool.pipe is not None:  # drawn before the base seed, as torch draws it
            self._pool.pipe.new_epoch(loader.generator, self._pipe_group)
        self._batches = iter(self._pool.shm)
        if self._num_workers:
            self._batches.start()  # torch's iterator prefetches as it is made
        self._num_yielded = self._calls = 0
        self.finished = False

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    @property
    def _workers(self) -> list:
        """The worker processes, as torch's iterator lists them (pid,
        is_alive(), join(), exitcode)."""
        session = self._pool.shm._session
        children = session.worker_children() if session is not None else []  # (stopped)
        return [_WorkerProcess(c) for c in children]

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


class _WorkerProcess:
    """One worker as torch's iterator shows it in `_workers`: pid,
    is_alive(), join(timeout), exitcode, terminate(), kill()."""

    def __init__(self, child):
        self._child = child

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
