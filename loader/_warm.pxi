# Warm-up of the batch arena: fault its pages in bulk ahead of the copies.
# Included by _native.pyx.
#
# Why compiled: a writer checks, before every row it writes, whether its
# own mapping of the slab is populated (a byte per 2 MiB chunk, in C); and
# the page-by-page fallback must be an atomic no-op write, which Python
# cannot express.
#
# NOTE [ Warming the arena ]
# ==========================
#
# Fresh shared memory costs a page fault per 4 KiB on first touch: about
# 1 GB/s, where a copy into touched memory runs at 5-20 GB/s.  And a page
# is "touched" per process: each worker maps the arena itself, so a page
# another process faulted in still costs this worker a (minor) fault.  A
# new loader's first epochs used to pay both inside the workers' copies
# (W1 epochs 1, 2, 3: 2.8, 10.3, 23.5 GB/s).  Two things fault in bulk now,
# with madvise(MADV_POPULATE_WRITE) (Linux >= 5.14): one system call per
# range instead of a trap per page, and it never changes the data, so it
# is safe on pages other processes are writing:
#
#   the collator  a background thread (ArenaWarmer, _warmup.py) populates
#                 the arena ahead of the allocator, up to the slabs one run
#                 keeps in flight, as soon as the first batch says how big a
#                 slab is: the pages exist before any worker writes them.
#   each writer   before its first row in a 2 MiB chunk of the arena, it
#                 populates its own mapping of that whole chunk (WarmChunks):
#                 page-table entries in bulk, instead of a fault per page
#                 in the copy.  A chunk is done once per process.
#
# Without MADV_POPULATE_WRITE (older kernels) the collator's thread touches
# a word per page with an atomic add of 0 (a write fault, data unchanged
# even under a concurrent writer), and writers fault as before.  Main's
# eviction of kept batches (NOTE [ Kept batch memory ]) remaps pages in
# main's mapping only; neither warmer touches main's mappings, and after
# close() nothing warms again, so pages given back stay given back.

cdef extern from *:
    """
    #include <sys/mman.h>
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23  /* Linux 5.14 */
    #endif
    /* A write access that changes nothing, even racing a writer of the byte. */
    static inline void loader_touch_byte(unsigned char *p) {
        __atomic_fetch_add(p, 0, __ATOMIC_RELAXED);
    }
    """
    int MADV_POPULATE_WRITE
    void loader_touch_byte(unsigned char *p) nogil

cdef extern from "sys/mman.h" nogil:
    int madvise(void *addr, size_t length, int advice)

from libc.stdlib cimport calloc, free

cdef Py_ssize_t _CHUNK_SHIFT = 21  # 2 MiB chunks
cdef size_t _PAGE = os.sysconf("SC_PAGE_SIZE")


cdef int _populate(char *p, size_t n) noexcept nogil:
    """MADV_POPULATE_WRITE over [p, p + n) (page-aligned down); 0 or -1."""
    cdef size_t lo = <size_t>p & ~(_PAGE - 1)
    if n == 0:
        return 0
    return madvise(<void *>lo, <size_t>p + n - lo, MADV_POPULATE_WRITE)


def populate(cnp.ndarray arr not None) -> bool:
    """Fault in the pages under arr (C-contiguous, writable) without
    changing a byte, also while other processes write them: one
    madvise(MADV_POPULATE_WRITE), or on kernels without it an atomic add
    of 0 to a byte of every page.  True if madvise did it."""
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("populate needs a writable C-contiguous array")
    cdef char *p = <char *>cnp.PyArray_DATA(arr)
    cdef size_t n = <size_t>cnp.PyArray_NBYTES(arr)
    cdef size_t off
    cdef int rc
    with nogil:
        rc = _populate(p, n)
        if rc != 0:
            off = 0
            while off < n:
                loader_touch_byte(<unsigned char *>(p + off))
                off = (off | (_PAGE - 1)) + 1  # the next page's first byte
    return rc == 0


cdef class WarmChunks:
    """One process's record of which 2 MiB chunks of its mapping of the
    arena it has populated (see NOTE [ Warming the arena ])."""

    cdef unsigned char *done
    cdef Py_ssize_t nchunks
    cdef char *base
    cdef Py_ssize_t nbytes
    cdef bint unsupported        # no MADV_POPULATE_WRITE here: leave it to the faults

    def __cinit__(self, cnp.ndarray arena not None):
        self.base = <char *>cnp.PyArray_DATA(arena)
        self.nbytes = arena.nbytes
        self.nchunks = (self.nbytes >> _CHUNK_SHIFT) + 1
        self.done = <unsigned char *>calloc(self.nchunks, 1)
        if self.done == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.done)

    cdef void ensure(self, Py_ssize_t offset, Py_ssize_t nbytes) noexcept nogil:
        """Populate the chunks under [offset, offset + nbytes) not done yet."""
        cdef Py_ssize_t c, last, start, n
        if self.unsupported or nbytes <= 0:
            return
        c = offset >> _CHUNK_SHIFT
        last = (offset + nbytes - 1) >> _CHUNK_SHIFT
        while c <= last:
            if not self.done[c]:
                start = c << _CHUNK_SHIFT
                n = min(<Py_ssize_t>1 << _CHUNK_SHIFT, self.nbytes - start)
                if _populate(self.base + start, n) != 0:
                    self.unsupported = True
                    return
                self.done[c] = 1
            c += 1

    def populated_bytes(self) -> int:
        """How much of the arena this process has populated (tests)."""
        cdef Py_ssize_t c, total = 0
        for c in range(self.nchunks):
            if self.done[c]:
                total += min(<Py_ssize_t>1 << _CHUNK_SHIFT, self.nbytes - (c << _CHUNK_SHIFT))
        return total
