"""shmq's low-level primitives, for programs that coordinate processes
through shared memory beside their queues (the loader's control words and
bells are built on them):

    from shmq import sync
    a = sync.shared_array(16, "i8")         # anonymous shared memory for forked children
    sync.atomic_add(a, 0, 1)                # atomic fetch-and-add on it
    sync.atomic_cas(a, 0, 1, 5)             # compare-and-swap: True if a[0] was 1
    sync.atomic_store(a, 1, 7); sync.atomic_load(a, 1)   # release store, acquire load
    w = sync.shared_array(1, "i4")
    sync.wait(w, 0, 0, timeout=1.0)         # sleep while w[0] == 0 (futex), bounded
    sync.atomic_add(w, 0, 1); sync.wake(w, 0)   # in another process: change it, wake sleepers
    sync.prefault(a); sync.discard_pages(a) # take its pages now; give them back

Memory orders and the wait/wake pattern: shmq/_sync.pxi and shmq_sync.h.

This module and sync.pxd share a name on purpose, as Cython's pattern
has it: sync.pxd declares the C primitives for other Cython modules
(`from shmq.sync cimport shmq_word_wait`: C declarations only, so the
cimport imports nothing at run time), and this module is their Python
face, implemented in shmq._core (_sync.pxi).
"""

from shmq._core import (atomic_add, atomic_cas, atomic_load, atomic_store, discard_pages, prefault,
                        shared_array, wait, wake)

__all__ = ["shared_array", "atomic_add", "atomic_cas", "atomic_load", "atomic_store", "wait",
           "wake", "prefault", "discard_pages"]
