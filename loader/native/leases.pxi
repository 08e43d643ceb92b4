# Included by _native.pyx: main's side of the slab leases (see NOTE
# [ ShmLoader processes and shutdown ] in shared/messages.py, and NOTE [ Kept
# batch memory ] below).
#
# Why compiled: a batch is released when its last array dies, i.e. inside
# whatever statement of the training loop drops it.  Python code run there
# (a weakref.finalize callback) is where a Ctrl-C's handler would run, and
# Python reports an exception raised in a finalizer as "ignored" and drops
# it: the training loop would carry on.  The releases below run no Python
# bytecode, so a KeyboardInterrupt is raised at the loop's next bytecode.
#
# NOTE [ Kept batch memory ]
# ==========================
#
# Every array leaf of a batch views its slab through a leaf lease of its
# own, so main knows which parts of a slab the training loop still holds:
# `targets.append(y)` keeps y's lease, not x's.  A slab goes back to the
# pool when its last leaf dies, as before.  When the pool is short of
# memory (the batcher holds MEMORY_WAIT at 1), or slabs that are mostly dropped
# hold a quarter of the cap, main *moves out* (evicts) the slabs the user
# still holds, without copying a byte itself:
#
#   1. the mapping they are viewed through (an ArenaMap, MAP_SHARED) is
#      replaced, in one mmap(MAP_FIXED), by a MAP_PRIVATE mapping of the same
#      memfd range: every address stays valid and reads the same pages;
#   2. MADV_POPULATE_WRITE over each live leaf's pages breaks copy-on-write:
#      the kernel gives each page a private copy, at the same address;
#   3. the slab's lease is released, and the pool writes new batches into
#      the arena; the user's pages no longer change.
#
# Why not memcpy to fresh pages and mremap them over the leaf (as before):
# a write another thread makes between the copy and the mremap went to the
# old page and was lost.  Here a writer either wrote the shared page before
# step 1 (the copy in step 2 carries it) or faults after it and gets its own
# private copy first: the kernel's copy-on-write is atomic for every thread of
# the process.  And nothing is unmapped or split while leaves move, so a move
# cannot half-succeed: if step 2 is refused (ENOMEM), the slab simply stays
# held (its private mapping still reads the arena's pages, which the pool does
# not reuse while the slab is held) and is moved again later; every leaf keeps
# its values and the loader goes on.
#
# New slabs are viewed through a fresh shared mapping of the memfd
# (ArenaMap).  A private mapping is *retired* once no slab it views is held:
# everything but the kept runs is unmapped.  A kept run (KeptRun) dies with
# its last leaf: unmapped if its mapping is retired, else its private pages
# are dropped (MADV_DONTNEED).  Slabs are page-aligned (batcher/slabs.py), so a run
# never holds another slab's bytes.
#
# The copy is paid once per kept region, under pressure only; a loop that
# keeps nothing never evicts, and W1's path is the one view per leaf.
#
# A forked process holds what it inherited: os.fork() copies main's private
# pages copy-on-write, but shares the arena's pages.  So before every fork
# that is not one of the loader's own (an evaluation helper, an async
# checkpoint, a multiprocessing 'fork' Process, another loader's workers),
# every held slab is moved out as above (_before_fork): the child's views
# and the parent's then never change under either of them, as with torch's
# DataLoader.  And leases belong to the process that took them: in a forked
# child, a dropped lease or a book's close() never touches the shared state
# (the pool's released words, its bell, the arena's pages).
#
# Batches main holds back are kept memory too: one that arrived ahead of
# its turn (in order), or the next epoch's, received while this one ends.
# The batch the loop waits for may need their memory (with a pool of one
# batch it always does), so under MEMORY_WAIT main copies each of them into
# its own memory and gives the slab back at once (Session.copy_out, from
# Runs.copy_out_held); handed out later, its arrays view the copy.  The
# batcher's side of the same rule: NOTE [ Memory goes to batches in order ]
# in batcher/runs.py.

