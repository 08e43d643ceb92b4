"""Batch memory: the batcher's slab allocator.  Main's side, the leases
of the slabs it hands to the user, is compiled (LeaseBook in native/leases.pxi).

See NOTE [ ShmLoader processes and shutdown ] in shared/messages.py for how a
slab travels from the batcher to the user and back, and NOTE [ Direct row
writes ] in shared/table.py for why a retired slab waits for the hazards.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from shmq import sync

MAX_LEASES = 1 << 16
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def ram_bytes() -> int:
    """This machine's memory."""
    return os.sysconf("SC_PHYS_PAGES") * PAGE_BYTES


def slab_bytes(nbytes: int) -> int:
    """What a batch of nbytes takes from the pool: whole pages, since main
    may move pages of a slab the user keeps out of the pool (NOTE [ Kept
    batch memory ] in native/leases.pxi), and they must hold no other slab."""
    return whole_pages(max(nbytes, 1))


def never_fits(cfg, index: int, nbytes: int, capacity: int) -> tuple[MemoryError | None, bool]:
    """(Why the pool of `capacity` bytes can never hold batch `index` of
    nbytes, and whether that holds for the whole run), or (None, False).
    A shuffle buffer fills each worker's window of batches at once: a pool
    of fewer than cfg.slabs_to_progress batches of this size waits for
    ever (a bound per batch: batches of other sizes are judged by theirs)."""
    if nbytes > capacity:
        return MemoryError(
            f"batch {index} needs {nbytes} bytes of slab memory but memory_cap_bytes is "
            f"{capacity}: pass memory_cap_bytes >= {nbytes} (a few batches' worth lets loading "
            f"run ahead), or use smaller batches"), False
    need = nbytes * cfg.slabs_to_progress
    if need > capacity:
        return MemoryError(
            f"shuffle_buffer={cfg.shuffle_buffer} fills {cfg.shuffle_batches} batches at once "
            f"in each of the {cfg.streams} workers: loading needs "
            f"{cfg.slabs_to_progress} batches of {nbytes} bytes in memory ({need} bytes), but "
            f"memory_cap_bytes is {capacity}: pass memory_cap_bytes >= {need}, or a smaller "
            f"shuffle_buffer or batch_size"), True
    return None, False


class Slab(NamedTuple):
    lease: int
    generation: int
    offset: int
    nbytes: int

    @property
    def token(self) -> int:
        """Names this allocation of the lease in hazard words: never 0."""
        return (self.lease << 32) | self.generation


class CopiedSlab(NamedTuple):
    """A batch's slab that main copied into its own memory before handing
    the batch out, so that the pool could reuse the original (NOTE [ Kept
    batch memory ] in native/leases.pxi: batches main holds back)."""
    data: np.ndarray


