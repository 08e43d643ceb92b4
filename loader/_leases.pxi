# Included by _native.pyx: main's side of the slab leases (see NOTE
# [ ShmLoader processes and shutdown ] in _protocol.py).
#
# Why compiled: a batch is released when its last array dies, i.e. inside
# whatever statement of the training loop drops it.  Python code run there
# (a weakref.finalize callback) is where a Ctrl-C's handler would run, and
# Python reports an exception raised in a finalizer as "ignored" and drops
# it: the training loop would carry on.  The release below runs no Python
# bytecode, so a KeyboardInterrupt is raised at the loop's next bytecode.

cimport cython
from libc.stdlib cimport calloc, free

cdef extern from "sys/mman.h" nogil:
    int MADV_REMOVE
    int madvise(void *addr, size_t length, int advice)

cdef extern from "signal.h" nogil:
    int raise_signal "raise"(int sig)

cdef Py_ssize_t PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

# Test hook (tests/test_loader_kill.py): raise SIGINT from inside the N-th
# release, the moment a Ctrl-C is most easily lost.
cdef long _sigint_on_release = 0


def _raise_sigint_on_release(long n):
    global _sigint_on_release
    _sigint_on_release = n


cdef class LeaseBook:
    """Main's record of the slabs handed to the user.  view(slab) gives the
    uint8 array of one slab; every array made from it keeps a SlabLease
    alive, and when the last of them dies the lease is released: its
    generation stored into released[lease] (the collator may reuse the slab
    once it sees that) and the collator's bell rung.

    After close(), the arena's pages that no held slab uses are given back
    at once (MADV_REMOVE, in every process that maps them: a later
    loader's children inherit the mapping), and each held slab's pages go
    back when it is dropped."""

    cdef object arena_array, released_array, bell
    cdef char *base
    cdef Py_ssize_t arena_bytes
    cdef int64_t *released
    cdef Py_ssize_t max_leases
    cdef Py_ssize_t *held_offset     # per lease; held_bytes 0: not held
    cdef Py_ssize_t *held_bytes
    cdef readonly bint closed
    cdef uint32_t *page_users        # after close: held slabs on each page of the arena

    def __cinit__(self):
        self.held_offset = self.held_bytes = NULL
        self.page_users = NULL

    def __init__(self, cnp.ndarray arena not None, cnp.ndarray released not None, Bell bell not None):
        if arena.dtype != np.uint8 or not arena.flags.c_contiguous or arena.ndim != 1:
            raise TypeError("the arena is a 1-d C-contiguous uint8 array")
        if released.dtype != np.int64 or not released.flags.c_contiguous or released.ndim != 1:
            raise TypeError("released is a 1-d C-contiguous int64 array")
        self.arena_array, self.released_array, self.bell = arena, released, bell
        self.base = <char *>cnp.PyArray_DATA(arena)
        self.arena_bytes = arena.shape[0]
        self.released = <int64_t *>cnp.PyArray_DATA(released)
        self.max_leases = released.shape[0]
        self.held_offset = <Py_ssize_t *>calloc(self.max_leases, sizeof(Py_ssize_t))
        self.held_bytes = <Py_ssize_t *>calloc(self.max_leases, sizeof(Py_ssize_t))
        if self.held_offset == NULL or self.held_bytes == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.held_offset)
        free(self.held_bytes)
        free(self.page_users)

    @property
    def held(self):
        """{lease: (offset, nbytes)} of the slabs the user may still hold."""
        return {i: (self.held_offset[i], self.held_bytes[i])
                for i in range(self.max_leases) if self.held_bytes[i]}

    def view(self, Py_ssize_t lease, int64_t generation, Py_ssize_t offset, Py_ssize_t nbytes):
        """The uint8 array of a slab, leased until every array made from it is gone."""
        if not 0 <= lease < self.max_leases:
            raise IndexError(f"lease {lease} out of range (0..{self.max_leases - 1})")
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.arena_bytes:
            raise ValueError(f"slab [{offset}, {offset + nbytes}) is not inside the arena "
                             f"of {self.arena_bytes} bytes")
        if self.closed:
            raise RuntimeError("the loader is closed: no more batches")
        if self.held_bytes[lease]:
            raise RuntimeError(f"lease {lease} is already held")
        cdef SlabLease owner = SlabLease.__new__(SlabLease)
        owner.book, owner.lease, owner.generation = self, lease, generation
        cdef cnp.npy_intp dims = nbytes
        arr = cnp.PyArray_SimpleNewFromData(1, &dims, cnp.NPY_UINT8, self.base + offset)
        # The base of every array viewing this one (numpy stops collapsing
        # .base chains at a non-array): the lease lives as long as any of them.
        cnp.set_array_base(arr, owner)
        self.held_offset[lease], self.held_bytes[lease] = offset, nbytes
        return arr

    cdef void release(self, Py_ssize_t lease, int64_t generation) noexcept nogil:
        global _sigint_on_release
        cdef Py_ssize_t offset = self.held_offset[lease], nbytes = self.held_bytes[lease]
        self.held_bytes[lease] = 0
        if _sigint_on_release > 0:
            _sigint_on_release -= 1
            if _sigint_on_release == 0:
                raise_signal(2)  # SIGINT
        if not self.closed:
            # SYNC POINT: release store; the collator's acquire load of
            # released[lease] (SlabAllocator.reclaim) pairs with it.
            __atomic_store_n64(self.released + lease, generation, __ATOMIC_RELEASE)
            (<Bell>self.bell).ring_c()
            return
        self._discard_unused(offset // PAGE_BYTES, (offset + nbytes - 1) // PAGE_BYTES)

    cdef void _discard_unused(self, Py_ssize_t first, Py_ssize_t last) noexcept nogil:
        """After close: one holder fewer on pages first..last; give back
        each run of pages nobody holds any more."""
        cdef Py_ssize_t p, run = -1
        for p in range(first, last + 2):
            if p <= last:
                self.page_users[p] -= 1
            if p <= last and self.page_users[p] == 0:
                if run < 0:
                    run = p
            elif run >= 0:
                madvise(self.base + run * PAGE_BYTES, (p - run) * PAGE_BYTES, MADV_REMOVE)
                run = -1

    def close(self):
        """Give back every page of the arena that no held slab uses; the
        others go back as their slabs are dropped."""
        if self.closed:
            return
        cdef Py_ssize_t npages = (self.arena_bytes + PAGE_BYTES - 1) // PAGE_BYTES
        cdef Py_ssize_t i, p, first, last
        self.page_users = <uint32_t *>calloc(npages + 1, sizeof(uint32_t))
        if self.page_users == NULL:
            raise MemoryError()
        for i in range(self.max_leases):
            if self.held_bytes[i]:
                first = self.held_offset[i] // PAGE_BYTES
                last = (self.held_offset[i] + self.held_bytes[i] - 1) // PAGE_BYTES
                for p in range(first, last + 1):
                    self.page_users[p] += 1
        self.closed = True
        # Count one more holder on every page and drop it at once: the pages
        # no slab holds reach 0 and go back, by the same path as a drop.
        for p in range(npages):
            self.page_users[p] += 1
        with nogil:
            self._discard_unused(0, npages - 1)


@cython.no_gc_clear  # its book must still be there when it is deallocated
cdef class SlabLease:
    """The base object of one slab's arrays (see LeaseBook.view)."""

    cdef LeaseBook book
    cdef Py_ssize_t lease
    cdef int64_t generation

    def __dealloc__(self):
        if self.book is not None:
            self.book.release(self.lease, self.generation)
