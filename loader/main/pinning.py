"""pin_memory=True: batches in page-locked memory, without a copy.

PyTorch's DataLoader copies every batch into pinned memory in a thread of
the main process.  Here the slabs themselves are registered with CUDA
(cudaHostRegister), so a batch is already pinned where the workers wrote
it and `.cuda(non_blocking=True)` is a DMA from the slab.  The arena is
registered in chunks, as batches first use them: slabs are reused at low
offsets, so only the memory in flight gets locked, not the whole arena.
Without CUDA, pinning does nothing (torch warns; so does ShmLoader).
"""

from __future__ import annotations


import numpy as np

from loader.shared.optional import imported_torch

CHUNK_BYTES = 32 << 20


def cuda_available() -> bool:
    torch = imported_torch()
    return torch is not None and torch.cuda.is_available()


class PinnedChunks:
    """The chunks of an arena registered with CUDA (main process only)."""

    def __init__(self, address: int, nbytes: int):
        import torch

        self.cudart = torch.cuda.cudart()
        self.base, self.nbytes = address, nbytes
        self.registered: list[int] = []
        self.done = np.zeros(-(-self.nbytes // CHUNK_BYTES), bool)

    def pin(self, offset: int, nbytes: int) -> None:
        """Make sure [offset, offset + nbytes) of the arena is registered."""
        first, last = offset // CHUNK_BYTES, (offset + nbytes - 1) // CHUNK_BYTES
        if self.done[first:last + 1].all():
            return
        for c in range(first, last + 1):
            if self.done[c]:
                continue
            start = c * CHUNK_BYTES
            size = min(CHUNK_BYTES, self.nbytes - start)
            rc = self.cudart.cudaHostRegister(self.base + start, size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"ShmLoader(pin_memory=True): cudaHostRegister of {size} bytes "
                                   f"failed with CUDA error {int(rc)}; check `ulimit -l` (locked "
                                   f"memory), or pass pin_memory=False")
            self.done[c] = True
            self.registered.append(start)

    def close(self) -> None:
        """Unregister every chunk (before the arena's pages are given back)."""
        for start in self.registered:
            self.cudart.cudaHostUnregister(self.base + start)
        self.registered = []
        self.done[:] = False
