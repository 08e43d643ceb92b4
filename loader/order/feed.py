"""A user's sampler or batch sampler, pulled a bounded window ahead of
the workers.

NOTE [ Streamed samplers ]
==========================

torch's DataLoader pulls its sampler lazily, a prefetch ahead of the
batches it returns; `list(sampler)` up front would make a sampler of a
billion indices cost minutes and gigabytes before the first batch, and
one that never ends hang.  So every ShmLoader(sampler=...) and
ShmLoader(batch_sampler=...) is pulled as the run's LIMIT moves (NOTE
[ Runs ]):

  main: Runs.open_limit(run, yielded) ─► feed the positions (batches) below the
        new LIMIT ─► pwrite their indices into the run's order file (sparse)
        ─► [the sampler ended: settle_run stores the final KEPT, UNITS,
        NBATCHES] ─► store LIMIT (release)
  worker: claims a unit, loads it once below LIMIT (acquire) ─► reads its
          index from the order file, mapped read-only (SharedState.read_order)

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

A sampler whose first index is not an int (keys, tuples: torch hands
them to dataset[...] as they are) is an ORDER_OBJECTS run, fed by an
ObjectFeed: each index is pickled on its own into the order file, a row
of (start, end) per position and the bytes after OBJECT_DATA_AT (both
sparse, both punched out below what the loop received), and a worker
reads the position it claimed with two preads (ObjectOrder).  A run of
ints takes only integers, and keeps a failure of its sampler: NOTE
[ Int indices ] in order/int_indices.py.

loader.DataLoader's samplers and batch samplers stream the same way,
pulled in generator states of their own (NOTE [ Drawing the order as
torch does ] in torch/order.py: each pull runs inside the feed's `pulling`
context); torch's own RandomSampler and SequentialSampler are drawn in
one vectorised call instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import pickle

import numpy as np

from loader.order.int_indices import (BATCH_RULE, SAMPLER_RULE, as_int64, is_plain_int,
                                 not_an_int_error, shown)
from loader.order.indices import OFFSET_BIAS, OPEN_POSITIONS, Batches, kept_of

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


_NONE = object()  # no first index


def int_indices(it) -> tuple[bool, object]:
    """(whether a sampler's indices are ints: its first is, or it yields
    none; an iterator of all its indices, the first included).  `it`: an
    iterator of the sampler (its first index is pulled here).  See NOTE
    [ Int indices ]."""
    first = next(it, _NONE)
    if first is _NONE:
        return True, iter(())
    return is_plain_int(type(first)), itertools.chain([first], it)


class SamplerFeed:
    """Run positions -> dataset indices, pulled from the sampler on
    demand.  `remaining` (a resumed run): run position r is the epoch's
    position remaining.original(r).  `length` None: the sampler has no
    len(), and `kept` is only a bound (an OPEN run) until it ends."""

    batched = False  # (BatchFeed: True)
    row_bytes = 8    # bytes of the order file per run position (an int64 index)

    def __init__(self, it, name: str, length: int | None, kept: int, remaining=None,
                 pulling=None):
        self.it, self.name, self.length = it, name, length
        # every pull of `it` runs inside it: loader.DataLoader's generator
        # sandbox (NOTE [ Drawing the order as torch does ] in torch/order.py)
        self.pulling = contextlib.nullcontext() if pulling is None else pulling
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
        self.failure = None      # what a pull raised: raised again by every later pull
                                 # (NOTE [ Int indices ])

    def attach(self, fd: int) -> None:
        """Workers read the run's order from fd: size it (sparse)."""
        self.fd = fd
        os.ftruncate(fd, 0)  # the previous run's pages go
        os.ftruncate(fd, 8 * self.kept)

    def _take(self, count: int) -> np.ndarray:
        """Up to `count` indices from the sampler, as they are stored; fewer
        when one is not an int index (self.failure says which) or the
        sampler raised (self.failure is what it raised)."""
        got, bad = as_int64(self._values(count))
        if bad is not None:
            self.failure = not_an_int_error(bad, f"the sampler {self.name}",
                                            f"its position {self.pulled + bad.at}", SAMPLER_RULE)
        return got

    def _values(self, count: int) -> list:
        """Up to `count` values from the sampler; if it raises, those before
        (list.extend keeps them), and self.failure is what it raised."""
        values = []
        try:
            with self.pulling:
                values.extend(itertools.islice(self.it, count))
        except Exception as e:
            self.failure = e
        return values

    @staticmethod
    def _joined(parts: list) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _pull(self, count: int) -> np.ndarray:
        """The sampler's next `count` indices (OPEN: fewer once it ends;
        fewer once one failed)."""
        got = self._take(count)
        if self.failure is not None:
            self.pulled += len(got)
            return got
        if len(got) < count and self.open:
            self.exhausted = True
            self.pulled += len(got)
            return got
        if len(got) < count:
            self.failure = ValueError(f"the sampler {self.name} ended after "
                                      f"{self.pulled + len(got)} indices, but its len() is "
                                      f"{self.length}: make len() say how many indices it "
                                      f"yields")
        self.pulled += len(got)
        return got

    def _skip(self, count: int) -> None:
        while count > 0 and not self.exhausted and self.failure is None:
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
            if self.exhausted or self.failure is not None:
                break
            parts.append(self._pull(int(b - a)))
            if self.failure is not None:
                break
        return self._joined(parts)

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

    def feed(self, upto: int, needed: int | None = None) -> None:
        """Run positions below `upto` have their index (in the file), or
        (OPEN) the sampler ended before them, or it failed before them
        (self.failure: raised if the positions below `needed`, default
        upto, are not all fed; NOTE [ Int indices ])."""
        upto = min(upto, self.kept)
        while self.fed < upto and not self.exhausted and self.failure is None:
            stop = min(upto, self.fed + _CHUNK)
            self._store(self._resolve(self.fed, stop))
        self._raise_failure_before(upto if needed is None else min(needed, self.kept))

    def _raise_failure_before(self, needed: int) -> None:
        if self.failure is not None and self.fed < needed:
            raise self.failure.with_traceback(None)

    def whole_batches(self, batches: Batches) -> int:
        """Of the run's batches (geometry `batches`), how many have every
        index fed: those that can load once the feed failed."""
        if self.fed >= batches.kept:
            return batches.count
        return batches.locate(self.fed)[0]

    def _store(self, got: np.ndarray) -> None:
        """The indices of the next run positions (from self.fed)."""
        if self.fd is not None:
            self._write(got)
        else:
            self.window = self._joined([self.window, got])
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
        end = (self.row_bytes * min(pos, self.fed)) // _PUNCH_BYTES * _PUNCH_BYTES
        if end > self.punched:
            _punch(self.fd, self.punched, end)
            self.punched = end

    def _write(self, got: np.ndarray) -> None:
        _pwrite_all(self.fd, got, 8 * self.fed)

    def index(self, pos: int):
        """The dataset index at run position pos, if still known."""
        if not 0 <= pos < self.fed:
            return None
        if self.fd is None:
            return self._item(pos - self.low) if pos >= self.low else None
        if self.row_bytes * pos < self.punched:
            return None
        return self._read(pos)

    def _item(self, i: int):
        return int(self.window[i])

    def _read(self, pos: int):
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
        return self._item(key - self.low)

    def _feed_ahead(self, upto: int) -> None:
        if upto > self.fed:  # a chunk at a time (what is past upto: if the sampler allows)
            self.feed(max(upto, self.fed + _CHUNK), needed=upto)


