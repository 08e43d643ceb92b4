"""Keep the peers' own noise out of a benchmark's output, and say once whose
it is.

Grain's worker processes each log "WARNING:absl:Failed to load jax
profiler" where JAX is not installed, dozens of lines in the headline demo
that a newcomer reads as this project's.  So the peer's processes are
started with their stderr (fd 2, which they inherit) going to a file; at
the end the known noise is counted and left out, and every other line is
written to stderr as it was: nothing the peer says that is not noise is
lost.

Grain also leaves shared_memory objects to Python's resource_tracker,
which warns of them after the benchmark's process has ended.  That warning
cannot be caught without stopping the tracker early, which would unlink
the semaphores of PyTorch's loaders still alive: the benchmark says
beforehand whose it is (`resource_tracker_note`), and starts the tracker
itself so that the warning reaches the terminal, not the file.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from multiprocessing import resource_tracker

JAX_PROFILER = re.compile(r"WARNING:absl:Failed to load jax profiler")


class PeerStderr:
    """One file that the peers' processes write their stderr to; see the
    module docstring."""

    def __init__(self):
        self._file = tempfile.TemporaryFile()

    @contextlib.contextmanager
    def catching(self):
        """Processes started inside the block write their stderr to the
        file (this process's own stderr is back when it ends)."""
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)

    def report(self) -> str | None:
        """Write what is not noise to stderr; say what was left out (None:
        nothing).  Once: the file is closed after."""
        with self._file as f:
            f.seek(0)
            lines = f.read().decode(errors="replace").splitlines()
        noise = [line for line in lines if JAX_PROFILER.search(line)]
        kept = [line for line in lines if not JAX_PROFILER.search(line)]
        if kept:
            sys.stderr.write("\n".join(kept) + "\n")
        if not noise:
            return None
        return (f"(Left out of this output: {len(noise)} lines \"WARNING:absl:Failed to load jax "
                f"profiler\" from Grain's worker processes, as JAX is not installed.)")


def start_resource_tracker() -> None:
    """Start Python's resource tracker with this process's own stderr, so
    that it is not started by a peer inside PeerStderr.catching()."""
    resource_tracker.ensure_running()


def resource_tracker_note() -> str:
    return ("If Python's resource_tracker now warns of leaked shared_memory objects, they are "
            "Grain's (its worker processes' shared_memory, which the tracker removes); "
            "ShmLoader's shared memory is unnamed and leaves nothing in /dev/shm.")


class QuietStart:
    """A peer's loader whose processes start (at iter() and the first
    next()) with their stderr caught by a PeerStderr."""

    def __init__(self, loader, caught: PeerStderr):
        self._loader, self._caught = loader, caught

    def __iter__(self):
        with self._caught.catching():
            it = iter(self._loader)
            try:
                first = next(it)
            except StopIteration:
                return
        yield first
        yield from it

    def __getattr__(self, name):
        return getattr(self._loader, name)
