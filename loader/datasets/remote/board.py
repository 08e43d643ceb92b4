"""The board: what a remote dataset's processes share (NOTE [ Remote data ]).

One memfd, made by the dataset in main before the loader forks (the workers
inherit its mapping) and passed to the fetcher at its start.  Nothing has a
name.  Laid out as

    header    int64 words: the fetcher's state, the counters of stats(), the
              two slots' descriptors; two bells (int32 pairs)
    errors    ERROR_RECORDS records: an error's kind, HTTP status and text
    slots     SLOTS of them, each the objects of one listing as an epoch uses
              it: digest[n][32] and ext[n][16] (the cache's file name),
              size[n] int64, left[n] int64 (a remote ParquetDataset: the rows
              of the object this rank's epoch still reads; 0 otherwise),
              state[n] int32

A listing is put into the next slot, in turn, as each epoch starts: the
next epoch's slot is filled while this one's is still read (and a second
live iterator's too).  A slot's region is sparse and mapped by each process
only as far as it uses it.

An object's state word: its STATUS (ABSENT, COMPLETE, FAILED, with the
error's record in ERROR_SHIFT's bits), and two flags the workers set:
WANTED (a worker waits for it: fetch it next) and TRAINED (a worker opened
it this epoch: it may be unpinned).  Every change is an atomic update, then
a bell: ARRIVED (the fetcher: an object's status changed), WORK (a worker:
a flag was set; main: a message was sent).
"""

from __future__ import annotations

import os

import numpy as np

from shmq import sync
from loader._native import Bell, arena_array

MAGIC = 0x53484D51_52454D31   # "SHMQREM1"
HEADER_WORDS = 512
ERROR_RECORDS, ERROR_BYTES = 64, 2048
HEADER_BYTES = 256 << 10      # the words, then the error records (64 KiB cut the
                              # records from the 31st on: the fetcher died of the 31st error)
SLOTS = 4                      # listings in use at once: a run's, the next's, and a spare pair
SLOT_SPAN = 1 << 36            # file offsets per slot: sparse, mapped as used
DIGEST, EXT = 32, 16
PER_OBJECT = DIGEST + EXT + 8 + 8 + 4

# header words (int64)
(W_MAGIC, W_STATE, W_PARKED, W_FETCHED, W_FETCHED_BYTES, W_HITS, W_EVICTED, W_ERRORS,
 W_LISTINGS, W_WAIT_NS, W_NEXT_ERROR, W_LIMIT, W_ASKED) = range(13)
W_SLOTS = 32                   # per slot: GEN, COUNT (SLOTS of them)
W_HISTOGRAM, HISTOGRAM = 96, 32  # objects this job trained k times, k = 1..31 (31: or more)
W_BELLS = 64                   # int32 words from here (as int64 index): ARRIVED, WORK
# fetcher states
STARTING, RUNNING, FAILED, STOPPED = 0, 1, 2, 3
# object state
ABSENT, COMPLETE, FAILED_OBJECT = 0, 1, 2
STATUS_MASK = 3
WANTED, TRAINED = 4, 8
ERROR_SHIFT = 8


