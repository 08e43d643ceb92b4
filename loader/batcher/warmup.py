"""The batcher's half of NOTE [ Warming the arena ] (in native/warm.pxi): a
background thread that allocates the batch arena's pages ahead of the
slab allocator, so that a new loader's first epochs do not pay for fresh
memory inside the workers' copies."""

from __future__ import annotations

import os
import threading

CHUNK_BYTES = 8 << 20  # one fallocate call: a few ms, so stop() is prompt
STOP_WAIT_S = 5.0       # stop() waits at most this for the chunk in progress


class ArenaWarmer:
    """Allocates the memfd's pages [0, target) in chunks, from the low
    offsets up (the allocator's first fit hands out low offsets first), in
    a daemon thread started by the first want().  The target only grows;
    fallocate leaves pages already there alone, so it may overlap slabs
    being written.  If the kernel refuses (no memory left in the cgroup,
    say), it stops: the writers fault the pages in as they go."""

    def __init__(self, fd: int, nbytes: int):
        self.fd, self.nbytes = fd, nbytes
        self.done = 0        # pages [0, done) are allocated
        self.target = 0
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = None

    def want(self, target: int) -> None:
        """Have [0, target) allocated (the batcher calls it as slabs are
        taken: cheap when the target did not grow)."""
        if target <= self.target or self.stopped:
            return
        with self.cond:
            self.target = min(target, self.nbytes)
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
            try:
                os.posix_fallocate(self.fd, lo, hi - lo)  # without the GIL
            except OSError:
                with self.cond:
                    self.stopped = True
                    self.cond.notify_all()
                return
            with self.cond:
                self.done = hi
                self.cond.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until the target is allocated (or the warmer stopped), at
        most timeout seconds."""
        with self.cond:
            return self.cond.wait_for(lambda: self.done >= self.target or self.stopped, timeout)

    def stop(self) -> None:
        """End the thread (after the chunk in progress)."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(STOP_WAIT_S)
