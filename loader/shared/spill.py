"""Messages of any size between the loader's processes.

NOTE [ Spilled messages ]
=========================

The two rings (to_batcher, to_main) have a fixed size, but what a message
carries does not: a row's values can be a 100 MB string, a batch's spec
the values of 1,024 rows, a SampleRow a whole sample.  So the rings carry
only small records.  Anything larger than SPILL_BYTES is written instead
into its sender's region of the spill heap as a *block*, and a Spilled
record (region, pos, nbytes) travels in its place:

  * a whole message (SpillWriter.encoded): its receiver decodes the block
    when it takes the record from the ring, then frees it;
  * a row's values (SpillWriter.values_ref, sent inside a RowValues): the
    batcher does not open the block.  It keeps the record, puts it into
    the batch's spec, and main decodes it once, at receipt of the batch
    (SpillHeap.values).  A batch the batcher drops frees its rows'
    blocks unopened (SpillHeap.free_values).  One copy into the heap, one copy
    out, whatever the size: bytes and str leaves are stored raw (not
    pickled) and come back as a new bytes or str.

  sender (a worker, or the batcher)     its region                        reader
  ──────────────────────────────────     ──────────────────────────────    ──────
  off = allocate(n): free bytes,         [hdr|payload] [hdr|payload] ...
    after freed blocks are reclaimed
  write header (NBYTES, FREED=0) and payload
  ring.put(Spilled(region, off, n)) ───────────────────────────────────►   decode the block
                                          FREED = 1 (release store)   ◄──   (a copy: owned)

Each block has one reader (whoever ends up holding its record) and is
freed by a flag in its own header, so blocks may be freed in any order
(main frees a batch's rows when the batch arrives, the batcher those of
batches it drops).  Only the writer allocates: it keeps the region's live
blocks in the order it wrote them and, before each allocation, reclaims
the oldest ones whose FREED flag is set (a block freed early waits for
the older ones: a batch waiting for a slow row holds back the reuse of
what was written after its rows, as far as the batches in flight go).
Space is found around *runs* of consecutive live blocks, so the writer
never waits for a reader:

  * the next block follows the newest one while that stays within the
    *window* (RETAIN_BYTES, or twice the bytes live with it, if more), so
    a steady stream reuses the same warm pages;
  * past the window it wraps to offset 0, if the oldest blocks have left
    room there;
  * else it goes after the newest block, or after every live block:
    the region is as large as RAM, so only memory bounds a message.

Pages a rare huge message touched beyond the window go back to the system
once nothing live lies beyond it.  The heap is one sparse memfd: only pages
written are memory.  And since a region may grow as large as RAM, each
process maps of a region only as far as it has used it, growing the mapping
(a new, larger one; views of the old one stay valid, the same pages) when a
block lies past it: the loader's address space is what it uses, not
regions x RAM, so it starts under `ulimit -v` and with hundreds of workers
on a machine of any size.

FIRST and LAST (the oldest live block and the newest one) and each
header's NEXT (the block written after it) live in shared memory so that
a worker started again under the same id (persistent_workers=False)
continues its predecessor's log, whose blocks the reader may not have
taken yet.  (A worker that dies instead stops the loader, heap and all:
a block it wrote but never sent cannot hold a region back for long.)

Threads (worker_mode="thread") need none of this: their rings pass
objects by reference.
"""

from __future__ import annotations

import os
import pickle
import resource
from collections import deque
from typing import NamedTuple

import numpy as np

import shmq
from shmq import sync
from loader.shared.passable import shared_array
from shmq.codec import encode

from loader.shared.class_identity import forked_class_reduce
from loader._native import arena_array
from loader.batcher.slabs import ram_bytes, whole_pages

SPILL_BYTES = 64 << 10     # larger encodings go through the heap, not the ring
RETAIN_BYTES = 64 << 20    # the least of a region kept faulted in and reused
MAP_STEP_BYTES = 64 << 20  # the least of a region a process maps, when it first uses it
_ALIGN = 64
# A block's header, in int64 words at its start (one cache line: the reader
# writes FREED there once).
NBYTES, FREED, NEXT = 0, 1, 2
_HEADER_BYTES = 64
# A region's words: its oldest live block and its newest (-1: none).
FIRST, LAST = 0, 1
_REGION_WORDS = 16
# Kinds of raw leaves in a values block.
_BYTES, _STR = 0, 1