cimport cython
from cpython.ref cimport PyObject, Py_INCREF
from libc.stdlib cimport calloc, free, malloc, qsort, realloc
from libc.string cimport memcpy

import warnings
import weakref

from loader.errors import KeptBatchesShared

cdef extern from *:
    """
    #include <errno.h>
    #include <fcntl.h>
    #include <sys/mman.h>
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23  /* Linux 5.14 */
    #endif

    /* Give every page of [p, p + n) of a MAP_PRIVATE file mapping a private
     * copy (break copy-on-write), values unchanged: 0, or -1 with errno.
     * MADV_POPULATE_WRITE does it in the kernel and reports ENOMEM; before
     * Linux 5.14 it is EINVAL, and an atomic add of 0 to a byte of each page
     * makes the same write fault (atomic: a value another thread stores at
     * the same moment is never undone). */
    static int leases_own_pages(char *p, size_t n, size_t page) {
        if (n == 0) return 0;
        if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return 0;
        if (errno != EINVAL) return -1;
        for (size_t at = 0; at < n; at += page)
            __atomic_fetch_add((volatile unsigned char *)(p + at), 0, __ATOMIC_RELAXED);
        return 0;
    }

    static int leases_punch(int fd, long offset, long n) {
        return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, n);
    }
    """
    int leases_own_pages(char *p, size_t n, size_t page) nogil
    int leases_punch(int fd, long offset, long n) nogil

cdef extern from "sys/mman.h" nogil:
    int MADV_DONTNEED
    int PROT_READ, PROT_WRITE
    int MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_NORESERVE
    void *MAP_FAILED
    int madvise(void *addr, size_t length, int advice)
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)

cdef extern from "unistd.h" nogil:
    int close_fd "close"(int fd)

cdef extern from "numpy/arrayobject.h":
    object _new_from_descr "PyArray_NewFromDescr"(void *subtype, void *descr, int nd,
                                                  cnp.npy_intp *dims, cnp.npy_intp *strides,
                                                  void *data, int flags, void *obj)

cdef extern from "signal.h" nogil:
    int raise_signal "raise"(int sig)

cdef Py_ssize_t PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

# Test hooks (tests/loader_layer/test_loader_kill.py, test_kept_batches.py):
# raise SIGINT from inside the N-th release, the moment a Ctrl-C is most
# easily lost; refuse the next N page moves with ENOMEM, as a system out of
# memory does.
cdef long _sigint_on_release = 0
cdef long _refuse_moves = 0


def _raise_sigint_on_release(long n):
    global _sigint_on_release
    _sigint_on_release = n


def _refuse_next_moves(long n):
    global _refuse_moves
    _refuse_moves = n


# --- forks: NOTE [ Kept batch memory ] -------------------------------------------------

# Counted up in every child os.fork() makes: a book born in another
# generation belongs to an ancestor, and its leases are not this process's.
cdef long _fork_generation = 0
cdef bint _own_fork = False          # the loader is forking one of its children
_books = weakref.WeakSet()           # live LeaseBooks of this process


def forking_own_child(bint on):
    """The loader's own forks (procs._fork, main/procs.py) set this: its children never
    look at the batches main holds, so they need not move out first."""
    global _own_fork
    _own_fork = on


def _before_fork():
    if _own_fork:
        return
    for book in list(_books):
        try:
            (<LeaseBook>book).move_all_out()
        except MemoryError as e:
            warnings.warn(f"ShmLoader: a process was forked while you held batches, and "
                          f"{e}; the child's views of those batches may change when the pool "
                          f"reuses them: copy what a child must keep before forking",
                          KeptBatchesShared)


def _after_fork_in_child():
    global _fork_generation, _own_fork
    _fork_generation += 1
    _own_fork = False


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


cdef inline Py_ssize_t _page_down(Py_ssize_t x) noexcept nogil:
    return x & ~(PAGE_BYTES - 1)


