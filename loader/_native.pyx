# The loader's compiled pieces: what must run as C (a signal handler that
# works while the process is inside any C call) or per sample.
#
# Compiler directives are set in setup.py.

cdef extern from *:
    """
    #include <signal.h>
    #include <string.h>
    #include <sys/prctl.h>
    #include <unistd.h>

    static volatile pid_t loader_parent_pid = 0;

    /* PR_SET_PDEATHSIG fires when the *thread* that forked this process
     * exits, and again each time the child is re-parented.  Only a parent
     * process that is really gone (getppid() changed: re-parented to init
     * or a subreaper) ends the child.  getppid and _exit are
     * async-signal-safe. */
    static void loader_on_parent_death(int sig) {
        (void)sig;
        if (getppid() != loader_parent_pid) _exit(1);
    }

    static int loader_die_with_parent(pid_t parent, int sig) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = loader_on_parent_death;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        loader_parent_pid = parent;
        if (sigaction(sig, &sa, NULL) != 0) return -1;
        if (prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0) return -1;
        if (getppid() != parent) _exit(1);  /* it died before prctl took effect */
        return 0;
    }
    """
    int loader_die_with_parent(int parent, int sig) nogil

from libc.errno cimport ENOMEM, errno
import os

import numpy as np


def die_with_parent(int parent_pid, int sig):
    """End this process at once when parent_pid, its parent process, dies
    (not when the parent's thread that forked it ends): see the C above."""
    if loader_die_with_parent(parent_pid, sig) != 0:
        raise OSError(errno, f"cannot ask to die with the parent process: {os.strerror(errno)}")


# --- bells ---------------------------------------------------------------------

cimport numpy as cnp
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int32_t, uint32_t, uint64_t

from shmq.sync cimport SHMQ_WAKE_ALL, shmq_word_wait, shmq_word_wake

cdef extern from *:
    int32_t __atomic_load_n(int32_t *ptr, int memorder) nogil
    int32_t __atomic_fetch_add(int32_t *ptr, int32_t val, int memorder) nogil
    int __ATOMIC_ACQUIRE
    int __ATOMIC_SEQ_CST

cnp.import_array()


cdef class Bell:
    """An eventcount on two int32 words of a shared array: a sequence and
    the number of sleepers (the pattern of shmq_sync.h).  ring() after
    changing what a sleeper waits for; wait(ready, timeout) sleeps until
    ready() holds, a ring, or timeout seconds.

    One futex wait per call, for the whole timeout: the loader's children
    ignore Ctrl-C, and a signal meant for this thread interrupts the wait
    (Python handlers then run before ready() is checked again)."""

    cdef object words          # keeps the shared array alive
    cdef int32_t *seq
    cdef int32_t *sleepers

    def __init__(self, cnp.ndarray words not None, Py_ssize_t index):
        if words.dtype != np.int32 or not words.flags.c_contiguous or words.ndim != 1:
            raise TypeError("a Bell lives in a 1-d C-contiguous int32 array")
        if not 0 <= index < words.shape[0] - 1:
            raise IndexError(f"a Bell needs words {index} and {index + 1} of {words.shape[0]}")
        self.words = words
        self.seq = <int32_t *>cnp.PyArray_DATA(words) + index
        self.sleepers = self.seq + 1

    def __reduce__(self):
        # For start_method="spawn": the words travel by their memfd
        # (NOTE [ Starting clean ] in shared/passable.py), so the Bell
        # rebuilt there rings the same words.
        return (Bell, (self.words, <Py_ssize_t>(self.seq - <int32_t *>cnp.PyArray_DATA(self.words))))

    def ring(self):
        self.ring_c()

    cdef void ring_c(self) noexcept nogil:
        # SYNC POINT: the seq_cst read-modify-write pairs with the sleeper's
        # announcement in wait() (Dekker): either it sees our change or we
        # see it and wake it.
        if __atomic_fetch_add(self.sleepers, 0, __ATOMIC_SEQ_CST):
            __atomic_fetch_add(self.seq, 1, __ATOMIC_SEQ_CST)
            shmq_word_wake(<uint32_t *>self.seq, SHMQ_WAKE_ALL)

    def wait(self, ready, double timeout):
        """ready() at least once; True if it held when this returned."""
        cdef int32_t seq = __atomic_load_n(self.seq, __ATOMIC_ACQUIRE)
        cdef uint64_t ns = <uint64_t>(max(timeout, 0.0) * 1e9)
        __atomic_fetch_add(self.sleepers, 1, __ATOMIC_SEQ_CST)  # SYNC POINT: announce, re-check
        try:
            if ready():
                return True
            with nogil:
                shmq_word_wait(<uint32_t *>self.seq, <uint32_t>seq, ns)
            PyErr_CheckSignals()
        finally:
            __atomic_fetch_add(self.sleepers, -1, __ATOMIC_SEQ_CST)
        return bool(ready())