class Spilled(NamedTuple):
    """A message, or a row's values, in its sender's region of the spill heap."""
    region: int
    pos: int       # the block's offset in its region
    nbytes: int


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


class SpillHeap:
    """`regions` logs of up to `region_bytes` each (default: as much as RAM)
    in one sparse memfd, made before the fork (every child inherits it;
    nothing has a name).  Each process maps a region only as far as it
    uses it (see the NOTE)."""

    def __init__(self, regions: int, region_bytes: int | None = None, passable: bool = False):
        self.region_bytes = whole_pages(region_bytes or ram_bytes())
        self.regions = regions
        self.fd = os.memfd_create("shmloader-spill", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, regions * self.region_bytes)
            # passable: start_method="spawn" (NOTE [ Starting clean ] in shared/passable.py)
            self.words = shared_array(regions * _REGION_WORDS, np.int64, passable)
        except BaseException:
            os.close(self.fd)
            raise
        self.words[:] = -1
        self.maps: dict[int, np.ndarray] = {}  # region -> its mapped start, in this process

    def __getstate__(self):
        # Sent to a spawned process (NOTE [ Starting clean ]): it maps the
        # regions it uses itself, from the descriptor, as a forked one does.
        return {**self.__dict__, "maps": {}}

    def close(self) -> None:
        """No mapping is made after this (those made stay valid)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def allocated_bytes(self) -> int:
        """The memory the heap holds now (the memfd's allocated pages)."""
        return os.fstat(self.fd).st_blocks * 512

    def word(self, region: int, name: int) -> int:
        """The index in self.words of a region's word."""
        return region * _REGION_WORDS + name

    def span(self, region: int, start: int, stop: int) -> np.ndarray:
        """Bytes start..stop of a region (a view: valid as long as it lives)."""
        mapped = self.maps.get(region)
        if mapped is None or len(mapped) < stop:
            mapped = self._map(region, stop)
        return mapped[start:stop]

    def _map(self, region: int, stop: int) -> np.ndarray:
        """A new mapping of the region's first bytes, at least stop of them:
        twice what is needed, so a growing log maps again a few times only."""
        if not 0 <= region < self.regions or stop > self.region_bytes:
            raise IndexError(f"bytes ..{stop} of spill region {region} "
                             f"({self.regions} of {self.region_bytes} bytes)")
        size = min(self.region_bytes, whole_pages(max(MAP_STEP_BYTES, 2 * stop)))
        try:
            mapped = arena_array(self.fd, size, region * self.region_bytes)
        except MemoryError as e:
            raise MemoryError(f"cannot map {size} bytes of the loader's spill heap for a message "
                              f"of up to {stop} bytes ({e.args[-1]}): {address_space_limits()}")
        self.maps[region] = mapped
        return mapped

    def header(self, region: int, pos: int) -> np.ndarray:
        """The int64 words of the header of the block at pos."""
        return self.span(region, pos, pos + _HEADER_BYTES).view(np.int64)

    def block(self, ref: Spilled) -> np.ndarray:
        return self.span(ref.region, ref.pos, ref.pos + ref.nbytes)

    def free(self, ref: Spilled) -> None:
        """The block is read: its writer may reuse it."""
        # SYNC POINT: release store; the writer's acquire load of FREED
        # (SpillWriter._reclaim) pairs with it.
        sync.atomic_store(self.header(ref.region, ref.pos), FREED, 1)

    def receive(self, msg):
        """msg itself, or the message a Spilled record stands for (its block
        decoded into owned objects, then freed)."""
        if type(msg) is not Spilled:
            return msg
        try:
            return _decode(self.block(msg))[0]
        finally:
            self.free(msg)

    def free_values(self, ref) -> None:
        """A row's values that will not be opened: their block, if any, is freed."""
        if type(ref) is Spilled:
            self.free(ref)

    def values(self, ref) -> list:
        """A row's values: ref itself (a list), or the values its block holds,
        decoded (owned), the block then freed."""
        if type(ref) is not Spilled:
            return ref
        try:
            values, raw = _decode(self.block(ref))
            for i, leaf in raw:
                values[i] = leaf
            return values
        finally:
            self.free(ref)


class SpillWriter:
    """One sending process's side of its region (see NOTE [ Spilled messages ])."""

    def __init__(self, heap: SpillHeap, region: int):
        self.heap, self.region_id = heap, region
        self.r = heap.region_bytes
        self.blocks: deque = deque()  # (pos, nbytes) of live blocks, oldest first
        self.runs: deque = deque()    # [start, end] of runs of consecutive blocks, oldest first
        self.live = self.live_peak = 0
        self.touched = 0              # the highest offset this process may have faulted in
        # after a predecessor's blocks, if any
        pos, last = self._word(FIRST), self._word(LAST)
        while pos >= 0:
            header = heap.header(region, pos)
            self._track(pos, int(header[NBYTES]))
            if pos == last:
                break
            pos = int(header[NEXT])
        self.touched = max((end for _, end in self.runs), default=0)

    def _word(self, name: int) -> int:
        return sync.atomic_load(self.heap.words, self.heap.word(self.region_id, name))

    def put(self, ring, msg, timeout=None) -> None:
        """Send msg through ring (a shmq.Queue), spilled if its encoding is
        large; raises as ring.put does."""
        ring.put_encoded(*self.encoded(msg), timeout)

    def encoded(self, msg) -> tuple[bytes, list]:
        """What to put into the ring for msg, encoded (Queue.put_encoded):
        msg itself when it is small, else a Spilled record of it, its block
        written into the region."""
        pickled, buffers = encode(msg, reduce=forked_class_reduce)
        size = len(pickled) + sum(b.raw().nbytes for b in buffers)
        if size <= SPILL_BYTES:
            return pickled, buffers
        return encode(self._write(pickled, [b.raw() for b in buffers], []))

    def values_ref(self, values: list):
        """A row's values as a RowValues carries them: the list itself when
        its bytes and str leaves are small, else a Spilled record of a block
        holding them (bytes and str raw, the rest pickled)."""
        raw = [(i, v) for i, v in enumerate(values) if type(v) is bytes or type(v) is str]
        if sum(len(v) for _, v in raw) <= SPILL_BYTES:
            return values  # (other large leaves spill with the whole message)
        rest = list(values)
        for i, _ in raw:
            rest[i] = None
        pickled, buffers = encode(rest, reduce=forked_class_reduce)
        return self._write(pickled, [b.raw() for b in buffers], raw)

    def _write(self, pickled: bytes, views: list, raw: list) -> Spilled:
        """A block of: a header of sizes and offsets, the pickle, its
        out-of-band buffers, and raw leaves [(index in the values, bytes
        or str)]."""
        raw = [(i, _STR, v.encode("utf-8", "surrogatepass")) if type(v) is str else (i, _BYTES, v)
               for i, v in raw]
        header = np.empty(3 + 2 * len(views) + 4 * len(raw), np.int64)
        sizes = [len(pickled)] + [v.nbytes for v in views] + [len(data) for _, _, data in raw]
        offsets, end = [], _align(_HEADER_BYTES + header.nbytes)
        for n in sizes:
            offsets.append(end)
            end = _align(end + n)
        header[:3] = len(pickled), len(views), len(raw)
        k = 3 + 2 * len(views)
        header[3:k:2], header[4:k:2] = offsets[1:1 + len(views)], sizes[1:1 + len(views)]
        for j, (i, kind, data) in enumerate(raw):
            header[k + 4 * j:k + 4 * j + 4] = offsets[1 + len(views) + j], len(data), i, kind
        pos = self._allocate(end)
        block = self.heap.span(self.region_id, pos, pos + end)
        block[_HEADER_BYTES:_HEADER_BYTES + header.nbytes] = header.view(np.uint8)
        for off, n, data in zip(offsets, sizes, [pickled] + views + [data for _, _, data in raw]):
            block[off:off + n] = np.frombuffer(data, np.uint8)
        return Spilled(self.region_id, pos, end)

    def _allocate(self, n: int) -> int:
        """The offset of a new block of n bytes, its header written (see the
        NOTE for where it goes)."""
        if n > self.r:
            raise MemoryError(f"a message of {n} bytes between the loader's processes is larger "
                              f"than this machine's memory ({self.r} bytes)")
        self._reclaim()
        window = max(RETAIN_BYTES, 2 * (self.live + n))
        if not self.runs:
            pos = 0
        else:
            newest = self.runs[-1][1]
            if newest + n <= window and self._fits(newest, n):
                pos = newest
            elif self._fits(0, n):
                pos = 0
            elif self._fits(newest, n):
                pos = newest
            else:
                pos = max(end for _, end in self.runs)
                if pos + n > self.r:
                    raise MemoryError(
                        f"messages of {self.live} bytes sent to another of the loader's processes "
                        f"are not taken yet, and {n} more do not fit in this machine's memory "
                        f"({self.r} bytes); the receiving process is stuck or the batches are "
                        f"too large")
        heap = self.heap
        header = heap.header(self.region_id, pos)
        header[NBYTES], header[FREED], header[NEXT] = n, 0, -1
        if self.blocks:
            heap.header(self.region_id, self.blocks[-1][0])[NEXT] = pos
        self._track(pos, n)
        sync.atomic_store(heap.words, heap.word(self.region_id, LAST), pos)
        if len(self.blocks) == 1:
            sync.atomic_store(heap.words, heap.word(self.region_id, FIRST), pos)
        self.touched = max(self.touched, pos + n)
        if pos == 0:
            self._give_back_beyond(window)
        return pos

    def _track(self, pos: int, n: int) -> None:
        self.blocks.append((pos, n))
        if self.runs and self.runs[-1][1] == pos:
            self.runs[-1][1] = pos + n
        else:
            self.runs.append([pos, pos + n])
        self.live += n
        self.live_peak = max(self.live_peak, self.live)

    def _fits(self, pos: int, n: int) -> bool:
        return pos + n <= self.r and all(end <= pos or start >= pos + n
                                         for start, end in self.runs)

    def _reclaim(self) -> None:
        """Forget the oldest blocks whose reader has freed them."""
        heap, region, moved = self.heap, self.region_id, False
        # SYNC POINT: acquire load; the reader's release store of FREED
        # (SpillHeap.free) pairs with it: the block's bytes are read.
        while self.blocks and sync.atomic_load(heap.header(region, self.blocks[0][0]), FREED):
            _, n = self.blocks.popleft()
            self.live -= n
            run = self.runs[0]
            run[0] += n
            if run[0] == run[1]:
                self.runs.popleft()
            moved = True
        if moved:
            first = self.blocks[0][0] if self.blocks else -1
            sync.atomic_store(heap.words, heap.word(region, FIRST), first)

    def _give_back_beyond(self, window: int) -> None:
        """Pages past the window that a rare huge message touched go back to
        the system, once nothing live lies there."""
        top = max(window, max((end for _, end in self.runs), default=0))
        if self.touched > top:
            start = whole_pages(top)
            if start < self.touched:
                sync.discard_pages(self.heap.span(self.region_id, start, self.touched))
            self.touched = top


def _decode(block: np.ndarray):
    """(the pickled object, [(index, raw leaf)]) of a block."""
    counts = block[_HEADER_BYTES:_HEADER_BYTES + 24].view(np.int64)
    pickle_bytes, nbuf, nraw = int(counts[0]), int(counts[1]), int(counts[2])
    words = 3 + 2 * nbuf + 4 * nraw
    header = block[_HEADER_BYTES:_HEADER_BYTES + 8 * words].view(np.int64)
    start = _align(_HEADER_BYTES + 8 * words)
    stream = block[start:start + pickle_bytes]
    k = 3 + 2 * nbuf
    # Out-of-band buffers (arrays) are copied out: the block is freed next.
    buffers = [bytearray(block[int(off):int(off) + int(n)])
               for off, n in zip(header[3:k:2], header[4:k:2])]
    raw = []
    for j in range(nraw):
        off, n, i, kind = (int(x) for x in header[k + 4 * j:k + 4 * j + 4])
        data = block[off:off + n]
        raw.append((i, data.tobytes() if kind == _BYTES else
                    str(memoryview(data), "utf-8", "surrogatepass")))
    return pickle.loads(memoryview(stream), buffers=buffers), raw


def address_space_limits() -> str:
    """What bounds this process's mappings, in words (an mmap's ENOMEM does
    not say whether it was the address space, the mapping count or memory)."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    said = ["`ulimit -v` (RLIMIT_AS) is " + ("unlimited" if soft == resource.RLIM_INFINITY
                                            else f"{soft} bytes")]
    for name in ("max_map_count", "overcommit_memory"):
        try:
            with open(f"/proc/sys/vm/{name}") as f:
                said.append(f"vm.{name} is {f.read().strip()}")
        except OSError:
            pass
    return "; ".join(said)
