# Warm-up of the batch arena: fault its pages in bulk ahead of the copies.
# Included by _native.pyx.
#
# Why compiled: a writer checks, before every row it writes, whether its
# own mapping of the slab is populated (a byte per 2 MiB chunk, in C).
#
# NOTE [ Warming the arena ]
# ==========================
#
# Fresh shared memory costs a page fault per 4 KiB on first touch, many
# times what a copy into touched memory costs.  And a page is "touched"
# per process: each worker maps the arena itself, so a page another
# process faulted in still costs this worker a (minor) fault.  A new
# loader's first epochs used to pay both inside the workers' copies
# (docs/benchmarks.md, W1: a new loader's first epochs).  Now the work is
# done in bulk, ahead of the copies, and only once per page per process:
#
#   the batcher  a background thread (ArenaWarmer, batcher/warmup.py) allocates
#                 the arena's pages with fallocate() on its memfd, from the
#                 low offsets up (first fit hands those out first), up to
#                 the slabs one run keeps in flight, as soon as the first
#                 batch says how big a slab is.  No mapping is involved, so
#                 no process pays page tables it will not use.
#   each writer   before its first row in a 2 MiB chunk of the arena, it
#                 populates its own mapping of the whole chunk with one
#                 madvise(MADV_POPULATE_WRITE) (Linux >= 5.14; WarmChunks):
#                 page-table entries in bulk instead of a fault per page.
#
# Neither changes a byte (fallocate leaves allocated pages alone, and
# MADV_POPULATE_WRITE only faults pages in), so both are safe on slabs
# other processes are writing.  On older kernels writers fault as before.
# Main's eviction of kept batches (NOTE [ Kept batch memory ]) remaps pages
# in main's mapping only, which nothing here touches; the warmer stops with
# the batcher, before close() gives pages back.

cdef extern from *:
    """
    #include <sys/mman.h>
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23  /* Linux 5.14 */
    #endif
    """
    int MADV_POPULATE_WRITE

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