include "native/warm.pxi"
include "native/rowwriter.pxi"
include "native/leases.pxi"
include "native/permutation.pxi"


cdef class RunCounters:
    """A worker's hot path into the ctl words of NOTE [ Runs ]: claiming the
    next unit of a run and checking main's limit, without Python calls.
    The word layout comes from shared/control.py (RUN_LAYOUT: one source)."""

    cdef object ctl_array
    cdef int64_t *ctl
    cdef Py_ssize_t n, base, words, cursor, limit, arrived, shift

    def __init__(self, cnp.ndarray ctl not None, layout):
        """layout: _control.RUN_LAYOUT (a RunWordLayout)."""
        if ctl.dtype != np.int64 or not ctl.flags.c_contiguous or ctl.ndim != 1:
            raise TypeError("ctl is a 1-d C-contiguous int64 array")
        if layout.base + 2 * layout.words > ctl.shape[0]:
            raise IndexError("ctl is too short for two run blocks")
        self.ctl_array = ctl
        self.ctl = <int64_t *>cnp.PyArray_DATA(ctl)
        self.base, self.words = layout.base, layout.words
        self.cursor, self.limit, self.arrived = layout.cursor, layout.limit, layout.arrived
        self.shift = layout.shift

    cdef inline int64_t *_word(self, int64_t run, Py_ssize_t which):
        return self.ctl + self.base + (run % 2) * self.words + which

    def claim(self, int64_t run, bint arrival=False):
        """The next value of the run's CURSOR (or ARRIVED), or -1 once the
        run ended: then nothing is taken."""
        cdef int64_t *w = self._word(run, self.arrived if arrival else self.cursor)
        cdef int64_t *cursor = self._word(run, self.cursor)
        cdef int64_t v
        while True:
            v = __atomic_load_n64(w, __ATOMIC_ACQUIRE)
            if (v >> self.shift) != run:
                return -1
            if arrival and (__atomic_load_n64(cursor, __ATOMIC_ACQUIRE) >> self.shift) != run:
                return -1
            if __atomic_compare_exchange_n64(w, &v, v + 1, False, __ATOMIC_SEQ_CST,
                                             __ATOMIC_SEQ_CST):
                return v & ((<int64_t>1 << self.shift) - 1)

    def below_limit(self, int64_t run, int64_t unit):
        return unit < __atomic_load_n64(self._word(run, self.limit), __ATOMIC_ACQUIRE)


# --- per-sample seeds (reproducible=True) -------------------------------------

cdef inline uint64_t _splitmix64(uint64_t x) noexcept nogil:
    # Steele, Lea and Flood's SplitMix64 finaliser: a bijection of 64-bit
    # words whose outputs for neighbouring inputs are uncorrelated.
    x += 0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


def derived_seeds(uint64_t seed, uint64_t epoch, uint64_t stream, uint64_t item):
    """Three independent seeds for (seed, epoch, stream, item): for Python's
    random (63 bits), numpy's global generator (32 bits: what
    np.random.seed takes as one word) and torch's (63 bits).  Each comes
    from hashing the four numbers in a chain with a different salt, so the
    three generators never start from related states (seeding them all
    with one number would make torch's and numpy's Mersenne Twisters
    produce the same stream)."""
    cdef uint64_t h = _splitmix64(_splitmix64(_splitmix64(_splitmix64(seed) ^ epoch) ^ stream) ^ item)
    return (<int64_t>(_splitmix64(h ^ 1) >> 1),
            <uint32_t>(_splitmix64(h ^ 2) >> 32),
            <int64_t>(_splitmix64(h ^ 3) >> 1))


