# Included by _native.pyx: main's side of the slab leases (see NOTE
# [ ShmLoader processes and shutdown ] in _protocol.py, and NOTE [ Kept
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
# hold a quarter of the cap, main *evicts* the slabs the user still holds:
#
#   for each live leaf: its pages  ─ copy ─►  private pages  ─ mremap(MREMAP_FIXED) ─►
#   the same addresses: every view, tensor and pointer the user holds stays
#   valid and unchanged, and now owns what PyTorch's copy would (a page
#   more per leaf at most); the slab's lease is released at once.
#
# The mapping the evicted slabs were viewed through now has private pages
# where the arena has new batches, so new slabs are viewed through a fresh
# mapping of the arena's memfd (ArenaMap).  An old mapping is *retired*
# once no slab it views is held: everything but the kept runs is unmapped.
# A kept run (KeptRun) dies with its last leaf: unmapped if its mapping is
# retired, else mapped back onto the arena.  Slabs are page-aligned
# (_slabs.py), so a run never holds another slab's bytes.
#
# The copy is paid once per kept region, under pressure only; a loop that
# keeps nothing never evicts, and W1's path is the one view per leaf.
#
# Batches main holds back are kept memory too: one that arrived ahead of
# its turn (in order), or the next epoch's, received while this one ends.
# The batch the loop waits for may need their memory (with a pool of one
# batch it always does), so under MEMORY_WAIT main copies each of them into
# its own memory and gives the slab back at once (Session.copy_out, from
# Runs.copy_out_held); handed out later, its arrays view the copy.  The
# batcher's side of the same rule: NOTE [ Memory goes to batches in order ]
# in _batcher_runs.py.

cimport cython
from cpython.ref cimport PyObject, Py_INCREF
from libc.stdlib cimport calloc, free, malloc, qsort, realloc
from libc.string cimport memcpy

cdef extern from "sys/mman.h" nogil:
    int MADV_REMOVE
    int PROT_READ, PROT_WRITE
    int MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS, MAP_FIXED, MAP_NORESERVE
    int MREMAP_MAYMOVE, MREMAP_FIXED
    void *MAP_FAILED
    int madvise(void *addr, size_t length, int advice)
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    void *mremap(void *old_address, size_t old_size, size_t new_size, int flags, void *new_address)

cdef extern from "unistd.h" nogil:
    int close_fd "close"(int fd)

cdef extern from "numpy/arrayobject.h":
    object _new_from_descr "PyArray_NewFromDescr"(void *subtype, void *descr, int nd,
                                                  cnp.npy_intp *dims, cnp.npy_intp *strides,
                                                  void *data, int flags, void *obj)

cdef extern from "signal.h" nogil:
    int raise_signal "raise"(int sig)

cdef Py_ssize_t PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

# Test hook (tests/loader_layer/test_loader_kill.py): raise SIGINT from inside the N-th
# release, the moment a Ctrl-C is most easily lost.
cdef long _sigint_on_release = 0


def _raise_sigint_on_release(long n):
    global _sigint_on_release
    _sigint_on_release = n


cdef inline Py_ssize_t _page_down(Py_ssize_t x) noexcept nogil:
    return x & ~(PAGE_BYTES - 1)


cdef inline Py_ssize_t _page_up(Py_ssize_t x) noexcept nogil:
    return (x + PAGE_BYTES - 1) & ~(PAGE_BYTES - 1)


cdef struct Run:
    char *addr
    Py_ssize_t nbytes     # 0: dead (mapped back onto the arena)


cdef int _by_addr(const void *a, const void *b) noexcept nogil:
    cdef char *x = (<Run *>a).addr
    cdef char *y = (<Run *>b).addr
    return -1 if x < y else (1 if x > y else 0)


