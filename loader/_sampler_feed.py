"""A user's sampler or batch sampler, pulled a bounded window ahead of
the workers.

NOTE [ Streamed samplers ]
==========================

torch's DataLoader pulls its sampler lazily, a prefetch ahead of the
batches it returns; `list(sampler)` up front would make a sampler of a
billion indices cost minutes and gigabytes before the first batch, and
one that never ends hang.  So a ShmLoader(sampler=...) whose first index
is an int, and any ShmLoader(batch_sampler=...), is pulled as the run's
LIMIT moves (NOTE [ Runs ]):

  main: Runs.open_limit(run, yielded) ─► feed the positions (batches) below the
        new LIMIT ─► pwrite their indices into the run's order file (sparse)
        ─► [the sampler ended: settle_run stores the final KEPT, UNITS,
        NBATCHES] ─► store LIMIT (release)
  worker: claims a unit, loads it once below LIMIT (acquire) ─► reads its
          index from the order file, mapped read-only (_shared.read_order)

- A sampler with a len(): the run's length is len(sampler) from the start
  (one that ends early is a ValueError naming both counts).
- A sampler without len() (finite or not) or a batch sampler: the run is
  OPEN.  Its length is a provisional bound (OPEN_POSITIONS, 2**31
  positions; the order file is sized for it, sparse) until the sampler
  ends; main learns the end when a pull comes back short and stores the
  final length before any LIMIT past the last full batch.  LIMIT never
  passes the end, so a worker never loads a position by a provisional
  length: it reads KEPT again for a batch's rows (OpenBatches,
  StreamedBatches), and one that claimed a unit past the end wakes on the
  limit bell and finds it past UNITS.  The batcher lays out no batch past
  LIMIT for such a run (the next may be the short last one).  The epoch
  ends after the sampler's last index (the last batch short unless
  drop_last), len(loader) is a TypeError as torch's, and steps(n) takes n
  batches of a sampler that never ends (the epoch's iterator stays
  suspended between calls).  A sampler still going at OPEN_POSITIONS
  positions ends its epoch there; the next epoch iterates it again.
- A batch sampler: each batch's end offset goes into the file from word
  OPEN_POSITIONS, stored minus 2**62 so that words not written yet (0) sort
  after every written one and a worker's binary search (locate) stays in
  the written part; main keeps its own copy (8 bytes per batch).

The file's pages of indices below what the training loop has received are
punched out (fallocate PUNCH_HOLE), so the memory in use is the window
ahead whatever the sampler's length (a batch sampler's offsets stay: 8
bytes per batch).  A resumed epoch pulls the sampler again from its start
and skips the positions already delivered (_order.Remaining), as torch
would have to; a batch sampler's batches keep their positions not
delivered, and batches left empty are dropped.  With num_workers=0 the
feed keeps the window in a private array instead.

Still drawn whole at each epoch: a sampler whose indices are not ints
(ORDER_OBJECTS: pickled for the workers, read whole by each), and
loader.DataLoader's samplers, which are drawn as torch draws them (NOTE
[ Drawing the order as torch does ] in _torch.py): torch's own
RandomSampler and SequentialSampler in one vectorised call, any other one
by iterating it.
"""

from __future__ import annotations

import ctypes
import itertools
import os

import numpy as np

from loader._order import OFFSET_BIAS, OPEN_POSITIONS, Batches, kept_of

_CHUNK = 1 << 16        # indices pulled from the sampler per np.fromiter call
_PUNCH_BYTES = 1 << 20  # punch holes in steps of this much (fewer syscalls)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)


def _punch(fd: int, start: int, stop: int) -> None:
    """Give the pages of bytes [start, stop) of fd back (they read as 0)."""
    rc = _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                         ctypes.c_long(start), ctypes.c_long(stop - start))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot free the pages of a streamed sampler's order file: "
                           f"{os.strerror(err)}")


def _pwrite_all(fd: int, words: np.ndarray, at: int) -> None:
    data = memoryview(np.ascontiguousarray(words, np.int64)).cast("B")
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], at + done)


def sampler_length(sampler) -> int | None:
    """len(sampler), or None when it has no len() (an OPEN run)."""
    try:
        return len(sampler)
    except TypeError:
        return None


def streamable(sampler) -> tuple[bool, object]:
    """(True, an iterator of the sampler's indices) if it can be streamed:
    its first index is an int (or it yields none); else (False, an
    iterator of all its indices, the first included)."""
    it = iter(sampler)
    first = next(it, None)
    if first is None:
        return True, iter(())
    if not isinstance(first, (int, np.integer)) or isinstance(first, bool):
        return False, itertools.chain([first], it)
    return True, itertools.chain([first], it)


