"""The collator's half of NOTE [ Warming the arena ] (in _warm.pxi): a
background thread that faults the batch arena in, in bulk, ahead of the
slab allocator, so that a new loader's first epochs do not pay a page
fault per 4 KiB inside the workers' copies."""

from __future__ import annotations

import threading

from loader._native import populate

CHUNK_BYTES = 8 << 20  # one madvise call: a few ms, so stop() is prompt
STOP_WAIT_S = 5.0       # stop() waits at most this for the chunk in progress


class ArenaWarmer:
    """Populates arena[:target] in chunks, from the low offsets up (the
    allocator's first fit hands out low offsets first), in a daemon thread
    started by the first want().  The target only grows; populating never
    changes a byte, so it may overlap slabs being written."""

    def __init__(self, arena):
        self.arena = arena
        self.done = 0        # arena[:done] is populated (in this process's mapping)
        self.target = 0
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = None

    def want(self, target: int) -> None:
        """Have arena[:target] populated (the collator calls it as slabs are
        taken: cheap when the target did not grow)."""
        if target <= self.target or self.stopped:
            return
        with self.cond:
            self.target = min(target, self.arena.nbytes)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="ShmLoader arena warm-up",
                                               daemon=True)
                self.thread.start()
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                # bounded waits: a lost notify costs a second, never a hang
                while not self.stopped and self.done >= self.target:
                    self.cond.wait(1.0)
                if self.stopped:
                    return
                lo, hi = self.done, min(self.target, self.done + CHUNK_BYTES)
            populate(self.arena[lo:hi])  # without the GIL: the collator's loop goes on
            with self.cond:
                self.done = hi
                self.cond.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until the target is populated, at most timeout seconds."""
        with self.cond:
            return self.cond.wait_for(lambda: self.done >= self.target or self.stopped, timeout)

    def stop(self) -> None:
        """End the thread (after the chunk in progress)."""
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(STOP_WAIT_S)