# An object order's file (ObjectFeed): per run position, the [start, end)
# of its pickle in the data region, two int64 words (end 0: not written),
# for OPEN_POSITIONS positions; the data region after them (both sparse).
_OBJECT_ROW = 16
OBJECT_DATA_AT = _OBJECT_ROW * OPEN_POSITIONS


class ObjectFeed(SamplerFeed):
    """A sampler whose indices are not ints (keys, tuples, lists: torch
    hands them to dataset[...] as they are), streamed as SamplerFeed
    streams ints: each index pickled on its own into the run's order file
    (OBJECT_DATA_AT above), which workers read a position at a time
    (ObjectOrder).  num_workers=0 keeps the window as a list."""

    row_bytes = _OBJECT_ROW

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.window = []
        self.data_end = 0        # bytes of the data region written
        self.data_starts = []    # (first run position, its data offset) of each write
        self.data_punched = 0    # bytes of the data region given back

    def attach(self, fd: int) -> None:
        self.fd = fd
        os.ftruncate(fd, 0)
        os.ftruncate(fd, OBJECT_DATA_AT)

    def _take(self, count: int) -> list:
        return self._values(count)

    @staticmethod
    def _joined(parts: list) -> list:
        return [x for part in parts for x in part]

    def _write(self, got: list) -> None:
        blobs = [pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL) for x in got]
        ends = np.cumsum([len(b) for b in blobs], dtype=np.int64) + self.data_end
        rows = np.empty((len(got), 2), np.int64)
        rows[:, 1] = ends
        rows[:, 0] = ends - [len(b) for b in blobs]
        data = b"".join(blobs)
        done = 0
        while done < len(data):  # the data before the rows that point into it
            done += os.pwrite(self.fd, memoryview(data)[done:],
                              OBJECT_DATA_AT + self.data_end + done)
        _pwrite_all(self.fd, rows.reshape(-1), _OBJECT_ROW * self.fed)
        self.data_starts.append((self.fed, self.data_end))
        self.data_end += len(data)

    def release_below(self, pos: int) -> None:
        if self.fd is None:
            drop = min(pos, self.fed) - self.low
            if drop > 0:
                del self.window[:drop]
                self.low += drop
            return
        super().release_below(pos)  # the rows
        # the data of the writes wholly below pos
        while len(self.data_starts) > 1 and self.data_starts[1][0] <= pos:
            self.data_starts.pop(0)
        data_end = self.data_starts[0][1] // _PUNCH_BYTES * _PUNCH_BYTES if self.data_starts else 0
        if data_end > self.data_punched:
            _punch(self.fd, OBJECT_DATA_AT + self.data_punched, OBJECT_DATA_AT + data_end)
            self.data_punched = data_end

    def _item(self, i: int):
        return self.window[i]

    def _read(self, pos: int):
        order = ObjectOrder(self.fd)
        start, end = order.row(pos)
        if start < self.data_punched:  # delivered, its data given back
            return None
        return order.load(start, end)