cdef inline Py_ssize_t _page_up(Py_ssize_t x) noexcept nogil:
    return (x + PAGE_BYTES - 1) & ~(PAGE_BYTES - 1)


cdef int _own_pages(char *addr, Py_ssize_t nbytes) except -1:
    """Break copy-on-write over [addr, addr + nbytes) of a private mapping
    (step 2 of NOTE [ Kept batch memory ]); MemoryError if refused."""
    global _refuse_moves
    cdef int rc, err
    if _refuse_moves > 0:
        _refuse_moves -= 1
        rc, err = -1, ENOMEM
    else:
        with nogil:
            rc = leases_own_pages(addr, nbytes, PAGE_BYTES)
        err = errno
    if rc != 0:
        raise MemoryError(f"the system refused private pages for {nbytes} bytes of a batch you "
                          f"hold ({os.strerror(err)})")
    return 0


cdef struct Run:
    char *addr
    Py_ssize_t nbytes     # 0: dead (unmapped, or its pages dropped)


cdef int _by_addr(const void *a, const void *b) noexcept nogil:
    cdef char *x = (<Run *>a).addr
    cdef char *y = (<Run *>b).addr
    return -1 if x < y else (1 if x > y else 0)


cdef class ArenaFile:
    """The arena's memfd in main (a duplicate), shared by the book and its
    mappings: a mapping is made private through it, and after the loader's
    close() a dropped slab's pages are punched out of it."""

    cdef int fd

    def __cinit__(self):
        self.fd = -1

    cdef void close(self) noexcept nogil:
        if self.fd >= 0:
            close_fd(self.fd)
            self.fd = -1

    def __dealloc__(self):
        self.close()