class SamplerFeed:
    """Run positions -> dataset indices, pulled from the sampler on
    demand.  `remaining` (a resumed run): run position r is the epoch's
    position remaining.original(r).  `length` None: the sampler has no
    len(), and `kept` is only a bound (an OPEN run) until it ends."""

    batched = False  # (BatchFeed: True)

    def __init__(self, it, name: str, length: int | None, kept: int, remaining=None):
        self.it, self.name, self.length = it, name, length
        self.kept, self.remaining = kept, remaining
        self.open = length is None
        self.exhausted = False   # OPEN: the sampler ended (or reached `kept`)
        self.settled = False     # OPEN: main took the run's final length (end())
        self.pulled = 0          # sampler indices consumed (the epoch's positions)
        self.fed = 0             # run positions resolved
        self.fd = None           # the run's order file (workers), or None (num_workers=0)
        self.punched = 0         # bytes of the file given back
        self.window = np.zeros(0, np.int64)  # num_workers=0: run positions [low, fed)
        self.low = 0

    def attach(self, fd: int) -> None:
        """Workers read the run's order from fd: size it (sparse)."""
        self.fd = fd
        os.ftruncate(fd, 0)  # the previous run's pages go
        os.ftruncate(fd, 8 * self.kept)

    def _pull(self, count: int) -> np.ndarray:
        """The sampler's next `count` indices (OPEN: fewer once it ends)."""
        try:
            got = np.fromiter(itertools.islice(self.it, count), np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"the sampler {self.name} yielded an index that is not an int "
                            f"near its position {self.pulled} ({e}): a sampler whose first index "
                            f"is an int is streamed, and must yield ints throughout (make it "
                            f"yield int indices, or non-int ones from its first)") from None
        if len(got) < count and self.open:
            self.exhausted = True
            self.pulled += len(got)
            return got
        if len(got) < count:
            raise ValueError(f"the sampler {self.name} ended after {self.pulled + len(got)} "
                             f"indices, but its len() is {self.length}: make len() say how many "
                             f"indices it yields")
        self.pulled += count
        return got

    def _skip(self, count: int) -> None:
        while count > 0 and not self.exhausted:
            step = min(count, _CHUNK)
            self._pull(step)
            count -= step

    def _resolve(self, start: int, stop: int) -> np.ndarray:
        """The indices of run positions [start, stop) (start == self.fed);
        OPEN: those of the first of them only, once the sampler ends."""
        if self.remaining is None:
            return self._pull(stop - start)
        originals = self.remaining.original(np.arange(start, stop, dtype=np.int64))
        parts = []
        breaks = np.flatnonzero(np.diff(originals) != 1) + 1
        for a, b in zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [len(originals)]))):
            self._skip(int(originals[a]) - self.pulled)
            if self.exhausted:
                break
            parts.append(self._pull(int(b - a)))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def end(self, batch_size: int | None, drop_last: bool) -> tuple[int, int] | None:
        """OPEN, once the sampler ended: (the epoch's positions delivered,
        the run's), as a sized sampler of that length would have them
        (drop_last drops a short last batch); else None."""
        if not (self.open and self.exhausted):
            return None
        epoch_kept = self.pulled if batch_size is None else kept_of(self.pulled, batch_size,
                                                                    drop_last)
        if self.remaining is None:
            return epoch_kept, min(epoch_kept, self.kept)
        return epoch_kept, self.remaining.run_position(epoch_kept)

    def feed(self, upto: int) -> None:
        """Run positions below `upto` have their index (in the file), or
        (OPEN) the sampler ended before them."""
        upto = min(upto, self.kept)
        while self.fed < upto and not self.exhausted:
            stop = min(upto, self.fed + _CHUNK)
            self._store(self._resolve(self.fed, stop))

    def _store(self, got: np.ndarray) -> None:
        """The indices of the next run positions (from self.fed)."""
        if self.fd is not None:
            _pwrite_all(self.fd, got, 8 * self.fed)
        else:
            self.window = np.concatenate([self.window, got])
        self.fed += len(got)
        if self.open and self.fed >= self.kept and not self.batched:
            self.exhausted = True  # the bound of an OPEN run: its epoch ends here

    def release_below(self, pos: int) -> None:
        """Run positions below pos are delivered: their indices are not
        read again (num_workers=0: nor kept)."""
        if self.fd is None:
            drop = min(pos, self.fed) - self.low
            if drop > 0:
                self.window = self.window[drop:].copy()
                self.low += drop
            return
        end = (8 * min(pos, self.fed)) // _PUNCH_BYTES * _PUNCH_BYTES
        if end > self.punched:
            _punch(self.fd, self.punched, end)
            self.punched = end

    def index(self, pos: int) -> int | None:
        """The dataset index at run position pos, if still known."""
        if not 0 <= pos < self.fed:
            return None
        if self.fd is None:
            return int(self.window[pos - self.low]) if pos >= self.low else None
        if 8 * pos < self.punched:
            return None
        return int.from_bytes(os.pread(self.fd, 8, 8 * pos), "little", signed=True)

    def __getitem__(self, key):
        """num_workers=0: an index, or a slice of them (fed on demand)."""
        if isinstance(key, slice):  # positions are read in increasing order: drop the past
            self.release_below(key.start)
            self._feed_ahead(key.stop)
            return self.window[key.start - self.low:key.stop - self.low]
        if key - self.low >= 2 * _CHUNK:
            self.release_below(key)
        self._feed_ahead(key + 1)
        return int(self.window[key - self.low])

    def _feed_ahead(self, upto: int) -> None:
        if upto > self.fed:  # a chunk at a time: one np.fromiter call per chunk
            self.feed(max(upto, self.fed + _CHUNK))