# --- a stream's rows (ShmLoader iterable datasets) ---------------------------------

from libc.stdlib cimport malloc


cdef class StreamSlots:
    """Where a stream's next sample goes: (batch number, row).

    In order (depth 0): batch j's rows 0..rows-1, then j + 1's.

    With a shuffle buffer (depth > 0): a random free row of a window of
    this worker's pending batches, so batches complete as random mixes of
    the stream and no sample is copied twice: the window is the shuffle
    buffer, and it lives in the slabs.  The window spans `depth` batch
    numbers from its lowest incomplete batch: a batch opens when the
    lowest completes, never further, so the batches in flight stay within
    the batch table's reach and main (which takes a stream's batches in
    order) is never kept waiting by a batch the worker stopped filling.
    The draws come from SplitMix64 seeded with `seed` (from the loader's
    seed, the epoch and the worker), so the batches depend on the stream
    alone, not on timing.

    `room(j)` is called before batch j opens; it waits for main's limit
    and returns False if the run ended."""

    cdef int64_t rows, depth, current, next_j, row
    cdef object room
    cdef int64_t *free          # slots j * rows + r, unordered
    cdef Py_ssize_t nfree, cap
    cdef int32_t *left          # rows still free in batch j, at j % depth
    cdef uint64_t state
    cdef readonly int64_t opened

    def __cinit__(self):
        self.free = NULL
        self.left = NULL

    def __dealloc__(self):
        free(self.free)
        free(self.left)

    def __init__(self, int64_t first, int64_t rows, int64_t depth, uint64_t seed, room):
        self.rows, self.depth, self.room = rows, depth, room
        self.current = self.next_j = first
        self.row = rows  # in order: the first call opens batch `first`
        self.state = seed
        self.nfree = 0
        if depth:
            self.cap = depth * rows
            self.free = <int64_t *>malloc(self.cap * sizeof(int64_t))
            self.left = <int32_t *>calloc(depth, sizeof(int32_t))
            if self.free == NULL or self.left == NULL:
                raise MemoryError()

    cdef inline uint64_t _draw(self) noexcept nogil:
        self.state += 0x9E3779B97F4A7C15ULL
        cdef uint64_t z = self.state
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
        return z ^ (z >> 31)

    def next(self):
        """(batch number, row) for the next sample, or None if the run ended."""
        cdef Py_ssize_t k, r
        cdef int64_t slot, j
        if not self.depth:
            if self.row == self.rows:
                if not self.room(self.next_j):
                    return None
                self.current, self.row = self.next_j, 0
                self.next_j += 1
            self.row += 1
            return self.current, self.row - 1
        while self.next_j < self.current + self.depth:
            if not self.room(self.next_j):
                return None
            j = self.next_j
            self.left[j % self.depth] = <int32_t>self.rows
            for r in range(self.rows):
                self.free[self.nfree] = j * self.rows + r
                self.nfree += 1
            self.next_j += 1
        k = <Py_ssize_t>(self._draw() % <uint64_t>self.nfree)
        slot = self.free[k]
        self.nfree -= 1
        self.free[k] = self.free[self.nfree]
        j = slot // self.rows
        self.left[j % self.depth] -= 1
        if self.left[j % self.depth] == 0 and j == self.current:
            # the lowest completed: the window moves up to the next incomplete
            while self.current < self.next_j and self.left[self.current % self.depth] == 0:
                self.current += 1
        return j, slot - j * self.rows

    @property
    def current(self):
        """The lowest batch number still being filled."""
        return self.current

    def written(self) -> int:
        """Rows written into batches not yet full: what a stream's end
        leaves (in order, its short last batch; shuffled, rows to close up)."""
        cdef int64_t j, n = 0
        if not self.depth:
            return self.row if self.row < self.rows else 0
        for j in range(self.current, self.next_j):
            if self.left[j % self.depth]:
                n += self.rows - self.left[j % self.depth]
        return n
