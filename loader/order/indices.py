"""Which dataset indices a pass over a map-style dataset loads, in which
order, and how its positions fall into batches.  Main and every worker
compute the same thing from the same few numbers (NOTE [ Runs ] in
shared/control.py); only an order main cannot describe that way (a user's
sampler or batch sampler, a torch.Generator's shuffle) is written out for
the workers.

NOTE [ The seeded order ]
=========================

With shuffle=True and no generator, an epoch's order is a seeded bijection
of [0, n) computed per position, never materialised (SeededOrder in
native/permutation.pxi):

  position p of rank r ──► full position q = (r + p * world) mod n
                       ──► index = F(q), F: a 6-round Feistel network over
                           [0, 2**bits) (the least power of two >= n, at
                           least 4), keyed by (seed, epoch), walked again
                           while its output is >= n (cycle-walking)

- every index exactly once per epoch: F is a bijection of [0, 2**bits),
  and cycle-walking restricts it to a bijection of [0, n);
- another order per epoch and per seed: the round keys are a splitmix64
  stream started from (seed, epoch);
- the same order whatever the number of workers, in order or first-ready:
  every process computes F itself, from SIZE, ORDER_SEED and EPOCH;
- distributed=True: rank r takes every world-th position from r, wrapped
  round past n, exactly as torch's DistributedSampler cuts and pads
  (drop_last=False): shards disjoint but for the padding, and equal;
- cost: O(1) to plan an epoch whatever n is, and a few rounds of
  arithmetic per index (docs/benchmarks.md, SCALE), so a worker computes
  each index as it claims it.

The order of a seed differs from the one before state format 2 (numpy's
default_rng([seed, epoch]).permutation(n)), so a state of an epoch in
progress of that format is refused (see main/state.py).

A resumed epoch (NOTE [ Resuming an epoch ] in order/progress.py) runs over the
positions not yet delivered: they are [prefix, kept) less a few ranges, so
Remaining maps a position of the resumed run to the epoch's own by a
search over those ranges, and the run ships only those few numbers.
"""

from __future__ import annotations

import numpy as np

from loader._native import SeededOrder

# How a run's order is described (its ORDER word): computed (RANGE,
# PERMUTATION), or written out by main as int64 indices (ORDER_SHIPPED) or as
# pickled index objects (OBJECTS: a sampler's indices that are not ints,
# which torch passes to dataset[...] as they are; streamed, see NOTE
# [ Streamed samplers ] in order/feed.py)
ORDER_RANGE, ORDER_PERMUTATION, ORDER_SHIPPED, ORDER_OBJECTS = 0, 1, 2, 3

_U64 = (1 << 64) - 1

# An OPEN run's provisional length (a sampler without len(): NOTE [ Streamed
# samplers ]): its order file is sized for this many positions (sparse), and
# an epoch of such a sampler ends here if the sampler has not ended before
OPEN_POSITIONS = 1 << 31


def order_seed_word(seed: int) -> int:
    """The seed as the int64 word of the run block (ORDER_SEED); every
    process reads the network's key material back as its 64 bits."""
    s = seed & _U64
    return s - (1 << 64) if s >= 1 << 63 else s


class Remaining:
    """The positions of an epoch not yet delivered, in order: [prefix,
    kept) less the done ranges (sorted, disjoint, past the prefix).
    Position r of the resumed run is original(r) of the epoch."""

    __slots__ = ("kept", "prefix", "ranges", "starts", "cum", "count")

    def __init__(self, kept: int, prefix: int, ranges: list):
        self.kept, self.prefix, self.ranges = kept, prefix, [(int(a), int(b)) for a, b in ranges]
        # the free segments between the done ranges, and where each starts in the run
        starts = [prefix] + [b for _, b in self.ranges]
        ends = [a for a, _ in self.ranges] + [kept]
        lengths = [e - s for s, e in zip(starts, ends)]
        keep = [i for i, n in enumerate(lengths) if n > 0]
        self.starts = np.asarray([starts[i] for i in keep], np.int64)
        self.cum = np.zeros(len(keep) + 1, np.int64)
        np.cumsum([lengths[i] for i in keep], out=self.cum[1:])
        self.count = int(self.cum[-1])

    def original(self, run_positions: np.ndarray) -> np.ndarray:
        """The epoch's positions of these positions of the resumed run."""
        run_positions = np.asarray(run_positions, np.int64)
        seg = np.searchsorted(self.cum, run_positions, side="right") - 1
        return self.starts[seg] + (run_positions - self.cum[seg])

    def original_one(self, r: int) -> int:
        seg = int(np.searchsorted(self.cum, r, side="right")) - 1
        return int(self.starts[seg]) + r - int(self.cum[seg])

    def run_position(self, p: int) -> int:
        """How many of the remaining positions are below the epoch's p."""
        seg = int(np.searchsorted(self.starts, p, side="right")) - 1
        if seg < 0:
            return 0
        return int(self.cum[seg]) + min(p - int(self.starts[seg]),
                                        int(self.cum[seg + 1] - self.cum[seg]))

    def words(self) -> np.ndarray:
        """As the run's order file holds it, for the workers."""
        flat = [v for ab in self.ranges for v in ab]
        return np.asarray([self.kept, self.prefix, len(self.ranges)] + flat, np.int64)

    @classmethod
    def from_words(cls, words: np.ndarray) -> "Remaining":
        kept, prefix, n = (int(v) for v in words[:3])
        flat = words[3:3 + 2 * n].tolist()
        return cls(kept, prefix, list(zip(flat[0::2], flat[1::2])))