_BATCHES_PER_PULL = 1024  # batches pulled from a batch sampler at a time, at most


class BatchFeed(SamplerFeed):
    """A batch sampler, pulled a window of batches ahead of the workers
    (NOTE [ Streamed samplers ]): run positions -> dataset indices as a
    SamplerFeed, and the run's batch offsets, in `offsets` (main) and from
    word OPEN_POSITIONS of the order file (the workers, biased: see
    OFFSET_BIAS in _order.py).  Always OPEN: the positions a batch sampler
    covers are known only once it ends, even when it has a len().  A
    resumed run (`remaining`) keeps each batch's positions not delivered,
    and drops the batches left empty, as the run drawn whole did."""

    batched = True

    def __init__(self, it, name: str, kept: int, remaining=None):
        super().__init__(it, name, None, kept, remaining)
        self.offsets = np.zeros(1024, np.int64)  # run batch k covers [offsets[k], offsets[k + 1])
        self.batches_fed = 0     # run batches whose offsets are known
        self.epoch_batches = 0   # the batch sampler's batches pulled

    def attach(self, fd: int) -> None:
        self.fd = fd
        os.ftruncate(fd, 0)
        os.ftruncate(fd, 8 * (2 * OPEN_POSITIONS + 1))  # positions, then offsets (sparse)
        _pwrite_all(fd, np.asarray([-OFFSET_BIAS], np.int64), 8 * OPEN_POSITIONS)

    def feed(self, upto: int) -> None:
        """num_workers=0 reads positions (__getitem__): their batches first."""
        while self.fed < min(upto, self.kept) and not self.exhausted:
            self.feed_batches(self.batches_fed + 1)

    def feed_batches(self, upto: int) -> None:
        """Run batches below `upto` have their offsets and indices written,
        or the batch sampler ended before them."""
        while self.batches_fed < upto and not self.exhausted:
            wanted = min(upto - self.batches_fed, _BATCHES_PER_PULL)
            pulled = list(itertools.islice(self.it, wanted))
            for batch in pulled:
                indices = self._indices_of(batch)
                if self.fed + len(indices) > self.kept or self.batches_fed >= self.kept:
                    self.exhausted = True  # the bound of an OPEN run: its epoch ends here
                    return
                self._take_batch(indices)
            if len(pulled) < wanted:
                self.exhausted = True

    def _indices_of(self, batch) -> np.ndarray:
        try:
            indices = np.fromiter(batch, np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"the batch sampler {self.name} yielded, as its batch "
                            f"{self.epoch_batches}, something that is not a sequence of int "
                            f"indices ({e}): a batch sampler must yield lists of ints") from None
        self.epoch_batches += 1
        return indices

    def _take_batch(self, indices: np.ndarray) -> None:
        """The batch sampler's next batch: the run's next batch (a resumed
        run: its positions not yet delivered, if any)."""
        start = self.pulled
        self.pulled += len(indices)
        if self.remaining is not None:
            first = self.remaining.run_position(start)
            last = self.remaining.run_position(self.pulled)
            if last == first:
                return  # delivered whole before the state was taken
            kept = self.remaining.original(np.arange(first, last, dtype=np.int64)) - start
            indices = indices[kept]
        if self.batches_fed + 2 > len(self.offsets):
            self.offsets = np.concatenate([self.offsets, np.zeros(len(self.offsets), np.int64)])
        self._store(indices)
        self.batches_fed += 1
        self.offsets[self.batches_fed] = self.fed
        if self.fd is not None:
            _pwrite_all(self.fd, np.asarray([self.fed - OFFSET_BIAS], np.int64),
                        8 * (OPEN_POSITIONS + self.batches_fed))

    def end(self, batch_size, drop_last) -> tuple[int, int] | None:
        """Once the batch sampler ended: (the epoch's positions, the run's)."""
        if not self.exhausted:
            return None
        return self.pulled, self.fed

    def batches(self) -> Batches:
        """The run's batches as main sees them while it is pulled."""
        return FedBatches(self)


class FedBatches(Batches):
    """Main's view of a BatchFeed's batches so far (Batches' interface)."""

    __slots__ = ("feed",)

    def __init__(self, feed: BatchFeed):
        self.size, self.offsets, self.feed = 0, None, feed

    @property
    def kept(self) -> int:
        return self.feed.kept

    @property
    def count(self) -> int:
        return self.feed.kept  # a bound, until the run is settled

    def span(self, batch: int) -> tuple[int, int]:
        return int(self.feed.offsets[batch]), int(self.feed.offsets[batch + 1])

    def locate(self, slot: int) -> tuple[int, int]:
        offsets = self.feed.offsets[:self.feed.batches_fed + 1]
        batch = int(np.searchsorted(offsets, slot, side="right")) - 1
        return batch, slot - int(offsets[batch])
