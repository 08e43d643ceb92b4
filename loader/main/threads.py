"""worker_mode="thread": the workers and the batcher are threads of the
main process instead of forked processes.

Everything else is the same: the batch slabs, the batch table and the
direct row writes, the runs and bells of NOTE [ Runs ], batches leased to
the user.  The two rings become in-process queues with the rings' get/put
interface (the messages are the same records, passed without pickling).
It suits preprocessing that releases the GIL (decoders, numpy, native
code) or that cannot be forked; rows of 64 KiB and more are copied
without the GIL.

What differs for the dataset: the threads share the process's global
random generators, so the loader does not seed them; a worker's own
generators are get_worker_info().rng (.random, .numpy, .torch), seeded per
worker, and per sample with reproducible=True.  A thread cannot be
killed: close() stops a worker between samples, and waits for a sample
in progress for up to JOIN_TIMEOUT_S (then leaves the daemon thread).
"""

from __future__ import annotations

import collections
import sys
import threading
import traceback

import shmq


class ThreadRing:
    """A ring between threads: put() never blocks (what goes in is bounded
    by the loader's limits, as on the rings), get(timeout) waits up to
    timeout seconds, then raises shmq.Empty."""

    def __init__(self):
        self._items = collections.deque()
        self._ready = threading.Condition(threading.Lock())

    def put(self, msg, timeout=None) -> None:
        with self._ready:
            self._items.append(msg)
            self._ready.notify()

    def get(self, timeout=None):
        with self._ready:
            if not self._ready.wait_for(lambda: self._items, timeout):
                raise shmq.Empty(f"no message within timeout={timeout}s")
            return self._items.popleft()

    def close(self) -> None:
        pass


class ThreadChild:
    """One worker or batcher thread, with the interface of a forked Child
    (main/procs.py): how it ended, what it left to say."""

    def __init__(self, role, target, args):  # role: a procs.Role
        self.role = role
        self._error = ""
        self._thread = threading.Thread(target=self._main, args=(target, args), daemon=True,
                                        name=f"ShmLoader {role}")

    def _main(self, target, args) -> None:
        try:
            target(*args)
        except BaseException:
            self._error = f"ShmLoader {self.role} (thread) failed:\n{traceback.format_exc()}"

    def start(self) -> None:
        self._thread.start()

    @property
    def pid(self) -> int:
        return self._thread.native_id or 0

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 0 once it returned, 1 if it raised."""
        if self._thread.is_alive():
            return None
        return 1 if self._error else 0

    def how_it_ended(self) -> str:
        if self.exitcode is None:
            return "is still running"
        return "raised an exception" if self._error else "returned"

    def last_words(self, limit: int = 6000) -> str:
        return self._error[-limit:]

    def stacks(self) -> str:
        frame = sys._current_frames().get(self._thread.ident)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def kill(self) -> None:
        pass  # a thread cannot be killed: it stops at its next check of STOP

    def close(self) -> None:
        pass


def start_threads(specs) -> list[ThreadChild]:
    children = [ThreadChild(role, target, args) for role, target, args in specs]
    for c in children:
        c.start()
    return children