cdef class ArenaFile:
    """The arena's memfd in main (a duplicate), shared by the book and its
    mappings, so that closing it is seen by every mapping at once."""

    cdef int fd

    def __cinit__(self):
        self.fd = -1

    cdef void close(self) noexcept:
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
    cdef ArenaFile file            # None: not to be mapped again (arena_array)
    cdef Py_ssize_t held_slabs    # slabs viewed here, held and not evicted
    cdef bint current             # new slabs are viewed here
    cdef bint retired             # only its kept runs are still mapped
    cdef Run *runs
    cdef Py_ssize_t nruns, cap_runs

    def __cinit__(self):
        self.addr = NULL
        self.runs = NULL

    cdef int open(self, int fd, Py_ssize_t nbytes, ArenaFile file) except -1:
        cdef void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, f"cannot map the batch arena ({nbytes} bytes): "
                                 f"{os.strerror(errno)}")
        self.addr, self.nbytes, self.file, self.current = <char *>p, nbytes, file, True
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
        if self.retired:
            munmap(r.addr, r.nbytes)
        elif self.file is not None and self.file.fd >= 0:
            # Map the arena back under it, so the mapping is whole again
            # when it is retired (unmapped around the live runs).
            mmap(r.addr, r.nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_NORESERVE,
                 self.file.fd, r.addr - self.addr)
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
        self.retired = True
        memcpy(by_addr, self.runs, self.nruns * sizeof(Run))
        qsort(by_addr, self.nruns, sizeof(Run), _by_addr)
        cdef char *at = self.addr
        cdef Py_ssize_t i
        for i in range(self.nruns):
            if by_addr[i].nbytes == 0:
                continue
            if by_addr[i].addr > at:
                munmap(at, by_addr[i].addr - at)
            at = by_addr[i].addr + by_addr[i].nbytes
        free(by_addr)
        if self.addr + self.nbytes > at:
            munmap(at, self.addr + self.nbytes - at)

    def __dealloc__(self):
        # Every kept run holds its mapping, so none is alive here.
        if self.addr != NULL and not self.retired:
            munmap(self.addr, self.nbytes)
        free(self.runs)