class Board:
    """One process's view of a board (see the module docstring)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.header = arena_array(fd, HEADER_BYTES)
        self.words = self.header[:HEADER_WORDS * 8].view(np.int64)
        bells = self.header[W_BELLS * 8:W_BELLS * 8 + 32].view(np.int32)
        self.arrived, self.work = Doorbell(bells, 0), Doorbell(bells, 4)
        self._maps: dict[int, np.ndarray] = {}

    @classmethod
    def create(cls) -> "Board":
        fd = os.memfd_create("shmloader-board", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, HEADER_BYTES + SLOTS * SLOT_SPAN)
            board = cls(fd)
        except BaseException:
            os.close(fd)
            raise
        board.words[W_MAGIC] = MAGIC
        board.words[W_SLOTS:W_SLOTS + 2 * SLOTS] = [-1, 0] * SLOTS
        return board

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # --- counters -------------------------------------------------------------------------

    def get(self, word: int) -> int:
        return sync.atomic_load(self.words, word)

    def set(self, word: int, value: int) -> None:
        sync.atomic_store(self.words, word, value)

    def add(self, word: int, n: int = 1) -> None:
        sync.atomic_add(self.words, word, n)

    # --- slots ----------------------------------------------------------------------------

    def slot(self, s: int) -> "Slot":
        """Slot s as it is described now."""
        gen, count = self.get(W_SLOTS + 2 * s), self.get(W_SLOTS + 2 * s + 1)
        return Slot(self, s, gen, count)

    def fill(self, s: int, gen: int, digests: np.ndarray, exts: np.ndarray, sizes: np.ndarray,
             state: np.ndarray) -> "Slot":
        """The fetcher puts a listing into slot s (not read by anyone now:
        its epoch is two runs back)."""
        n = len(sizes)
        self.set(W_SLOTS + 2 * s, -1)  # (gen last: a reader of a half-filled slot sees -1)
        self.set(W_SLOTS + 2 * s + 1, n)
        slot = Slot(self, s, gen, n)
        slot.digests[:] = digests
        slot.exts[:] = exts
        slot.sizes[:] = sizes
        slot.left[:] = 0
        slot.state[:] = state
        self.set(W_SLOTS + 2 * s, gen)
        return slot

    def region(self, s: int, nbytes: int) -> np.ndarray:
        """The first nbytes of slot s's region (mapped again, larger, when
        a slot outgrows this process's mapping; old views stay valid)."""
        mapped = self._maps.get(s)
        if mapped is None or len(mapped) < nbytes:
            size = max(1 << 20, 2 * nbytes)
            mapped = arena_array(self.fd, min(size, SLOT_SPAN), HEADER_BYTES + s * SLOT_SPAN)
            self._maps[s] = mapped
        return mapped[:nbytes]

    # --- errors ---------------------------------------------------------------------------

    def record_error(self, kind: str, status: int | None, url: str, text: str) -> int:
        """Store an error; its record's number (records are reused in turn)."""
        k = self.add_and_get(W_NEXT_ERROR) % ERROR_RECORDS
        start = HEADER_WORDS * 8 + k * ERROR_BYTES
        body = f"{kind}\0{-1 if status is None else status}\0{url}\0{text}".encode(
            "utf-8", "surrogatepass")[:ERROR_BYTES - 8]
        rec = self.header[start:start + ERROR_BYTES]
        rec[8:8 + len(body)] = np.frombuffer(body, np.uint8)
        rec[:8] = np.frombuffer(np.int64(len(body)).tobytes(), np.uint8)
        return k

    def error(self, k: int) -> tuple[str, int | None, str, str]:
        start = HEADER_WORDS * 8 + k * ERROR_BYTES
        rec = self.header[start:start + ERROR_BYTES]
        n = int(rec[:8].view(np.int64)[0])
        kind, status, url, text = bytes(rec[8:8 + n]).decode("utf-8", "surrogatepass").split(
            "\0", 3)
        return kind, (None if status == "-1" else int(status)), url, text

    def add_and_get(self, word: int) -> int:
        return sync.atomic_add(self.words, word, 1)


class Slot:
    """The objects of one listing in a slot of the board."""

    def __init__(self, board: Board, s: int, gen: int, count: int):
        self.board, self.index, self.gen, self.count = board, s, gen, count
        region = board.region(s, PER_OBJECT * count)
        at = 0
        self.digests = region[at:at + DIGEST * count].reshape(count, DIGEST)
        at += DIGEST * count
        self.exts = region[at:at + EXT * count].reshape(count, EXT)
        at += EXT * count
        self.sizes = region[at:at + 8 * count].view(np.int64)
        at += 8 * count
        self.left = region[at:at + 8 * count].view(np.int64)
        at += 8 * count
        self.state = region[at:at + 4 * count].view(np.int32)

    def status(self, i: int) -> int:
        return sync.atomic_load(self.state, i)

    def mark(self, i: int, flags: int) -> int:
        """Set flags on object i (atomic); its state before."""
        while True:
            old = sync.atomic_load(self.state, i)
            if old & flags == flags or sync.atomic_cas(self.state, i, old, old | flags):
                return old

    def settle(self, i: int, status: int, error: int = 0) -> None:
        """The fetcher: object i's status (its flags kept)."""
        while True:
            old = sync.atomic_load(self.state, i)
            new = (old & (WANTED | TRAINED)) | status | (error << ERROR_SHIFT)
            if sync.atomic_cas(self.state, i, old, new):
                return

    def read_rows(self, i: int, rows: int) -> bool:
        """A worker read rows of object i: whether they were the last this
        rank's epoch reads of it (atomic; then it may be marked TRAINED)."""
        return sync.atomic_add(self.left, i, -rows) == rows

    def name(self, i: int) -> str:
        """The object's file name in the cache (cache.object_name)."""
        return bytes(self.digests[i]).hex() + bytes(self.exts[i]).rstrip(b"\0").decode()


class Doorbell:
    """A bell that says "something changed": ring() counts every change
    (a word of its own, before the eventcount's ring), so a watcher that
    was busy between two waits still sees a ring it was not asleep for."""

    def __init__(self, words: np.ndarray, index: int):
        self.words, self.index = words, index      # words[index]: the changes
        self.bell = Bell(words, index + 1)          # words[index + 1, + 2]: seq, sleepers

    def changes(self) -> int:
        return sync.atomic_load(self.words, self.index)

    def ring(self) -> None:
        sync.atomic_add(self.words, self.index, 1)
        self.bell.ring()

    def wait(self, ready, timeout: float) -> bool:
        """Sleep until ready() holds, a ring, or timeout seconds."""
        return self.bell.wait(ready, timeout)

    def wait_change(self, seen: int, timeout: float) -> bool:
        """Sleep until the changes differ from seen (or timeout)."""
        return self.bell.wait(lambda: self.changes() != seen, timeout)
