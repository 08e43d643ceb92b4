"""shmq: a lock-free shared-memory queue for numpy arrays.

    q = shmq.Queue(capacity_bytes=64 << 20)     # create; q.name identifies it
    p = shmq.Queue.attach(q.name)               # from any other process
    q.put(array_or_tree); obj = q.get()         # copies; never pickles arrays
    with q.get_view() as obj: ...               # zero-copy read
    with q.reserve(shape, dtype) as arr: ...    # zero-copy write

    a = shmq.shared_array(16, "i8")             # anonymous shared memory for forked children
    shmq.atomic_add(a, 0, 1)                    # atomic fetch-and-add on it
    shmq.atomic_cas(a, 0, 1, 5)                 # compare-and-swap: True if a[0] was 1
    shmq.atomic_store(a, 1, 7); shmq.atomic_load(a, 1)   # release store, acquire load
    w = shmq.shared_array(1, "i4")
    shmq.wait(w, 0, 0, timeout=1.0)             # sleep while w[0] == 0 (futex), bounded
    shmq.atomic_add(w, 0, 1); shmq.wake(w, 0)   # in another process: change it, wake sleepers

Linux only (POSIX shared memory in /dev/shm, futexes, /proc).
"""

from shmq.errors import (Closed, Empty, Full, IncompatibleRing, MessageTooLarge, PeerLost,
                         ShmFull, ShmqError, UntrustedSegment)
from shmq._core import (atomic_add, atomic_cas, atomic_load, atomic_store, discard_pages, prefault,
                        shared_array, wait, wake)
from shmq.queue import Queue

__all__ = [
    "Queue",
    "shared_array",
    "atomic_add",
    "atomic_cas",
    "atomic_load",
    "atomic_store",
    "wait",
    "wake",
    "prefault",
    "discard_pages",
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
