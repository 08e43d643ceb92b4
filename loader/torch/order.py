"""loader.DataLoader's order: a sampler drawn as torch's iterator draws it,
so that the generators the training loop sees move as torch's do (NOTE
[ Drawing the order as torch does ]); and the sampler's epoch a state
records (NOTE [ The sampler's epoch in a state ])."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler


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
# [ Streamed samplers ] in order/feed.py), which is not when torch's
# iterator pulls it.  So TorchOrder pulls it in generator states of its
# own (GeneratorSandbox: each pull swaps the states in and out, a few
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


def epoch_sampler(source):
    """The sampler whose set_epoch decides source's order (source, or the
    sampler of a batch sampler), or None."""
    for s in (source, getattr(source, "sampler", None)):
        if s is not None and callable(getattr(s, "set_epoch", None)) and isinstance(
                getattr(s, "epoch", None), int):
            return s
    return None


class TorchOrder:
    """The sampler (or batch sampler) ShmLoader iterates at each epoch,
    drawing from the generators as torch's iterator would: see NOTE
    [ Drawing the order as torch does ]."""

    def __init__(self, source, index_sampler, generators: list, prefetched: int):
        self.prefetched = prefetched
        self.follow(source, index_sampler, generators)
        self.resuming = False  # the next epoch is a resumed one: no mirror
        self.resume_epoch = None  # its sampler's epoch (NOTE [ The sampler's epoch in a state ])
        self.sampler_epoch = None  # the epoch the current order was drawn with
        self._mirror = None
        self.torch_pulls = 0   # pulls torch's iterator made that no mirror has replayed yet

    def follow(self, source, index_sampler, generators: list) -> None:
        """The samplers as the DataLoader has them now, for the epochs drawn
        from now on: torch's iterator takes them as it starts, so a sampler
        replaced inside a batch sampler (accelerate's set_sampler) orders the
        next epoch (NOTE [ The samplers a pass takes ] in torch/dataloader.py)."""
        self.source, self.index_sampler, self.generators = source, index_sampler, generators
        self.generator = getattr(source, "generator", None)  # ShmLoader's resume records it

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
        and the GeneratorSandbox it is pulled in (None for a resumed
        epoch): see NOTE [ Drawing the order as torch does ]."""
        sampler = epoch_sampler(self.source)
        if self.resuming and self.resume_epoch is not None:
            sampler.set_epoch(self.resume_epoch)
        self.resume_epoch = None
        self.sampler_epoch = None if sampler is None else sampler.epoch
        resuming, self.resuming = self.resuming, False
        self._mirror = None
        self.torch_pulls = self.prefetched  # what torch's iterator takes as it starts
        if _vectorised(self.source):
            return self._draw_vectorised(resuming), None
        if resuming:  # pulled in the generators themselves: no mirror (see the note)
            return iter(self.source), None
        sandbox = GeneratorSandbox(self.generators, self._start_mirror)
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


class GeneratorSandbox:
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
