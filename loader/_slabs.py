"""Batch memory: the collator's slab allocator and main's leased views.

See NOTE [ ShmLoader processes and shutdown ] in _protocol.py for how a
slab travels from the collator to the user and back.
"""

from __future__ import annotations

import weakref

import numpy as np

import shmq

ALIGN = 64
MAX_LEASES = 1 << 16


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class SlabAllocator:
    """First-fit allocation of slabs in the shared arena (collator side).

    Low offsets are preferred, so the pages in use stay few and warm: a
    slab freed by main is reused by the next batch of similar size."""

    WARM_CHUNK = 32 << 20
    WARM_MIN = 256 << 20

    def __init__(self, arena: np.ndarray, released: np.ndarray, slabs_in_flight: int):
        self.arena = arena
        self.released = released
        self.slabs_in_flight = slabs_in_flight
        self.warm = 0        # arena[:warm] is faulted in
        self.largest = 0     # largest slab so far
        self.free = [(0, arena.nbytes)]        # sorted (offset, size)
        self.live: dict[int, tuple[int, int, int]] = {}  # lease -> (offset, nbytes, generation)
        self.generation = np.zeros(MAX_LEASES, np.int64)
        self.free_leases = list(range(MAX_LEASES - 1, -1, -1))

    @property
    def held_bytes(self) -> int:
        return sum(n for _, n, _ in self.live.values())

    def allocate(self, nbytes: int):
        """(lease, generation, offset) or None when the arena is full even
        after reclaiming what main released."""
        nbytes = align(max(nbytes, 1))
        # Reclaim first, always: reusing the lowest released slab keeps the
        # batch memory on pages already faulted in.  (Reclaiming only when
        # the arena is full walks through fresh pages for epochs.)
        self.reclaim()
        found = self._first_fit(nbytes)
        if found is None or not self.free_leases:
            return None
        self.largest = max(self.largest, nbytes)
        self.warm = max(self.warm, found + nbytes)  # its first copy faults it in
        lease = self.free_leases.pop()
        self.generation[lease] += 1
        gen = int(self.generation[lease])
        self.live[lease] = (found, nbytes, gen)
        return lease, gen, found

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
    def warming(self) -> bool:
        return self.warm < self._warm_target()

    def _warm_target(self) -> int:
        return min(self.arena.nbytes, max(self.WARM_MIN, self.slabs_in_flight * self.largest))

    def warm_up(self) -> None:
        """Fault in the next chunk of the arena (called when the collator is
        idle): fresh shared memory fills at ~1 GB/s, touched memory at
        memory speed, so the first epoch should not pay for the faults."""
        end = min(self._warm_target(), self.warm + self.WARM_CHUNK)
        if end > self.warm:
            shmq.prefault(self.arena[self.warm:end])
            self.warm = end

    def reclaim(self) -> bool:
        """Free every slab whose lease main has released; True if any."""
        done = [lease for lease, (_, _, gen) in self.live.items() if self.released[lease] == gen]
        for lease in done:
            self.release(lease)
        return bool(done)

    def release(self, lease: int) -> None:
        off, nbytes, _ = self.live.pop(lease)
        self.free_leases.append(lease)
        self.free.append((off, nbytes))
        self.free.sort()
        merged = [self.free[0]]
        for o, n in self.free[1:]:
            lo, ln = merged[-1]
            if lo + ln == o:
                merged[-1] = (lo, ln + n)
            else:
                merged.append((o, n))
        self.free = merged


class _Slab(np.ndarray):
    """The uint8 view of one leased slab.  Its own type stops numpy from
    collapsing the .base chain of the batch arrays past it, so every array
    of a batch keeps its slab alive, and the slab's finalizer runs only
    when the last of them is gone."""


def _release(released: np.ndarray, lease: int, generation: int) -> None:
    released[lease] = generation


def lease_slab(arena: np.ndarray, released: np.ndarray, lease: int, generation: int,
               offset: int, nbytes: int) -> _Slab:
    slab = arena[offset:offset + nbytes].view(_Slab)
    weakref.finalize(slab, _release, released, lease, generation)
    return slab
