"""shmq: a lock-free shared-memory queue for numpy arrays.

    q = shmq.Queue(capacity_bytes=64 << 20)     # create; q.name identifies it
    p = shmq.Queue.attach(q.name)               # from any other process
    q.put(array_or_tree); obj = q.get()         # copies; never pickles arrays
    with q.get_view() as obj: ...               # zero-copy read
    with q.reserve(shape, dtype) as arr: ...    # zero-copy write

The top level is the queue and its errors.  Beside it: shmq.sync, the
primitives under it (shared arrays, atomics, futex waits) for programs
that coordinate processes through shared memory; shmq.segment and
``python -m shmq [list|clean]``, the segments in /dev/shm.

Linux only (POSIX shared memory in /dev/shm, futexes, /proc).
"""

from shmq.errors import (Closed, Empty, Full, IncompatibleRing, MessageTooLarge, PeerLost,
                         ShmFull, ShmqError, UntrustedSegment)
from shmq.queue import Queue
from shmq import sync  # noqa: F401  (shmq.sync after import shmq; not in __all__)

__all__ = [
    "Queue",
    "ShmqError",
    "Full",
    "Empty",
    "Closed",
    "PeerLost",
    "IncompatibleRing",
    "MessageTooLarge",
    "ShmFull",
    "UntrustedSegment",
]
__version__ = "0.1.0"