@cython.no_gc_clear
cdef class ArenaMap:
    """One mapping of the arena (its memfd) in main, through which slabs
    are viewed; see NOTE [ Kept batch memory ]."""

    cdef char *addr
    cdef Py_ssize_t nbytes
    cdef ArenaFile file            # None: not to be made private (arena_array)
    cdef Py_ssize_t held_slabs    # slabs viewed here, held and not evicted
    cdef bint current             # new slabs are viewed here
    cdef bint private             # MAP_PRIVATE now: step 1 of the NOTE happened
    cdef bint retired             # only its kept runs are still mapped
    cdef Run *runs                # kept runs, and (nbytes > 0, no KeptRun) husks:
    cdef Py_ssize_t nruns, cap_runs  # ranges that could not be unmapped yet

    def __cinit__(self):
        self.addr = NULL
        self.runs = NULL

    cdef int open(self, int fd, Py_ssize_t nbytes, ArenaFile file, long offset=0) except -1:
        cdef void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd,
                            offset)
        if p == MAP_FAILED:
            raise MemoryError(errno, f"cannot map {nbytes} bytes of shared memory: "
                                     f"{os.strerror(errno)}")
        self.addr, self.nbytes, self.file, self.current = <char *>p, nbytes, file, True
        return 0

    cdef int make_private(self) except -1:
        """Step 1 of NOTE [ Kept batch memory ]: the same pages, at the same
        addresses, now copy-on-write.  One mapping replaced by one of the
        same range: the process's mapping count does not change."""
        if self.private:
            return 0
        if self.file is None or self.file.fd < 0:
            raise MemoryError("the arena's file is closed")
        cdef void *p = mmap(self.addr, self.nbytes, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, self.file.fd, 0)
        if p == MAP_FAILED:
            raise MemoryError(f"cannot map the batch arena's {self.nbytes} bytes privately "
                              f"({os.strerror(errno)})")
        self.private = True
        return 0

    cdef Py_ssize_t add_run(self, char *addr, Py_ssize_t nbytes) except -1:
        if self.nruns == self.cap_runs:
            self.cap_runs = max(16, 2 * self.cap_runs)
            grown = <Run *>realloc(self.runs, self.cap_runs * sizeof(Run))
            if grown == NULL:
                raise MemoryError()
            self.runs = grown
        self.runs[self.nruns].addr, self.runs[self.nruns].nbytes = addr, nbytes
        self.nruns += 1
        return self.nruns - 1

    cdef void run_gone(self, Py_ssize_t i) noexcept nogil:
        """A kept run's last leaf died: give its private pages back."""
        cdef Run *r = &self.runs[i]
        if self.retired and munmap(r.addr, r.nbytes) == 0:
            r.nbytes = 0
            return
        # Not retired (the mapping still views held slabs), or the unmap
        # was refused (at vm.max_map_count, splitting a mapping fails):
        # drop the pages, keep the addresses (a husk, unmapped with the map).
        madvise(r.addr, r.nbytes, MADV_DONTNEED)
        if not self.retired:
            r.nbytes = 0

    cdef void slab_gone(self) noexcept nogil:
        self.held_slabs -= 1
        self.retire_if_unused()

    cdef void retire_if_unused(self) noexcept nogil:
        """Unmap all but the live kept runs once no held slab is viewed
        here and new ones are viewed elsewhere."""
        if self.current or self.retired or self.held_slabs:
            return
        # Sorted in a copy: each KeptRun holds the index of its entry in
        # self.runs, and run_gone(index) must still find that entry (sorting
        # self.runs in place made a later death unmap another live run's
        # pages: a kept leaf read garbage, or faulted).
        cdef Run *by_addr = <Run *>malloc(max(1, self.nruns) * sizeof(Run))
        if by_addr == NULL:
            return  # not retired: its mapping stays whole until it is retired or freed
        cdef Py_ssize_t i, n = self.nruns
        memcpy(by_addr, self.runs, n * sizeof(Run))
        qsort(by_addr, n, sizeof(Run), _by_addr)
        self.retired = True
        cdef char *at = self.addr
        for i in range(n):
            if by_addr[i].nbytes == 0:
                continue
            if by_addr[i].addr > at:
                self._unmap_gap(at, by_addr[i].addr - at)
            at = by_addr[i].addr + by_addr[i].nbytes
        free(by_addr)
        if self.addr + self.nbytes > at:
            self._unmap_gap(at, self.addr + self.nbytes - at)

    cdef void _unmap_gap(self, char *at, Py_ssize_t nbytes) noexcept nogil:
        if munmap(at, nbytes) == 0:
            return
        # Refused (splitting the mapping would pass vm.max_map_count): the
        # pages go now, the addresses when this mapping is freed.
        madvise(at, nbytes, MADV_DONTNEED)
        with gil:
            try:
                self.add_run(at, nbytes)
            except MemoryError:
                pass  # the range stays mapped for good: address space, no memory

    def __dealloc__(self):
        # Every kept run holds its mapping, so none is alive here.
        cdef Py_ssize_t i
        if self.addr != NULL and not self.retired:
            munmap(self.addr, self.nbytes)
        elif self.addr != NULL:
            for i in range(self.nruns):
                if self.runs[i].nbytes:
                    munmap(self.runs[i].addr, self.runs[i].nbytes)
        free(self.runs)


def arena_array(int fd, Py_ssize_t nbytes, long offset=0):
    """A uint8 array over a shared mapping of nbytes of the memfd fd, from
    offset (a multiple of the page size).  MemoryError(errno, text) if the
    system refuses it.  Not mmap.mmap: it keeps a duplicate of fd open for
    as long as any array views it, so a loader's start failure or close
    would leave it."""
    cdef ArenaMap m = ArenaMap.__new__(ArenaMap)
    m.open(fd, nbytes, None, offset)
    cdef cnp.npy_intp dims = nbytes
    arr = cnp.PyArray_SimpleNewFromData(1, &dims, cnp.NPY_UINT8, m.addr)
    cnp.set_array_base(arr, m)
    return arr