class SlabAllocator:
    """First-fit allocation of slabs in the shared arena (batcher side).

    Low offsets are preferred, so the pages in use stay few and warm: a
    slab freed by main is reused by the next batch of similar size."""

    def __init__(self, arena: np.ndarray, released: np.ndarray, hazards: np.ndarray,
                 slabs_in_flight: int):
        self.arena, self.released, self.hazards = arena, released, hazards
        self.slabs_in_flight = slabs_in_flight
        self.largest = 0     # largest slab so far
        self.in_use = 0      # bytes of the slabs not free (live or in limbo), for stats()
        self.free = [(0, arena.nbytes)]        # sorted (offset, size)
        self.live: dict[int, Slab] = {}        # lease -> slab, handed out or in use
        self.limbo: list[Slab] = []            # retired while a worker may still write into it
        self.generation = np.zeros(MAX_LEASES, np.int64)
        # lease ids: those given back (reused last in, first out), then the
        # ones never used yet, from next_lease up (not a list of all 65,536
        # ids: 2.3 MB of the batcher's own memory)
        self.free_leases: list[int] = []
        self.next_lease = 0
        self.gave_back = False  # memory freed since reclaim() last said so

    @property
    def capacity(self) -> int:
        return self.arena.nbytes

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self.live.values())

    def allocate(self, nbytes: int) -> Slab | None:
        """A slab of at least nbytes, or None while the arena is full even
        after reclaiming what main released and what no worker still uses."""
        nbytes = slab_bytes(nbytes)
        # Reclaim first, always: reusing the lowest released slab keeps the
        # batch memory on pages already faulted in.  (Reclaiming only when
        # the arena is full walks through fresh pages for epochs.)
        self._reclaim()
        found = self._first_fit(nbytes)
        if found is None:
            return None
        if not self.free_leases and self.next_lease == MAX_LEASES:
            self._give_back(found, nbytes)
            return None
        self.largest = max(self.largest, nbytes)
        self.in_use += nbytes
        if self.free_leases:
            lease = self.free_leases.pop()
        else:
            lease, self.next_lease = self.next_lease, self.next_lease + 1
        self.generation[lease] += 1
        slab = self.live[lease] = Slab(lease, int(self.generation[lease]), found, nbytes)
        return slab

    def fits_now(self, nbytes: int) -> bool:
        """Whether allocate(nbytes) would find a piece at once."""
        return any(size >= slab_bytes(nbytes) for _, size in self.free)

    def fits(self, nbytes: int, freed=()) -> bool:
        """Whether a slab of nbytes fits in one piece once the retired slabs
        and `freed` (slabs about to be given back) are free too: the memory
        soon back, without what main or other batches hold."""
        soon = sorted(self.free + [(s.offset, s.nbytes) for s in (*self.limbo, *freed)])
        end = start = -1
        for off, size in soon:
            if off > end:  # a gap: a new piece starts here
                start = off
            end = max(end, off + size)
            if end - start >= slab_bytes(nbytes):
                return True
        return False

    def _first_fit(self, nbytes):
        for i, (off, size) in enumerate(self.free):
            if size >= nbytes:
                if size == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = (off + nbytes, size - nbytes)
                return off
        return None

    @property
    def warm_target(self) -> int:
        """The arena bytes worth faulting in ahead (NOTE [ Warming the
        arena ] in native/warm.pxi): what the pool keeps in flight, no more, so
        that a loader of tiny batches does not fault in (and hold) hundreds
        of megabytes, nor one of large batches pages it never uses."""
        return min(self.arena.nbytes, self.slabs_in_flight * self.largest)

    def reclaim(self) -> bool:
        """Free every slab main has released, and every retired slab no
        worker's hazard names any more.  True if memory was freed since
        the last call, here or elsewhere (release(), a retired slab, or
        allocate()'s own reclaim): batches waiting for memory try again."""
        self._reclaim()
        freed, self.gave_back = self.gave_back, False
        return freed

    def _reclaim(self) -> None:
        load, released = sync.atomic_load, self.released
        # SYNC POINT: acquire loads; main's release store of the generation
        # (LeaseBook.release) pairs with them: its reads of the slab are over.
        done = [s for s in self.live.values() if load(released, s.lease) == s.generation]
        for s in done:
            self.release(s.lease)
        if self.limbo:
            # SYNC POINT: workers' hazard stores (NOTE [ Direct row writes ]).
            in_use = {load(self.hazards, i) for i in range(len(self.hazards))}
            kept = [s for s in self.limbo if s.token in in_use]
            for s in self.limbo:
                if s.token not in in_use:
                    self._free_lease(s)
            self.limbo = kept

    def release(self, lease: int) -> None:
        self._free_lease(self.live.pop(lease))

    def retire(self, lease: int) -> None:
        """A slab replaced while workers may still be writing into it: it is
        freed once no hazard word names it (see NOTE [ Direct row writes ])."""
        self.limbo.append(self.live.pop(lease))

    def _free_lease(self, slab: Slab) -> None:
        self.gave_back = True
        self.in_use -= slab.nbytes
        self.free_leases.append(slab.lease)
        self._give_back(slab.offset, slab.nbytes)

    def _give_back(self, offset: int, nbytes: int) -> None:
        self.free.append((offset, nbytes))
        self.free.sort()
        merged = [self.free[0]]
        for o, n in self.free[1:]:
            lo, ln = merged[-1]
            if lo + ln == o:
                merged[-1] = (lo, ln + n)
            else:
                merged.append((o, n))
        self.free = merged