class ObjectOrder:
    """A worker's view of an ObjectFeed's file: run position -> the
    sampler's index object (or a list of them, for a slice).  Reads only
    positions below LIMIT, whose rows and data main wrote before storing
    it (NOTE [ Streamed samplers ])."""

    def __init__(self, fd: int):
        self.fd = fd

    def __getitem__(self, key):
        if isinstance(key, slice):
            rows = np.frombuffer(_pread_all(self.fd, _OBJECT_ROW * (key.stop - key.start),
                                            _OBJECT_ROW * key.start), np.int64).reshape(-1, 2)
            if len(rows) == 0:
                return []
            data = _pread_all(self.fd, int(rows[-1, 1] - rows[0, 0]),
                              OBJECT_DATA_AT + int(rows[0, 0]))
            base = int(rows[0, 0])
            return [pickle.loads(data[a - base:b - base]) for a, b in rows.tolist()]
        return self.load(*self.row(key))

    def row(self, pos: int) -> tuple[int, int]:
        """[start, end) of position pos's pickle in the data region."""
        start, end = np.frombuffer(_pread_all(self.fd, _OBJECT_ROW, _OBJECT_ROW * pos), np.int64)
        return int(start), int(end)

    def load(self, start: int, end: int):
        return pickle.loads(_pread_all(self.fd, end - start, OBJECT_DATA_AT + start))


def _pread_all(fd: int, n: int, at: int) -> bytes:
    parts, done = [], 0
    while done < n:
        part = os.pread(fd, n - done, at + done)
        if not part:
            raise OSError(f"the order file ends at byte {at + done}, {n - done} bytes short "
                          f"of a streamed sampler's index (was it written?)")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


_BATCHES_PER_PULL = 1024  # batches pulled from a batch sampler at a time, at most