@cython.no_gc_clear
cdef class KeptRun:
    """Pages of an evicted slab the user still holds, now private at the
    same addresses; they go when the last leaf in them dies."""

    cdef ArenaMap map
    cdef Py_ssize_t index

    def __dealloc__(self):
        if self.map is not None:
            self.map.run_gone(self.index)


cdef class LeaseBook:
    """Main's record of the slabs handed to the user.  view(slab) gives a
    SlabLease; slicing it gives a leaf's uint8 array, and every array made
    from that keeps the leaf's lease (and so the slab's) alive.  When the
    last leaf of a slab dies the slab is released: its generation stored
    into released[lease] (the batcher may reuse the slab once it sees
    that) and the batcher's bell rung.  evict() moves what the user still
    holds out of the pool (NOTE [ Kept batch memory ]).

    After close(), the arena's pages that no held slab uses are given back
    at once (punched out of the memfd: gone in every process that maps
    them, a later loader's children included), and each held slab's pages
    go back when it is dropped.

    Only the process that made the book touches the shared state; in a
    forked child its leases are the child's own business."""

    cdef object released_array, bell
    cdef ArenaMap map                # where new slabs are viewed
    cdef ArenaFile file
    cdef Py_ssize_t arena_bytes
    cdef int64_t *released
    cdef Py_ssize_t max_leases
    cdef Py_ssize_t *held_offset     # per lease; held_bytes 0: not held
    cdef Py_ssize_t *held_bytes
    cdef PyObject **holder           # per held lease: its SlabLease (borrowed)
    cdef Py_ssize_t nheld            # leases held
    cdef long generation             # _fork_generation of the process that made it
    cdef readonly Py_ssize_t dropped_bytes   # leaves dropped from slabs still held
    cdef readonly Py_ssize_t evicted_slabs, kept_bytes   # all evictions so far
    cdef readonly bint closed
    cdef uint32_t *page_users        # after close: held slabs on each page of the arena
    cdef object __weakref__

    def __cinit__(self):
        self.held_offset = self.held_bytes = NULL
        self.holder = NULL
        self.page_users = NULL

    def __init__(self, int arena_fd, Py_ssize_t arena_bytes, cnp.ndarray released not None,
                 Bell bell not None):
        if released.dtype != np.int64 or not released.flags.c_contiguous or released.ndim != 1:
            raise TypeError("released is a 1-d C-contiguous int64 array")
        self.file = ArenaFile.__new__(ArenaFile)
        self.file.fd = arena_fd  # ours now: it outlives the loader while batches are held
        self.arena_bytes = arena_bytes
        self.generation = _fork_generation
        self.map = self._new_map()
        self.released_array, self.bell = released, bell
        self.released = <int64_t *>cnp.PyArray_DATA(released)
        self.max_leases = released.shape[0]
        self.held_offset = <Py_ssize_t *>calloc(self.max_leases, sizeof(Py_ssize_t))
        self.held_bytes = <Py_ssize_t *>calloc(self.max_leases, sizeof(Py_ssize_t))
        self.holder = <PyObject **>calloc(self.max_leases, sizeof(PyObject *))
        if self.held_offset == NULL or self.held_bytes == NULL or self.holder == NULL:
            raise MemoryError()
        _books.add(self)

    cdef ArenaMap _new_map(self):
        cdef ArenaMap m = ArenaMap.__new__(ArenaMap)
        m.open(self.file.fd, self.arena_bytes, self.file)
        return m

    cdef inline bint _ours(self) noexcept nogil:
        return self.generation == _fork_generation

    def __dealloc__(self):
        free(self.held_offset)
        free(self.held_bytes)
        free(self.holder)
        free(self.page_users)

    @property
    def held(self):
        """{lease: (offset, nbytes)} of the slabs the user may still hold."""
        return {i: (self.held_offset[i], self.held_bytes[i])
                for i in range(self.max_leases) if self.held_bytes[i]}

    @property
    def address(self) -> int:
        """Where the arena is mapped for new slabs (it moves after evict())."""
        return <size_t>self.map.addr

    def view(self, Py_ssize_t lease, int64_t generation, Py_ssize_t offset, Py_ssize_t nbytes):
        """The SlabLease of a slab: slice it for its leaves' arrays."""
        if not 0 <= lease < self.max_leases:
            raise IndexError(f"lease {lease} out of range (0..{self.max_leases - 1})")
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.arena_bytes:
            raise ValueError(f"slab [{offset}, {offset + nbytes}) is not inside the arena "
                             f"of {self.arena_bytes} bytes")
        if self.closed:
            raise RuntimeError("the loader is closed: no more batches")
        if not self._ours():
            raise RuntimeError("this loader's batches belong to the process that made it")
        if self.held_bytes[lease]:
            raise RuntimeError(f"lease {lease} is already held")
        cdef SlabLease slab = SlabLease.__new__(SlabLease)
        slab.book, slab.map, slab.lease, slab.generation = self, self.map, lease, generation
        slab.offset, slab.nbytes = offset, nbytes
        self.held_offset[lease], self.held_bytes[lease] = offset, nbytes
        self.holder[lease] = <PyObject *>slab
        self.nheld += 1
        self.map.held_slabs += 1
        return slab

    cdef void release(self, SlabLease slab) noexcept nogil:
        """The slab's last leaf died (or it was evicted): the pool may reuse it."""
        global _sigint_on_release
        cdef Py_ssize_t lease = slab.lease
        cdef Py_ssize_t offset = self.held_offset[lease], nbytes = self.held_bytes[lease]
        self.held_bytes[lease] = 0
        self.holder[lease] = NULL
        self.nheld -= 1
        self.dropped_bytes -= slab.dropped
        slab.map.slab_gone()
        if not self._ours():
            return  # a forked child's copy: the parent's pool is not the child's to touch
        if _sigint_on_release > 0:
            _sigint_on_release -= 1
            if _sigint_on_release == 0:
                raise_signal(2)  # SIGINT
        if not self.closed:
            # SYNC POINT: release store; the batcher's acquire load of
            # released[lease] (SlabAllocator.reclaim) pairs with it.
            __atomic_store_n64(self.released + lease, slab.generation, __ATOMIC_RELEASE)
            (<Bell>self.bell).ring_c()
            return
        self._discard_unused(offset // PAGE_BYTES, (offset + nbytes - 1) // PAGE_BYTES)
        if self.nheld == 0:
            self.file.close()  # no mapping will be made private any more

    cdef void _discard_unused(self, Py_ssize_t first, Py_ssize_t last) noexcept nogil:
        """After close: one holder fewer on pages first..last; punch each
        run of pages nobody holds any more out of the memfd (the pages go
        in every mapping and process)."""
        cdef Py_ssize_t p, run = -1
        for p in range(first, last + 2):
            if p <= last:
                self.page_users[p] -= 1
            if p <= last and self.page_users[p] == 0:
                if run < 0:
                    run = p
            elif run >= 0:
                leases_punch(self.file.fd, run * PAGE_BYTES, (p - run) * PAGE_BYTES)
                run = -1

    # --- eviction: NOTE [ Kept batch memory ] -------------------------------------------

    def evict(self, bint partial_only=False):
        """Move every held slab's live leaves out of the pool (or only those
        of slabs some leaf of which was dropped), release the slabs, and
        view new slabs through a fresh mapping.  Returns (slabs evicted,
        bytes moved).  Raises MemoryError when the system refuses the
        private pages; the slabs not moved stay held, every leaf keeps its
        values, and a later call moves them."""
        if self.closed or not self._ours():
            return 0, 0
        return self._evict(partial_only)

    cdef move_all_out(self):
        """Before a fork (NOTE [ Kept batch memory ]): every held slab, also
        after close()."""
        if self.nheld and self._ours():
            self._evict(False)

    cdef _evict(self, bint partial_only):
        cdef Py_ssize_t lease, slabs = 0, moved = 0
        cdef SlabLease slab
        candidates = []
        for lease in range(self.max_leases):
            if self.holder[lease] != NULL:
                slab = <SlabLease>self.holder[lease]
                if slab.dropped or not partial_only:
                    candidates.append(slab)
        if not candidates:
            return 0, 0
        old = self.map
        if not old.private and any((<SlabLease>s).map is old for s in candidates):
            # New slabs are viewed elsewhere from now on.  Each step leaves
            # everything as it was if it fails.
            fresh = None if self.closed else self._new_map()
            old.make_private()
            if fresh is not None:
                self.map = fresh
            old.current = False
        try:
            for slab in candidates:
                moved += slab.evict()
                slabs += 1
        finally:
            self.evicted_slabs += slabs
            self.kept_bytes += moved
            old.retire_if_unused()
        return slabs, moved

    def close(self):
        """Give back every page of the arena that no held slab uses; the
        others go back as their slabs are dropped."""
        if self.closed:
            return
        if not self._ours():
            self.closed = True
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
        if self.nheld == 0:
            self.file.close()


@cython.no_gc_clear  # its book must still be there when it is deallocated
cdef class SlabLease:
    """One slab handed to main (see LeaseBook.view).  slab[a:b] is the
    uint8 array of bytes a..b, leased as one leaf."""

    cdef LeaseBook book
    cdef ArenaMap map
    cdef Py_ssize_t lease, offset, nbytes
    cdef int64_t generation
    cdef bint evicted
    cdef Py_ssize_t dropped          # bytes of its leaves that died while it was held
    cdef PyObject *leaves            # its live LeafLeases, linked (borrowed)

    @property
    def nbytes(self):
        return self.nbytes

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a slab is sliced with [start:stop]")
        cdef Py_ssize_t start, stop
        start, stop, _ = key.indices(self.nbytes)
        stop = max(start, stop)
        cdef LeafLease leaf = self._leaf(start, stop - start)
        cdef cnp.npy_intp dims = stop - start
        arr = cnp.PyArray_SimpleNewFromData(1, &dims, cnp.NPY_UINT8, leaf.addr)
        # The base of every array viewing this one (numpy stops collapsing
        # .base chains at a non-array): the leaf's lease lives as long as any of them.
        cnp.set_array_base(arr, leaf)
        return arr

    def arrays(self, tuple leaves):
        """The arrays of a batch's array leaves, in one call (a cached
        Materializer's leaf plan): leaves holds (start, nbytes, dtype, shape) per leaf,
        each array views bytes start..start + nbytes of the slab as dtype
        and shape (C order), and each is leased as one leaf, as slab[a:b]
        is.  Equivalent to slab[a:b].view(dtype).reshape(shape), without
        the two intermediate arrays."""
        cdef list out = []
        cdef Py_ssize_t start, nbytes, i, nd, items
        cdef cnp.npy_intp dims[32]
        cdef cnp.dtype dt
        cdef LeafLease leaf
        for start, nbytes, dt, shape in leaves:
            nd = len(shape)
            if nd > 32:
                raise ValueError(f"a leaf of {nd} dimensions (numpy allows 32)")
            items = 1
            for i in range(nd):
                dims[i] = shape[i]
                items *= dims[i]
            if start < 0 or nbytes < 0 or start + nbytes > self.nbytes or \
                    items * dt.itemsize != nbytes:
                raise ValueError(f"leaf [{start}, {start + nbytes}) as {dt} {tuple(shape)} does "
                                 f"not fit the slab of {self.nbytes} bytes")
            leaf = self._leaf(start, nbytes)
            Py_INCREF(dt)  # PyArray_NewFromDescr steals a reference
            arr = _new_from_descr(<void *>np.ndarray, <void *>dt, <int>nd, dims, NULL,
                                  <void *>leaf.addr, cnp.NPY_ARRAY_CARRAY, NULL)
            cnp.set_array_base(arr, leaf)  # as in __getitem__
            out.append(arr)
        return out

    cdef LeafLease _leaf(self, Py_ssize_t start, Py_ssize_t nbytes):
        """A new leaf lease over bytes start..start + nbytes, linked in."""
        if self.evicted:
            raise RuntimeError("this slab went back to the pool: no new views of it")
        cdef LeafLease leaf = LeafLease.__new__(LeafLease)
        leaf.slab = self
        leaf.addr = self.map.addr + self.offset + start
        leaf.nbytes = nbytes
        leaf.prev, leaf.next = NULL, self.leaves
        if self.leaves != NULL:
            (<LeafLease>self.leaves).prev = <PyObject *>leaf
        self.leaves = <PyObject *>leaf
        return leaf

    cdef Py_ssize_t evict(self) except -1:
        """Steps 2 and 3 of NOTE [ Kept batch memory ] (its mapping is
        private already): the live leaves' pages made this process's own,
        then the slab released.  Returns the bytes moved.  If the system
        refuses the pages, MemoryError, and the slab stays held."""
        cdef list spans = [], leaves = []
        cdef LeafLease leaf
        cdef PyObject *p = self.leaves
        while p != NULL:
            leaf = <LeafLease>p
            if leaf.nbytes:
                spans.append((_page_down(<size_t>leaf.addr), _page_up(<size_t>leaf.addr + leaf.nbytes),
                              len(leaves)))
                leaves.append(leaf)
            p = leaf.next
        spans.sort()
        cdef list runs = []              # (start, end, first span, last span + 1)
        cdef Py_ssize_t start, end, i = 0, j
        while i < len(spans):
            start, end = spans[i][0], spans[i][1]
            j = i + 1
            while j < len(spans) and spans[j][0] < end:  # overlapping pages: one run
                end = max(end, spans[j][1])
                j += 1
            runs.append((start, end, i, j))
            i = j
        for start, end, _, _ in runs:    # all or nothing: the slab is released only after
            _own_pages(<char *>start, end - start)
        cdef Py_ssize_t moved = 0
        cdef KeptRun kept
        for start, end, i, j in runs:
            kept = KeptRun.__new__(KeptRun)
            kept.map, kept.index = self.map, self.map.add_run(<char *>start, end - start)
            for k in range(i, j):
                (<LeafLease>leaves[spans[k][2]]).run = kept
            moved += end - start
        self.evicted = True
        self.book.release(self)
        return moved

    cdef void leaf_gone(self, LeafLease leaf) noexcept:
        if leaf.prev != NULL:
            (<LeafLease>leaf.prev).next = leaf.next
        else:
            self.leaves = leaf.next
        if leaf.next != NULL:
            (<LeafLease>leaf.next).prev = leaf.prev
        if self.leaves != NULL and not self.evicted:  # others still held: count the drop
            self.dropped += leaf.nbytes
            self.book.dropped_bytes += leaf.nbytes

    def __dealloc__(self):
        if self.book is not None and not self.evicted and self.book.holder[self.lease] == <PyObject *>self:
            self.book.release(self)


@cython.no_gc_clear
cdef class LeafLease:
    """The base object of one leaf's arrays (see SlabLease.__getitem__)."""

    # Declared in the order they are dropped after __dealloc__: the run
    # (its pages go if this was their last leaf), then the slab (released
    # if this was its last leaf).
    cdef KeptRun run                 # once its slab was evicted: the pages it now lives in
    cdef SlabLease slab
    cdef char *addr
    cdef Py_ssize_t nbytes
    cdef PyObject *prev
    cdef PyObject *next

    def __dealloc__(self):
        if self.slab is not None:
            self.slab.leaf_gone(self)