class ComputedOrder:
    """A rank's computed order of an epoch (RANGE or PERMUTATION), `kept`
    positions long, or the part of it a resumed run goes over: position ->
    dataset index by formula (NOTE [ The seeded order ])."""

    __slots__ = ("seeded", "kept", "remaining")

    def __init__(self, seeded: SeededOrder, kept: int, remaining: Remaining | None = None):
        self.seeded, self.kept, self.remaining = seeded, kept, remaining

    def __len__(self) -> int:
        return self.kept

    def index(self, pos: int) -> int:
        if self.remaining is not None:
            pos = self.remaining.original_one(pos)
        return self.seeded.at(pos)

    def take(self, positions: np.ndarray) -> np.ndarray:
        positions = np.ascontiguousarray(positions, np.int64)
        if self.remaining is not None:
            positions = self.remaining.original(positions)
        out = np.empty(len(positions), np.int64)
        self.seeded.take(out, positions)
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.kept)
            if step == 1 and self.remaining is None:
                out = np.empty(max(stop - start, 0), np.int64)
                self.seeded.fill(out, start)
                return out
            return self.take(np.arange(start, stop, step, dtype=np.int64))
        if not 0 <= key < self.kept:
            raise IndexError(f"position {key} of an order of {self.kept}")
        return self.index(int(key))


def computed_order(kind: int, size: int, seed: int, epoch: int, rank: int, world: int,
                   kept: int, remaining: Remaining | None = None) -> ComputedOrder | None:
    """A computed order of `size` dataset indices, this rank's share of it
    (None: 0, 1, 2... of the whole dataset, nothing to compute)."""
    if kind == ORDER_RANGE and world == 1 and remaining is None:
        return None
    seeded = SeededOrder(size, seed & _U64, epoch & _U64, kind == ORDER_PERMUTATION, rank, world)
    return ComputedOrder(seeded, kept if remaining is None else remaining.count, remaining)


def epoch_order(n: int, seed: int, epoch: int, rank: int = 0, world: int = 1) -> np.ndarray:
    """The whole order ShmLoader(shuffle=True, seed=seed) gives rank
    `rank` in `epoch` (1 for the first), written out: for tests and for
    users who want to see it; the loader itself never builds it."""
    order = computed_order(ORDER_PERMUTATION, n, seed, epoch, rank, world, shard_size(n, world))
    return order[0:len(order)]


def index_getter(order):
    """position -> the dataset index (an int, or the sampler's object)."""
    if order is None:
        return lambda pos: pos
    if isinstance(order, np.ndarray):
        return order.item
    if isinstance(order, ComputedOrder):
        return order.seeded.at if order.remaining is None else order.index
    return order.__getitem__


def shard(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This rank's share of an epoch's order written out, as torch's
    DistributedSampler cuts it (drop_last=False): the order is padded by
    repeating its start until every rank gets the same count, then rank r
    takes every world-th index from position r (SeededOrder does the same
    by formula)."""
    if world == 1:
        return indices
    n = len(indices)
    total = -(-n // world) * world
    if total > n:
        reps = -(-(total - n) // max(n, 1))
        indices = np.concatenate([indices] + [indices] * reps)[:total] if n else indices
    return indices[rank:total:world]


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


class OpenBatches(Batches):
    """The batches of an OPEN run as a worker or the batcher sees them:
    `size` at a time up to the run's KEPT, read again at every use (main
    stores the final one once the sampler ends: NOTE [ Runs ])."""

    __slots__ = ("kept_now",)

    def __init__(self, size: int, kept_now):
        self.size, self.offsets, self.kept_now = size, None, kept_now

    @property
    def kept(self) -> int:
        return self.kept_now()

    @property
    def count(self) -> int:
        return -(-self.kept_now() // self.size)


# A streamed batch sampler's run (OFFSETS == OFFSETS_STREAMED): its order file
# holds the positions' indices in words [0, OPEN_POSITIONS) and the batch
# offsets from word OPEN_POSITIONS, each stored as offset - OFFSET_BIAS, so
# that the words not written yet (0) sort after every written one
OFFSETS_STREAMED = 1
OFFSET_BIAS = 1 << 62


class StreamedBatches(Batches):
    """A streamed batch sampler's batches, read from the offsets main
    writes into the order file as it pulls the batch sampler (stored
    biased: see OFFSET_BIAS); kept_now and count_now read the run's KEPT
    and NBATCHES, final once main has settled the run (NOTE [ Runs ])."""

    __slots__ = ("stored", "kept_now", "count_now")

    def __init__(self, stored: np.ndarray, kept_now, count_now):
        self.size, self.offsets = 0, None
        self.stored, self.kept_now, self.count_now = stored, kept_now, count_now

    @property
    def kept(self) -> int:
        return self.kept_now()

    @property
    def count(self) -> int:
        return self.count_now()

    def span(self, batch: int) -> tuple[int, int]:
        return int(self.stored[batch]) + OFFSET_BIAS, int(self.stored[batch + 1]) + OFFSET_BIAS

    def locate(self, slot: int) -> tuple[int, int]:
        batch = int(np.searchsorted(self.stored, slot - OFFSET_BIAS, side="right")) - 1
        return batch, slot - (int(self.stored[batch]) + OFFSET_BIAS)


def kept_of(n: int, batch_size: int, drop_last: bool) -> int:
    """Of n positions, those an epoch delivers (drop_last drops a short batch)."""
    return n // batch_size * batch_size if drop_last else n
