"""Messages of any size between the loader's processes.

NOTE [ Spilled messages ]
=========================

The two rings (to_collator, to_main) have a fixed size, but what a message
carries does not: a row's values can be a 100 MB string, a batch's spec
the values of 1,024 rows, a SampleRow a whole sample.  So the rings carry
only small records.  A message whose encoding is larger than SPILL_BYTES
is written instead into its sender's region of the spill heap, and a
Spilled record (region, pos, nbytes) travels through the ring in its place.

  sender (worker i, or the collator)        its region: a log of R bytes      receiver
  ──────────────────────────────────        ──────────────────────────────    ────────
  pos = allocate(n)  (TAIL: what is free)   [ ... live blocks ... ]
  write the encoding at pos % R
  HEAD = pos + n  (store)
  ring.put(Spilled(i, pos, n)) ─────────────────────────────────────────────► get(): decode the block
                                                                               (a copy: owned),
                                            TAIL = pos + n (release store) ◄── then free it

Each region has one writer (its sender) and one reader (the process the
sender's ring leads to), and a reader takes a sender's records in the
order they were sent (a ring keeps each producer's order), so a region is
a byte log: positions only grow, and TAIL says that every block before it
is free.  A block never wraps: one that would cross the end of the region
starts the next lap.  When the log is empty (TAIL == HEAD) the next block
starts the next lap, at offset 0, so the same pages are reused warm.  (A
log kept busy by batches in flight rarely empties and writes on fresh
pages: see the W13 row of docs/benchmarks.md.  Wrapping while blocks are
live would need the writer to wait for the reader: not done yet.)

Sizes: R is the machine's RAM, so a message is bounded by memory alone;
the heap is mapped with no reservation, and only pages written are memory.
When the log is empty, a region keeps RETAIN_BYTES (or twice the next
block, if larger) faulted in; pages a rare huge message touched beyond
that go back to the system.

HEAD and LAP (where the log last started afresh: everything before it is
free) live in shared memory so that a worker started again under the same
id (persistent_workers=False) continues the log after its predecessor's
blocks, which the reader may not have taken yet.

Threads (worker_mode="thread") need none of this: their rings pass
objects by reference.
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

import numpy as np

import shmq
from shmq.codec import encode

from loader._layout import forked_class_reduce
from loader._slabs import ram_bytes, whole_pages

SPILL_BYTES = 64 << 10     # larger encodings go through the heap, not the ring
RETAIN_BYTES = 64 << 20    # pages a region keeps faulted in between laps
_ALIGN = 64
HEAD, LAP, TAIL = 0, 1, 8  # words of a region's header (the reader's on its own cache line)
_HEADER_WORDS = 16


class Spilled(NamedTuple):
    """A message that travels in its sender's region of the spill heap."""
    region: int
    pos: int
    nbytes: int


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


class SpillHeap:
    """`regions` logs of `region_bytes` each in anonymous shared memory, made
    before the fork (every child inherits them; nothing has a name)."""

    def __init__(self, regions: int, region_bytes: int | None = None):
        self.region_bytes = whole_pages(region_bytes or ram_bytes())
        self.regions = regions
        self.data = shmq.shared_array(regions * self.region_bytes, np.uint8)
        self.words = shmq.shared_array(regions * _HEADER_WORDS, np.int64)

    def region(self, i: int) -> np.ndarray:
        return self.data[i * self.region_bytes:(i + 1) * self.region_bytes]

    def head(self, i: int) -> int:
        return shmq.atomic_load(self.words, i * _HEADER_WORDS + HEAD)

    def tail(self, i: int) -> int:
        return shmq.atomic_load(self.words, i * _HEADER_WORDS + TAIL)

    def receive(self, msg):
        """msg itself, or the message a Spilled record stands for (its block
        decoded into owned objects, then freed)."""
        if type(msg) is not Spilled:
            return msg
        start = msg.pos % self.region_bytes
        block = self.region(msg.region)[start:start + msg.nbytes]
        try:
            return _decode(block)
        finally:
            # SYNC POINT: release store; the sender's acquire load of TAIL
            # (SpillWriter.put) pairs with it: the block's bytes are read.
            shmq.atomic_store(self.words, msg.region * _HEADER_WORDS + TAIL, msg.pos + msg.nbytes)


