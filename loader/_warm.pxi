# Warm-up of the batch arena: fault its pages in bulk ahead of the copies.
# Included by _native.pyx.
#
# Why compiled: a writer checks, before every row it writes, whether its
# own mapping of the slab is populated (a byte per 2 MiB chunk, in C).
#
# NOTE [ Warming the arena ]
# ==========================
#
# Fresh shared memory costs a page fault per 4 KiB on first touch: about
# 1 GB/s, where a copy into touched memory runs at 5-20 GB/s.  And a page
# is "touched" per process: each worker maps the arena itself, so a page
# another process faulted in still costs this worker a (minor) fault.  A
# new loader's first epochs used to pay both inside the workers' copies
# (W1 epochs 1, 2, 3: 2.8, 10.3, 23.5 GB/s).  Now the work is done in bulk,
# ahead of the copies, and only once per page per process:
#
#   the collator  a background thread (ArenaWarmer, _warmup.py) allocates
#                 the arena's pages with fallocate() on its memfd, from the
#                 low offsets up (first fit hands those out first), up to
#                 the slabs one run keeps in flight, as soon as the first
#                 batch says how big a slab is.  No mapping is involved, so
#                 no process pays page tables it will not use.
#   each writer   before its first row in a 2 MiB chunk of the arena, it
#                 allocates the chunk (fallocate, a no-op where the warmer
#                 was first) and populates its own mapping of the chunk with
#                 one madvise(MADV_POPULATE_READ) (Linux >= 5.14; WarmChunks).
#                 READ, not WRITE: a read fault maps the 16 pages around it
#                 that are in the page cache (fault-around), where a write
#                 fault maps one; and on shmem without write-notify the
#                 entries come out writable, so the row's copy takes no fault.
#                 Per row's chunks, not per slab: the first row of a new
#                 slab does not wait for a whole batch of page tables.
#
# Measured (W1, 2 workers, 0.77 GB in flight; load 5-6): a worker's minor
# faults in epoch 1 went from 152,000 (a fault per 4 KiB page, in each
# worker) to 13,000, the loader's epoch-1 CPU from 0.82 to 0.63 s (median
# of 3, alternating), and a worker's first row from 180 ms (the whole
# slab populated first) to 10-25 ms.  A page the other worker already
# faulted in costs this one a sixteenth of a fault; a page first touched
# (fallocate does not zero it: the first fault does) still costs one.
#
# Neither changes a byte (fallocate leaves allocated pages alone, and
# MADV_POPULATE_READ only faults pages in), so both are safe on slabs
# other processes are writing.  On older kernels writers fault as before.
# Main's eviction of kept batches (NOTE [ Kept batch memory ]) remaps pages
# in main's mapping only, which nothing here touches; the warmer stops with
# the collator, before close() gives pages back.

cdef extern from *:
    """
    #include <sys/mman.h>
    #ifndef MADV_POPULATE_READ
    #define MADV_POPULATE_READ 22  /* Linux 5.14 */
    #endif
    """
    int MADV_POPULATE_READ

cdef extern from "sys/mman.h" nogil:
    int madvise(void *addr, size_t length, int advice)

cdef extern from "fcntl.h" nogil:
    int fallocate(int fd, int mode, long offset, long length)

from libc.stdlib cimport calloc, free

cdef Py_ssize_t _CHUNK_SHIFT = 21  # 2 MiB chunks
cdef size_t _PAGE = os.sysconf("SC_PAGE_SIZE")


cdef int _populate(char *p, size_t n) noexcept nogil:
    """MADV_POPULATE_READ over [p, p + n) (page-aligned down); 0 or -1."""
    cdef size_t lo = <size_t>p & ~(_PAGE - 1)
    if n == 0:
        return 0
    return madvise(<void *>lo, <size_t>p + n - lo, MADV_POPULATE_READ)


cdef class WarmChunks:
    """One process's record of which 2 MiB chunks of its mapping of the
    arena it has populated (see NOTE [ Warming the arena ])."""

    cdef unsigned char *done
    cdef Py_ssize_t nchunks
    cdef char *base
    cdef Py_ssize_t nbytes
    cdef int fd                  # our duplicate of the arena's memfd, to allocate a chunk
                                 # first; -1: none
    cdef bint no_fallocate       # refused once (memory cgroup full?): the faults allocate
    cdef bint unsupported        # no MADV_POPULATE_READ here: leave it to the faults

    def __cinit__(self, cnp.ndarray arena not None, int fd=-1):
        self.fd = -1
        self.base = <char *>cnp.PyArray_DATA(arena)
        self.nbytes = arena.nbytes
        self.nchunks = (self.nbytes >> _CHUNK_SHIFT) + 1
        self.done = <unsigned char *>calloc(self.nchunks, 1)
        if self.done == NULL:
            raise MemoryError()
        if fd >= 0:  # our own: a thread worker may outlive the loader's copy
            self.fd = os.dup(fd)

    def __dealloc__(self):
        free(self.done)
        if self.fd >= 0:
            os.close(self.fd)

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
                # Allocated first (a no-op where the collator's warmer got
                # there): populating a hole would fault its pages one by one.
                if not self.no_fallocate and self.fd >= 0 and fallocate(self.fd, 0, start, n) != 0:
                    self.no_fallocate = True
                if _populate(self.base + start, n) != 0:
                    self.unsupported = True
                    return
                self.done[c] = 1
            c += 1