class BatchFeed(SamplerFeed):
    """A batch sampler, pulled a window of batches ahead of the workers
    (NOTE [ Streamed samplers ]): run positions -> dataset indices as a
    SamplerFeed, and the run's batch offsets, in `offsets` (main) and from
    word OPEN_POSITIONS of the order file (the workers, biased: see
    OFFSET_BIAS in order/indices.py).  Always OPEN: the positions a batch sampler
    covers are known only once it ends, even when it has a len().  A
    resumed run (`remaining`) keeps each batch's positions not delivered,
    and drops the batches left empty, as the run drawn whole did."""

    batched = True

    def __init__(self, it, name: str, kept: int, remaining=None, pulling=None):
        super().__init__(it, name, None, kept, remaining, pulling)
        self.offsets = np.zeros(1024, np.int64)  # run batch k covers [offsets[k], offsets[k + 1])
        self.batches_fed = 0     # run batches whose offsets are known
        self.epoch_batches = 0   # the batch sampler's batches pulled

    def attach(self, fd: int) -> None:
        self.fd = fd
        os.ftruncate(fd, 0)
        os.ftruncate(fd, 8 * (2 * OPEN_POSITIONS + 1))  # positions, then offsets (sparse)
        _pwrite_all(fd, np.asarray([-OFFSET_BIAS], np.int64), 8 * OPEN_POSITIONS)

    def feed(self, upto: int, needed: int | None = None) -> None:
        """num_workers=0 reads positions (__getitem__): their batches first."""
        while self.fed < min(upto, self.kept) and not self.exhausted and self.failure is None:
            self.feed_batches(self.batches_fed + 1)
        self._raise_failure_before(min(upto if needed is None else needed, self.kept))

    def feed_batches(self, upto: int, needed: int | None = None) -> None:
        """Run batches below `upto` have their offsets and indices written,
        or the batch sampler ended or failed before them (self.failure:
        raised if the batches below `needed`, default upto, are not all
        fed; NOTE [ Int indices ])."""
        while self.batches_fed < upto and not self.exhausted and self.failure is None:
            wanted = min(upto - self.batches_fed, _BATCHES_PER_PULL)
            pulled = self._pull_batches(wanted)
            for indices in pulled:
                if self.fed + len(indices) > self.kept or self.batches_fed >= self.kept:
                    self.exhausted = True  # the bound of an OPEN run: its epoch ends here
                    return
                self._take_batch(indices)
            if len(pulled) < wanted and self.failure is None:
                self.exhausted = True
        needed = upto if needed is None else needed
        if self.failure is not None and self.batches_fed < needed and not self.exhausted:
            raise self.failure.with_traceback(None)

    def whole_batches(self, batches: Batches) -> int:
        return self.batches_fed

    def _pull_batches(self, wanted: int) -> list:
        """The indices of up to `wanted` next batches: fewer once the batch
        sampler ends, or before one that fails (self.failure)."""
        pulled, position = [], self.pulled
        try:
            with self.pulling:  # (a batch may be lazy: its indices are pulled here too)
                for batch in itertools.islice(self.it, wanted):
                    indices = self._indices_of(batch, position)
                    if self.failure is not None:
                        break
                    pulled.append(indices)
                    position += len(indices)
        except Exception as e:  # the batch sampler's own error
            self.failure = e
        return pulled

    def _indices_of(self, batch, position: int) -> np.ndarray:
        """A batch's indices as int64, the first at the epoch's `position`
        (one that is not an int index: self.failure says which)."""
        k = self.epoch_batches
        if isinstance(batch, np.ndarray) and batch.ndim == 1 and batch.dtype.kind in "iu":
            values = batch.tolist()  # (a uint64 past int64 is caught as a Python int's)
        else:
            try:
                values = list(batch)
            except TypeError:
                self.failure = TypeError(
                    f"the batch sampler {self.name} yielded {shown(batch)} (a "
                    f"{type(batch).__qualname__}) as its batch {k}, which is not a sequence of "
                    f"indices: {BATCH_RULE}")
                return np.zeros(0, np.int64)
        indices, bad = as_int64(values)
        if bad is not None:
            self.failure = not_an_int_error(
                bad, f"the batch sampler {self.name}",
                f"place {bad.at} of its batch {k} (the epoch's position {position + bad.at})",
                BATCH_RULE)
        else:
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