class SpillWriter:
    """One sending process's side of its region (see NOTE [ Spilled messages ])."""

    def __init__(self, heap: SpillHeap, region: int):
        self.heap, self.region_id = heap, region
        self.region = heap.region(region)
        self.r = heap.region_bytes
        # after a predecessor's blocks, if any
        self.head = heap.head(region)
        self.lap = shmq.atomic_load(heap.words, region * _HEADER_WORDS + LAP)
        self.touched = 0                # the highest offset this process wrote

    def put(self, ring, msg, timeout=None) -> None:
        """Send msg through ring (a shmq.Queue), spilled if its encoding is
        large; raises as ring.put does."""
        ring.put_encoded(*self.encoded(msg), timeout)

    def encoded(self, msg) -> tuple[bytes, list]:
        """What to put into the ring for msg, encoded (Queue.put_encoded):
        msg itself when it is small, else a Spilled record of it, its block
        written into the region.  Once spilled, the record must be sent:
        the reader frees blocks in the order they were written."""
        pickled, buffers = encode(msg, reduce=forked_class_reduce)
        size = len(pickled) + sum(b.raw().nbytes for b in buffers)
        if size <= SPILL_BYTES:
            return pickled, buffers
        return encode(self._spill(pickled, [b.raw() for b in buffers]))

    def _spill(self, pickled: bytes, views: list) -> Spilled:
        header = np.empty(2 + 2 * len(views), np.int64)
        offsets, end = [], _align(header.nbytes + len(pickled))
        for v in views:
            offsets.append(end)
            end = _align(end + v.nbytes)
        header[0], header[1] = len(pickled), len(views)
        header[2::2], header[3::2] = offsets, [v.nbytes for v in views]
        pos = self._allocate(end)
        block = self.region[pos % self.r:pos % self.r + end]
        block[:header.nbytes] = header.view(np.uint8)
        block[header.nbytes:header.nbytes + len(pickled)] = np.frombuffer(pickled, np.uint8)
        for off, v in zip(offsets, views):
            block[off:off + v.nbytes] = np.frombuffer(v, np.uint8)
        self.head = pos + end
        shmq.atomic_store(self.heap.words, self.region_id * _HEADER_WORDS + HEAD, self.head)
        return Spilled(self.region_id, pos, end)

    def _allocate(self, n: int) -> int:
        """The position of a block of n bytes after the live ones."""
        r, head = self.r, self.head
        # SYNC POINT: acquire load; the reader's release store of TAIL
        # (SpillHeap.receive) pairs with it.
        tail = max(self.heap.tail(self.region_id), self.lap)
        if n > r:
            raise MemoryError(f"a message of {n} bytes between the loader's processes is larger "
                              f"than this machine's memory ({r} bytes)")
        lap = -(-head // r) * r   # the next lap's start (head itself, on a lap boundary)
        if tail >= head:  # empty: start a lap, on the pages used before
            pos = self.lap = lap
            shmq.atomic_store(self.heap.words, self.region_id * _HEADER_WORDS + LAP, pos)
            # kept faulted in: RETAIN_BYTES, or twice this block if larger
            self._give_back_beyond(max(RETAIN_BYTES, 2 * n))
        else:
            pos = head if head % r + n <= r else lap
            if pos + n - tail > r:
                raise MemoryError(
                    f"messages of {head - tail} bytes sent to another of the loader's processes "
                    f"are not taken yet, and {n} more do not fit in this machine's memory "
                    f"({r} bytes); the receiving process is stuck or the batches are too large")
        self.touched = max(self.touched, pos % r + n)
        return pos

    def _give_back_beyond(self, window: int) -> None:
        """The log is empty: pages past the window (a rare huge message's)
        go back to the system."""
        if self.touched > window:
            shmq.discard_pages(self.region[window:self.touched])
            self.touched = window


def _decode(block: np.ndarray):
    head = block[:16].view(np.int64)
    pickle_bytes, nbuf = int(head[0]), int(head[1])
    header = block[:16 * (1 + nbuf)].view(np.int64)
    start = header.nbytes
    stream = block[start:start + pickle_bytes]
    # Out-of-band buffers (arrays) are copied out: the block is freed next.
    buffers = [bytearray(block[int(off):int(off) + int(n)])
               for off, n in zip(header[2::2], header[3::2])]
    return pickle.loads(memoryview(stream), buffers=buffers)
