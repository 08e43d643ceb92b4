"""Which dataset indices a pass over a map-style dataset loads, in which
order, and how its positions fall into batches.  Main and every worker
compute the same thing from the same few numbers (NOTE [ Runs ] in
_control.py); only an order main cannot describe that way (a user's
sampler or batch sampler, a torch.Generator's shuffle, a resumed pass) is
written out for the workers.
"""

from __future__ import annotations

import numpy as np

# How a run's order is described (its ORDER word): computed (RANGE,
# PERMUTATION), or written out by main as int64 indices (SHIPPED) or as
# pickled index objects (OBJECTS: a sampler's indices that are not ints,
# which torch passes to dataset[...] as they are)
ORDER_RANGE, ORDER_PERMUTATION, ORDER_SHIPPED, ORDER_OBJECTS = 0, 1, 2, 3


def index_getter(order):
    """position -> the dataset index (an int, or the sampler's object)."""
    if order is None:
        return lambda pos: pos
    if isinstance(order, np.ndarray):
        return order.item
    return order.__getitem__


def permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of an epoch: the same in every process."""
    return np.random.default_rng([seed, epoch]).permutation(size)


def shard(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This rank's share of an epoch's order, as torch's DistributedSampler
    cuts it (drop_last=False): the order is padded by repeating its start
    until every rank gets the same count, then rank r takes every
    world-th index from position r."""
    if world == 1:
        return indices
    n = len(indices)
    total = -(-n // world) * world
    if total > n:
        reps = -(-(total - n) // max(n, 1))
        indices = np.concatenate([indices] + [indices] * reps)[:total] if n else indices
    return indices[rank:total:world]


def full_order(kind: int, size: int, seed: int, epoch: int) -> np.ndarray | None:
    """The order of all `size` dataset indices (None: 0, 1, 2...)."""
    if kind == ORDER_PERMUTATION:
        return permutation(size, seed, epoch)
    return None


def rank_order(kind: int, size: int, seed: int, epoch: int, rank: int, world: int):
    """This rank's order (None: 0, 1, 2... of the whole dataset)."""
    order = full_order(kind, size, seed, epoch)
    if world == 1:
        return order
    return shard(np.arange(size) if order is None else order, rank, world)


def shard_size(size: int, world: int) -> int:
    return -(-size // world) if world > 1 else size


class Batches:
    """How a run's positions (in first-ready mode: its arrival slots) fall
    into batches: `size` at a time (the last one shorter), or at a batch
    sampler's offsets (batch k covers [offsets[k], offsets[k + 1]))."""

    __slots__ = ("kept", "size", "offsets", "count")

    def __init__(self, kept: int, size: int, offsets: np.ndarray | None = None):
        self.kept, self.size, self.offsets = kept, size, offsets
        self.count = len(offsets) - 1 if offsets is not None else -(-kept // size)

    def span(self, batch: int) -> tuple[int, int]:
        if self.offsets is not None:
            return int(self.offsets[batch]), int(self.offsets[batch + 1])
        start = batch * self.size
        return start, min(start + self.size, self.kept)

    def rows(self, batch: int) -> int:
        start, stop = self.span(batch)
        return stop - start

    def locate(self, slot: int) -> tuple[int, int]:
        """(batch, row) of a position or slot."""
        if self.offsets is not None:
            batch = int(np.searchsorted(self.offsets, slot, side="right")) - 1
            return batch, slot - int(self.offsets[batch])
        return divmod(slot, self.size)


def kept_of(n: int, batch_size: int, drop_last: bool) -> int:
    """Of n positions, those an epoch delivers (drop_last drops a short batch)."""
    return n // batch_size * batch_size if drop_last else n
