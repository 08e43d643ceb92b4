"""What main has handed out of an epoch, and the loader's resumable state.

NOTE [ Resuming an epoch ]
==========================

state_dict() says, in a few numbers, which samples of the current epoch
the training loop has received, so that a new loader given the state
yields exactly the rest of that epoch, then the following epochs as an
uninterrupted run would:

- map-style datasets: the epoch's positions (in this rank's order) that
  were delivered, as a prefix length and the few ranges delivered past it
  (in first-ready mode a batch may be delivered before an earlier one):
  O(batches in flight) in size, a few hundred bytes at any dataset size.  Main
  learns a first-ready batch's positions from the tags its writers put in
  the slab (see _layout.Layout).  A resumed epoch is a run over the
  remaining positions: a computed order ships only the prefix and ranges
  (_order.Remaining), a streamed sampler skips what was delivered, an
  order written out is written out again without it; in order, its
  batches are the original ones from the first not delivered.
- iterable datasets: per worker, how many samples of its stream were
  delivered.  A worker fills its batches one after another and main hands
  them out in that order, so what it delivered is always a prefix of its
  stream: on resume each worker reads and drops that many samples first.
  The state only fits a loader with the same number of workers (the
  streams are the workers').
- the order: a seed and an epoch number give it again; a torch.Generator
  (or torch's global generator, which DataLoader's default shuffle draws
  from) has its state recorded as the epoch drew its order, and the
  resumed loader draws the epoch's order from that state.  The workers'
  base seed, which torch draws from the same generator just before the
  order (at each iterator, or once with persistent workers: then in the
  first epoch only), is recorded with it and not drawn again: a state
  taken in the first epoch and one taken later resume alike.
- the state is worker-count independent for map-style datasets: a run
  resumed with more or fewer workers yields the same remaining batches.

What the dataset draws from random generators is the same on resume
only with reproducible=True (seeds per sample); with torch's per-worker
seeding (DataLoader) it depends on how far each worker's generators had
gone, which no loader can restore without pausing its workers.
"""

from __future__ import annotations

import bisect

import numpy as np

class DonePositions:
    """Positions of an epoch delivered: all below `prefix`, and the few
    ranges [a, b) past it (sorted, disjoint, not touching the prefix or
    each other).  In order, batches are delivered one after another and
    only the prefix moves; first-ready, a batch can come before earlier
    ones, so a few ranges stay open until those arrive.  O(batches in
    flight) in size, whatever the epoch's length."""

    __slots__ = ("prefix", "ranges")

    def __init__(self, prefix: int = 0, ranges: list | None = None):
        self.prefix = prefix
        self.ranges: list[list[int]] = [list(r) for r in ranges or ()]

    def mark(self, positions: np.ndarray) -> None:
        if not len(positions):
            return
        p = np.unique(positions)
        breaks = np.flatnonzero(np.diff(p) != 1) + 1
        starts = p[np.concatenate(([0], breaks))]
        stops = p[np.concatenate((breaks - 1, [len(p) - 1]))] + 1
        for a, b in zip(starts.tolist(), stops.tolist()):
            self.add_range(a, b)

    def add_range(self, a: int, b: int) -> None:
        """Positions [a, b) were delivered."""
        if b <= self.prefix:
            return
        a = max(a, self.prefix)
        rs = self.ranges
        i = bisect.bisect_left(rs, [a, a])
        if i > 0 and rs[i - 1][1] >= a:  # joins the range before
            i -= 1
            a = rs[i][0]
        j = i
        while j < len(rs) and rs[j][0] <= b:  # swallows the ranges it reaches
            b = max(b, rs[j][1])
            j += 1
        rs[i:j] = [[a, b]]
        if rs[0][0] <= self.prefix:
            self.prefix = rs.pop(0)[1]

    def state(self) -> tuple[int, list]:
        return self.prefix, [list(r) for r in self.ranges]