def arena_array(int fd, Py_ssize_t nbytes):
    """A uint8 array over a shared mapping of the memfd fd (nbytes long).
    Not mmap.mmap: it keeps a duplicate of fd open for as long as any
    array views it, so a loader's start failure or close would leave it."""
    cdef ArenaMap m = ArenaMap.__new__(ArenaMap)
    m.open(fd, nbytes, None)
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
    at once (MADV_REMOVE, in every process that maps them: a later
    loader's children inherit the mapping), and each held slab's pages go
    back when it is dropped."""

    cdef object released_array, bell
    cdef ArenaMap map                # where new slabs are viewed
    cdef ArenaFile file
    cdef Py_ssize_t arena_bytes
    cdef int64_t *released
    cdef Py_ssize_t max_leases
    cdef Py_ssize_t *held_offset     # per lease; held_bytes 0: not held
    cdef Py_ssize_t *held_bytes
    cdef PyObject **holder           # per held lease: its SlabLease (borrowed)
    cdef readonly Py_ssize_t dropped_bytes   # leaves dropped from slabs still held
    cdef readonly Py_ssize_t evicted_slabs, kept_bytes   # all evictions so far
    cdef readonly bint closed
    cdef uint32_t *page_users        # after close: held slabs on each page of the arena

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
        self.map = self._new_map()
        self.released_array, self.bell = released, bell
        self.released = <int64_t *>cnp.PyArray_DATA(released)
        self.max_leases = released.shape[0]
        self.held_offset = <Py_ssize_t *>calloc(self.max_leases, sizeof(Py_ssize_t))
        self.held_bytes = <Py_ssize_t *>calloc(self.max_leases, sizeof(Py_ssize_t))
        self.holder = <PyObject **>calloc(self.max_leases, sizeof(PyObject *))
        if self.held_offset == NULL or self.held_bytes == NULL or self.holder == NULL:
            raise MemoryError()

    cdef ArenaMap _new_map(self):
        cdef ArenaMap m = ArenaMap.__new__(ArenaMap)
        m.open(self.file.fd, self.arena_bytes, self.file)
        return m

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
        if self.held_bytes[lease]:
            raise RuntimeError(f"lease {lease} is already held")
        cdef SlabLease slab = SlabLease.__new__(SlabLease)
        slab.book, slab.map, slab.lease, slab.generation = self, self.map, lease, generation
        slab.offset, slab.nbytes = offset, nbytes
        self.held_offset[lease], self.held_bytes[lease] = offset, nbytes
        self.holder[lease] = <PyObject *>slab
        self.map.held_slabs += 1
        return slab

    cdef void release(self, SlabLease slab) noexcept nogil:
        """The slab's last leaf died (or it was evicted): the pool may reuse it."""
        global _sigint_on_release
        cdef Py_ssize_t lease = slab.lease
        cdef Py_ssize_t offset = self.held_offset[lease], nbytes = self.held_bytes[lease]
        self.held_bytes[lease] = 0
        self.holder[lease] = NULL
        self.dropped_bytes -= slab.dropped
        slab.map.slab_gone()
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

    cdef void _discard_unused(self, Py_ssize_t first, Py_ssize_t last) noexcept nogil:
        """After close: one holder fewer on pages first..last; give back
        each run of pages nobody holds any more (through the current
        mapping, shared: the pages go in every mapping and process)."""
        cdef Py_ssize_t p, run = -1
        for p in range(first, last + 2):
            if p <= last:
                self.page_users[p] -= 1
            if p <= last and self.page_users[p] == 0:
                if run < 0:
                    run = p
            elif run >= 0:
                madvise(self.map.addr + run * PAGE_BYTES, (p - run) * PAGE_BYTES, MADV_REMOVE)
                run = -1

    # --- eviction: NOTE [ Kept batch memory ] -------------------------------------------

    def evict(self, bint partial_only=False):
        """Move every held slab's live leaves out of the pool (or only those
        of slabs some leaf of which was dropped), release the slabs, and
        view new slabs through a fresh mapping.  Returns (slabs evicted,
        bytes copied).  Raises MemoryError when the system refuses the
        private pages (the slabs not moved yet stay held)."""
        cdef Py_ssize_t lease, slabs = 0, copied = 0
        cdef SlabLease slab
        if self.closed:
            return 0, 0
        candidates = []
        for lease in range(self.max_leases):
            if self.holder[lease] != NULL:
                slab = <SlabLease>self.holder[lease]
                if slab.dropped or not partial_only:
                    candidates.append(slab)
        if not candidates:
            return 0, 0
        old = self.map
        if any((<SlabLease>s).map is old for s in candidates):
            # Its evicted pages will be private: new slabs are viewed elsewhere.
            # First, so that a failure below leaves the old mapping unused.
            self.map = self._new_map()
            old.current = False
        try:
            for slab in candidates:
                copied += slab.evict()
                slabs += 1
        finally:
            self.evicted_slabs += slabs
            self.kept_bytes += copied
            old.retire_if_unused()
        return slabs, copied

    def close(self):
        """Give back every page of the arena that no held slab uses; the
        others go back as their slabs are dropped."""
        if self.closed:
            return
        # No mapping is made after close, and none holds the fd open: a kept
        # run that dies now keeps its pages until its mapping goes (run_gone).
        self.file.close()
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
        """Copy the pages of the live leaves to private memory at the same
        addresses, then release the slab; returns the bytes copied."""
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
        cdef Py_ssize_t copied = 0, start, end, i = 0
        while i < len(spans):
            start, end = spans[i][0], spans[i][1]
            j = i + 1
            while j < len(spans) and spans[j][0] < end:  # overlapping pages: one run
                end = max(end, spans[j][1])
                j += 1
            run = self._keep(<char *>start, end - start)
            for k in range(i, j):
                (<LeafLease>leaves[spans[k][2]]).run = run
            copied += end - start
            i = j
        self.evicted = True
        self.book.release(self)
        return copied

    cdef KeptRun _keep(self, char *addr, Py_ssize_t nbytes):
        cdef void *fresh = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                                -1, 0)
        if fresh == MAP_FAILED:
            raise MemoryError(f"ShmLoader: cannot move {nbytes} bytes of a batch you hold out of "
                              f"the pool ({os.strerror(errno)}); drop batches you no longer need, "
                              f"or copy what you keep")
        memcpy(fresh, addr, nbytes)
        if mremap(fresh, nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED, addr) == MAP_FAILED:
            err = errno
            munmap(fresh, nbytes)
            raise MemoryError(f"ShmLoader: cannot move {nbytes} bytes of a batch you hold out of "
                              f"the pool ({os.strerror(err)}; a process may hold at most "
                              f"vm.max_map_count mappings, one per kept region): drop batches "
                              f"you no longer need, or copy what you keep")
        cdef KeptRun run = KeptRun.__new__(KeptRun)
        run.map, run.index = self.map, self.map.add_run(addr, nbytes)
        return run

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