class MapProgress:
    """The positions (of the epoch's full order for this rank) handed out.
    remaining: how a resumed run's positions map to the epoch's (it goes
    over the positions not delivered before); None: the identity."""

    def __init__(self, kept: int, done: DonePositions | None = None, remaining=None,
                 batches=None, tags_are_units: bool = False):
        self.kept = kept
        self.done = done if done is not None else DonePositions()
        self.remaining = remaining
        self.batches = batches            # the run's geometry: batch -> positions
        self.tags_are_units = tags_are_units  # a collated batch's tag is its unit

    def mark_batch(self, batch: int) -> None:
        """In order: the run's batch `batch` was handed out."""
        start, stop = self.batches.span(batch)
        if self.remaining is None:
            self.done.add_range(start, stop)  # the common case: one range, no array
            return
        self._mark(np.arange(start, stop))

    def mark_tags(self, tags: np.ndarray) -> None:
        """First-ready: a batch with these row tags was handed out (run
        positions, or the unit when workers claim whole batches)."""
        if self.tags_are_units:
            spans = [self.batches.span(int(u)) for u in tags]
            positions = np.concatenate([np.arange(a, b) for a, b in spans]) if spans else tags[:0]
        else:
            positions = tags
        self._mark(positions)

    def _mark(self, run_positions: np.ndarray) -> None:
        self.done.mark(run_positions if self.remaining is None
                       else self.remaining.original(run_positions))

    def complete(self) -> bool:
        return self.done.prefix >= self.kept

    def run_prefix(self) -> int:
        """Run positions below this are all delivered."""
        if self.remaining is None:
            return self.done.prefix
        return self.remaining.run_position(self.done.prefix)

    def state(self) -> dict:
        prefix, ranges = self.done.state()
        return {"positions": self.kept, "done_prefix": prefix, "done_ranges": ranges}

    @staticmethod
    def done_of(state: dict) -> DonePositions:
        """What a state's "map" says was delivered (format 1 listed the
        positions past the prefix one by one: see main/state.py)."""
        if "done_ranges" in state:
            return DonePositions(state["done_prefix"], state["done_ranges"])
        done = DonePositions(state["done_prefix"])
        done.mark(np.asarray(state["done_extra"], np.int64))
        return done


class StreamProgress:
    """What each worker's stream delivered: its batches handed out, and
    which of its samples (by their number in the stream) they held: all
    below `prefix`, and the few in `extra` past it (a shuffle buffer sends
    samples out of their order).  A batch whose rows are the stream's next
    samples in order just moves the prefix.  With a collate_fn the rows
    are whole batches of `rows` samples."""

    def __init__(self, workers: int, rows: int, resumed: list | None = None):
        self.rows = rows
        resumed = resumed or [{"batches": 0, "prefix": 0, "extra": []}] * workers
        self.batches = [r["batches"] for r in resumed]
        self.prefix = [r["prefix"] for r in resumed]
        self.extra = [set(r["extra"]) for r in resumed]
        self.complete = False  # set when the epoch's iterator ran to its end

    def first_batches(self) -> list[int]:
        """Per worker, the number its next batch has (those delivered before)."""
        return list(self.batches)

    def mark_batch(self, worker: int) -> None:
        """A collated batch (of `rows` samples, in stream order) was handed out."""
        self.batches[worker] += 1
        self.prefix[worker] += self.rows

    def mark_tags(self, worker: int, tags: np.ndarray) -> None:
        """A batch with these samples (numbers in the worker's stream) was
        handed out."""
        self.batches[worker] += 1
        p, n = self.prefix[worker], len(tags)
        if n and not self.extra[worker] and tags[0] == p and tags[-1] == p + n - 1:
            self.prefix[worker] = p + n  # the next samples, in order: the common case
            return
        extra = self.extra[worker]
        extra.update(int(t) for t in tags)
        while p in extra:
            extra.remove(p)
            p += 1
        self.prefix[worker] = p

    def state(self) -> list[dict]:
        return [{"batches": b, "prefix": p, "extra": sorted(e)}
                for b, p, e in zip(self.batches, self.prefix, self.extra)]

    def skips(self) -> np.ndarray:
        """For the workers of a resumed run, as int64s: per worker its
        first batch number, its prefix and its count of extras; then every
        worker's extras."""
        head = []
        for b, p, e in zip(self.batches, self.prefix, self.extra):
            head += [b, p, len(e)]
        tail = [x for e in self.extra for x in sorted(e)]
        return np.asarray(head + tail, np.int64)


def stream_skips(words: np.ndarray, workers: int, worker: int) -> tuple[int, int, set]:
    """What StreamProgress.skips() says of one worker: (its first batch
    number, samples below which are delivered, the delivered ones past)."""
    head = words[:3 * workers].reshape(workers, 3)
    start = 3 * workers + int(head[:worker, 2].sum())
    b, p, n = (int(v) for v in head[worker])
    return b, p, set(int(x) for x in words[start:start + n])
