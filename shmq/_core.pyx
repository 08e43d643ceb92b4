# The compiled half of shmq: owns the mapping, encodes and decodes records,
# runs the bounded wait loops without the GIL, and maps every C status to an
# exception in one place (_raise_status).  The layout and the lock-free
# algorithm live in shmq_ring.h; the ergonomic API lives in queue.py.
#
# Compiler directives are set in setup.py; the hot functions below add
# boundscheck/wraparound off where a reader sees them.

cimport cython
cimport numpy as cnp
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.errno cimport errno
from libc.string cimport memcpy
from posix.mman cimport (mmap, munmap, MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_PRIVATE,
                         MAP_SHARED, PROT_NONE, PROT_READ, PROT_WRITE)
from posix.signal cimport kill
from posix.unistd cimport getpid

from shmq._ring cimport *

import math
import os
import pickle
import time
import warnings

import numpy as np

from shmq import codec
from shmq.errors import (Closed, Empty, Full, IncompatibleRing, MessageTooLarge, PeerLost,
                         ShmqError)

cnp.import_array()

cdef extern from "sys/mman.h" nogil:
    int MAP_POPULATE
    int MAP_NORESERVE

cdef extern from *:
    """
    #include <sys/mman.h>
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23  /* Linux 5.14 */
    #endif
    """
    int MADV_POPULATE_WRITE
    int MADV_REMOVE
    int madvise(void *addr, size_t length, int advice) nogil

cdef extern from *:
    int __ATOMIC_SEQ_CST

cdef extern from "signal.h" nogil:
    int SIGKILL

cdef extern from "numpy/arrayobject.h":
    # Steals a reference to descr (callers Py_INCREF first).
    object PyArray_NewFromDescr(PyTypeObject *subtype, cnp.PyArray_Descr *descr, int nd,
                                cnp.npy_intp *dims, cnp.npy_intp *strides, void *data,
                                int flags, object obj)
    # Steals a reference to descr.
    object PyArray_Empty(int nd, cnp.npy_intp *dims, cnp.PyArray_Descr *descr, int fortran)

# Longest time a blocked call stays inside C before it re-checks signals,
# closed flags and peer liveness (Ctrl-C, dead peers are noticed this fast).
cdef uint64_t WAIT_SLICE_NS = 100_000_000
# Copies at least this large run without the GIL.
cdef uint64_t NOGIL_COPY_BYTES = 1 << 16

MAX_NDIM = SHMQ_MAX_NDIM
MIN_CAPACITY = SHMQ_MIN_CAPACITY
MAX_CAPACITY = SHMQ_MAX_CAPACITY
HEADER_BYTES = sizeof(shmq_header)

_FIELD_NAMES = {
    SHMQ_FIELD_MAGIC: "magic",
    SHMQ_FIELD_VERSION: "version",
    SHMQ_FIELD_FLAGS: "flags",
    SHMQ_FIELD_CAPACITY: "capacity_bytes",
    SHMQ_FIELD_OFFSETS: "region offsets",
    SHMQ_FIELD_FILE_SIZE: "file size",
    SHMQ_FIELD_POSITIONS: "head_pos/tail_pos",
    SHMQ_FIELD_RECORD_BYTES: "record_bytes",
    SHMQ_FIELD_MAX_ATTACH: "max_attach",
    SHMQ_FIELD_ROLE_SLOT: "consumer_slot/producer_slot",
    SHMQ_FIELD_CONSUMER_SLOT: "consumer_slot",
    SHMQ_FIELD_PRODUCER_SLOT: "producer_slot",
    SHMQ_FIELD_CLAIM: "claim_bytes",
}


def layout_offsets():
    """Sizes and field offsets as this build sees them (from shmq_ring.h);
    tests use them instead of hard-coding any offset."""
    cdef shmq_header h
    cdef shmq_slot s
    cdef shmq_record rec
    cdef shmq_array_meta am
    cdef shmq_tree_meta tm
    hb, sb, rb, ab, tb = <size_t>&h, <size_t>&s, <size_t>&rec, <size_t>&am, <size_t>&tm
    return {
        "header_bytes": sizeof(shmq_header),
        "slot_bytes": sizeof(shmq_slot),
        "record_header_bytes": sizeof(shmq_record),
        "array_meta_bytes": sizeof(shmq_array_meta),
        "magic": <size_t>&h.magic - hb,
        "version": <size_t>&h.version - hb,
        "flags": <size_t>&h.flags - hb,
        "capacity_bytes": <size_t>&h.capacity_bytes - hb,
        "data_offset": <size_t>&h.data_offset - hb,
        "creator_pid": <size_t>&h.creator_pid - hb,
        "creator_starttime": <size_t>&h.creator_starttime - hb,
        "creator_pidns": <size_t>&h.creator_pidns - hb,
        "tail_pos": <size_t>&h.tail_pos - hb,
        "head_pos": <size_t>&h.head_pos - hb,
        "data_seq": <size_t>&h.data_seq - hb,
        "consumer_slot": <size_t>&h.consumer_slot - hb,
        "producer_slot": <size_t>&h.producer_slot - hb,
        "slots_offset": <size_t>&h.slots_offset - hb,
        "avail_offset": <size_t>&h.avail_offset - hb,
        "max_attach": <size_t>&h.max_attach - hb,
        "consumer_waiting": <size_t>&h.consumer_waiting - hb,
        "space_seq": <size_t>&h.space_seq - hb,
        "space_wanted": <size_t>&h.space_wanted - hb,
        "closed_writers": <size_t>&h.closed_writers - hb,
        "gone_writers": <size_t>&h.gone_writers - hb,
        "skipped_records": <size_t>&h.skipped_records - hb,
        "slot.owner": <size_t>&s.owner - sb,
        "slot.starttime": <size_t>&s.starttime - sb,
        "slot.claim_pos": <size_t>&s.claim_pos - sb,
        "slot.claim_bytes": <size_t>&s.claim_bytes - sb,
        "slot.pending_since_ns": <size_t>&s.pending_since_ns - sb,
        "record.producer_pid": <size_t>&rec.producer_pid - rb,
        "record.record_bytes": <size_t>&rec.record_bytes - rb,
        "record.kind": <size_t>&rec.kind - rb,
        "record.nbuffers": <size_t>&rec.nbuffers - rb,
        "record.meta_bytes": <size_t>&rec.meta_bytes - rb,
        "array.ndim": <size_t>&am.ndim - ab,
        "array.dtype_chars": <size_t>&am.dtype_chars - ab,
        "array.data_offset": <size_t>&am.data_offset - ab,
        "array.data_bytes": <size_t>&am.data_bytes - ab,
        "tree.pickle_offset": <size_t>&tm.pickle_offset - tb,
        "tree.pickle_bytes": <size_t>&tm.pickle_bytes - tb,
        "tree_meta_bytes": sizeof(shmq_tree_meta),
        "buffer_entry_bytes": sizeof(shmq_buffer_entry),
        "claim_owned_bit": SHMQ_CLAIM_OWNED,
        "magic_value": SHMQ_MAGIC,
        "version_value": SHMQ_VERSION,
    }


def segment_bytes(uint64_t capacity, bint mpsc):
    """Total size of a segment holding a ring of this capacity."""
    cdef uint64_t so, ao, dof
    shmq_layout(capacity, mpsc, SHMQ_MAX_ATTACH, &so, &ao, &dof)
    return dof + capacity


STARTTIME_UNKNOWN = SHMQ_STARTTIME_UNKNOWN


def proc_starttime(uint32_t pid):
    """Start time of a live, non-zombie process (clock ticks), or 0."""
    return shmq_proc_starttime(pid)


def self_pidns():
    """This process's pid namespace (NOTE [pid namespaces]), 0 if unknown."""
    return shmq_self_pidns()


def read_creator(bytes header):
    """(creator_pid, creator_starttime, creator_pidns) from the first bytes
    of a segment, or None when they are not a shmq header.  creator_pidns
    is 0 (unknown) in a segment of an earlier layout version, which had no
    such field."""
    cdef const shmq_header *h
    if len(header) < sizeof(shmq_header):
        return None
    h = <const shmq_header *><const char *>header
    if h.magic != SHMQ_MAGIC:
        return None
    return h.creator_pid, h.creator_starttime, (h.creator_pidns if h.version >= 2 else 0)


# --- test-only kill points (R1 in docs/reliability.md; tests/shmq_layer/test_multiprocess.py
# uses them).  Set by SHMQ_KILL_POINT=<point>:<n> at import, or by
# _set_kill_point() in a forked child; the n-th put that reaches the point
# SIGKILLs its own process there.
cdef int KILL_NONE = 0, KILL_AFTER_CLAIM = 1, KILL_MID_COPY = 2, KILL_BEFORE_PUBLISH = 3
cdef int _kill_point = KILL_NONE
cdef long _kill_countdown = 0
_KILL_POINTS = {"after_claim": KILL_AFTER_CLAIM, "mid_copy": KILL_MID_COPY,
                "before_publish": KILL_BEFORE_PUBLISH}


def _set_kill_point(str point, long after_n=1):
    global _kill_point, _kill_countdown
    if point not in _KILL_POINTS:
        raise ValueError(f"unknown kill point {point!r}; choose one of {sorted(_KILL_POINTS)}")
    _kill_point = _KILL_POINTS[point]
    _kill_countdown = after_n


cdef inline void _maybe_die(int point) noexcept nogil:
    global _kill_countdown
    if _kill_point == point:
        _kill_countdown -= 1
        if _kill_countdown <= 0:
            kill(getpid(), SIGKILL)


_env_kill = os.environ.get("SHMQ_KILL_POINT")
if _env_kill:
    _p, _, _n = _env_kill.partition(":")
    _set_kill_point(_p, int(_n or 1))


cdef class Mapping:
    """The process's mapping of one segment, data region mapped twice.

    Arrays returned by get_view()/reserve() hold this object as their base,
    so the memory stays mapped as long as any of them is alive, even after
    the queue handle is closed: a view may go stale, never dangling."""
    cdef uint8_t *base
    cdef size_t length

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.length)
            self.base = NULL

    @staticmethod
    cdef Mapping map_ring(int fd, uint64_t data_offset, uint64_t capacity):
        cdef Mapping m = Mapping.__new__(Mapping)
        cdef size_t total = data_offset + 2 * capacity
        cdef void *res
        cdef void *p
        # Reserve the address range first so the two data mappings are
        # guaranteed to be adjacent, then map the file over it.
        res = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if res == MAP_FAILED:
            raise OSError(errno, f"cannot reserve {total} bytes of address space for the "
                                 f"ring: {os.strerror(errno)}")
        m.base = <uint8_t *>res
        m.length = total
        # MAP_POPULATE pre-faults the page tables: no page fault on the hot path.
        p = mmap(res, data_offset + capacity, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, f"cannot map the shmq segment: {os.strerror(errno)}")
        p = mmap(m.base + data_offset + capacity, capacity, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd, data_offset)
        if p == MAP_FAILED:
            raise OSError(errno, f"cannot map the shmq data region a second time: "
                                 f"{os.strerror(errno)}")
        return m


cdef object _array_over(Mapping owner, void *data, int ndim, cnp.npy_intp *dims, cnp.dtype dtype):
    """A C-contiguous array over mapped memory whose base is the Mapping, so
    the memory stays mapped while the array (or any view of it) lives."""
    Py_INCREF(dtype)  # PyArray_NewFromDescr steals a reference
    arr = PyArray_NewFromDescr(<PyTypeObject *>np.ndarray, <cnp.PyArray_Descr *>dtype, ndim,
                               dims, NULL, data, cnp.NPY_ARRAY_CARRAY, None)
    Py_INCREF(owner)  # PyArray_SetBaseObject steals a reference
    cnp.PyArray_SetBaseObject(arr, owner)
    return arr


def shared_array(shape, dtype=np.uint8):
    """A zero-filled array in anonymous shared memory.

    Processes forked after this call share it; it has no name, so no crash
    can leak it, and it is freed when the last process drops it.  Pages are
    reserved on first touch (MAP_NORESERVE), so a large array costs nothing
    until used; not limited by the size of /dev/shm."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    cdef uint64_t nbytes = dt.itemsize * math.prod(shape)
    cdef Mapping m = Mapping.__new__(Mapping)
    cdef size_t length = max(<uint64_t>1, nbytes)
    cdef void *p = mmap(NULL, length, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if p == MAP_FAILED:
        raise OSError(errno, f"cannot map {nbytes} bytes of shared memory: {os.strerror(errno)}")
    m.base = <uint8_t *>p
    m.length = length
    cdef cnp.npy_intp n = nbytes
    return _array_over(m, p, 1, &n, np.dtype(np.uint8)).view(dt).reshape(shape)


include "_sync.pxi"


def prefault(cnp.ndarray arr not None):
    """Fault in the pages under a writable, C-contiguous array now (one
    madvise(MADV_POPULATE_WRITE) call, or a write per page on kernels older
    than 5.14), so that later writes into fresh shared memory run at memory
    speed instead of paying a page fault every 4 KiB."""
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError("prefault needs a writable C-contiguous array")
    cdef size_t page = os.sysconf("SC_PAGE_SIZE")
    cdef size_t start = <size_t>cnp.PyArray_DATA(arr)
    cdef size_t end = start + <size_t>cnp.PyArray_NBYTES(arr)
    cdef size_t lo = start & ~(page - 1)
    cdef int rc
    if end <= start:
        return
    with nogil:
        rc = madvise(<void *>lo, end - lo, MADV_POPULATE_WRITE)
    if rc != 0:
        flat = arr.reshape(-1).view(np.uint8)
        flat[::page] = flat[::page]  # a write per page faults it in, data unchanged


# dtype <-> dtype.str caches: the hot path must not rebuild either.  A
# dtype maps to b"" when it cannot take the fast path.
cdef dict _dtype_codes = {}
cdef dict _code_dtypes = {}


cdef inline bytes _dtype_code(object dt):
    code = _dtype_codes.get(dt)
    if code is None:
        code = dt.str.encode("ascii") if _fast_path_dtype(dt) else b""
        _dtype_codes[dt] = code
    return code


cdef bint _fast_path_dtype(object dt):
    # dtype.str round-trips exactly for these; structured, sub-array and
    # object dtypes go through the pickle path (which refuses object).
    # Python attribute access on purpose: numpy 2 moved these fields out of
    # the descriptor struct Cython's numpy declarations describe.
    return not dt.hasobject and dt.names is None and dt.subdtype is None and dt.itemsize > 0


cdef cnp.dtype _dtype_from_code(bytes code, Ring ring, uint64_t pos):
    dt = _code_dtypes.get(code)
    if dt is None:
        try:
            # A code from shared memory may be anything: numpy's errors and
            # deprecation warnings for it are this record's problem.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dt = np.dtype(code.decode("ascii"))
        except Exception:
            ring._corrupt(pos, f"unknown dtype code {code!r}")
        if not _fast_path_dtype(dt) or dt.str.encode("ascii") != code:
            ring._corrupt(pos, f"dtype code {code!r} is not a plain numeric/bytes dtype")
        if len(_code_dtypes) >= 4096:
            _code_dtypes.clear()  # corrupt records must not grow it without bound
        _code_dtypes[code] = dt
    return dt


# --- the pickle stream of a TREE record, checked before it is unpickled ----
#
# A tree's structure is a pickle written by codec.encode (protocol 5).  The
# unpickler trusts its input: a 20-byte stream can make it allocate
# gigabytes (LONG_BINPUT 0x40000000 grows the memo to that many entries)
# before any error.  So the consumer first walks the stream opcode by
# opcode, in C, and accepts only what a protocol-5 pickler writes, with
# every length and index bounded by the stream itself:
#   - PROTO 5 first, STOP last and nowhere else;
#   - only opcodes a protocol-5 pickler emits (no text-mode opcodes, no
#     BINPUT/LONG_BINPUT: protocol 5 memoizes with MEMOIZE; no persistent ids);
#   - every argument and every counted string/bytes inside the stream;
#   - BINGET/LONG_BINGET only of memo entries MEMOIZE already made;
#   - exactly nbuffers NEXT_BUFFER opcodes (one per buffer-table entry).
# Then everything the stream itself builds is bounded by its length: at most
# one object per opcode, strings no longer than their bytes.  What the
# stream CALLS (REDUCE/NEWOBJ/BUILD of any importable name) is not bounded:
# a pickle is code.  The trust model (docs/guarantees.md, "Trust") covers that: segments
# are 0600, writable only by the same user, who can run code as us anyway,
# and attach refuses any other (NOTE [ Whose segment ] in segment.py).

cdef enum:
    _A_INVALID = 0, _A_NONE, _A_FIX1, _A_FIX2, _A_FIX4, _A_FIX8,
    _A_LEN1, _A_LEN4, _A_LEN8, _A_LONG4, _A_PROTO, _A_FRAME, _A_STOP, _A_MEMOIZE,
    _A_GET1, _A_GET4, _A_BUFFER

cdef unsigned char _PICKLE_ARGS[256]


cdef void _init_pickle_args():
    cdef int i
    for i in range(256):
        _PICKLE_ARGS[i] = _A_INVALID
    for c in b"(012NRabe}]s)tu":     # MARK POP POP_MARK DUP NONE REDUCE APPEND BUILD
        _PICKLE_ARGS[c] = _A_NONE     # APPENDS EMPTY_DICT EMPTY_LIST SETITEM EMPTY_TUPLE TUPLE SETITEMS
    for c in (0x81, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8f, 0x90, 0x91, 0x92, 0x93, 0x98):
        _PICKLE_ARGS[c] = _A_NONE     # NEWOBJ TUPLE1-3 NEWTRUE NEWFALSE EMPTY_SET ADDITEMS
                                      # FROZENSET NEWOBJ_EX STACK_GLOBAL READONLY_BUFFER
    _PICKLE_ARGS[ord("K")] = _A_FIX1  # BININT1
    _PICKLE_ARGS[0x82] = _A_FIX1      # EXT1
    _PICKLE_ARGS[ord("M")] = _A_FIX2  # BININT2
    _PICKLE_ARGS[0x83] = _A_FIX2      # EXT2
    _PICKLE_ARGS[ord("J")] = _A_FIX4  # BININT
    _PICKLE_ARGS[0x84] = _A_FIX4      # EXT4
    _PICKLE_ARGS[ord("G")] = _A_FIX8  # BINFLOAT
    _PICKLE_ARGS[ord("C")] = _A_LEN1  # SHORT_BINBYTES
    _PICKLE_ARGS[0x8c] = _A_LEN1      # SHORT_BINUNICODE
    _PICKLE_ARGS[0x8a] = _A_LEN1      # LONG1
    _PICKLE_ARGS[ord("B")] = _A_LEN4  # BINBYTES
    _PICKLE_ARGS[ord("X")] = _A_LEN4  # BINUNICODE
    _PICKLE_ARGS[0x8b] = _A_LONG4     # LONG4 (signed length)
    _PICKLE_ARGS[0x8d] = _A_LEN8      # BINUNICODE8
    _PICKLE_ARGS[0x8e] = _A_LEN8      # BINBYTES8
    _PICKLE_ARGS[0x96] = _A_LEN8      # BYTEARRAY8
    _PICKLE_ARGS[0x80] = _A_PROTO
    _PICKLE_ARGS[0x95] = _A_FRAME
    _PICKLE_ARGS[ord(".")] = _A_STOP
    _PICKLE_ARGS[0x94] = _A_MEMOIZE
    _PICKLE_ARGS[ord("h")] = _A_GET1  # BINGET
    _PICKLE_ARGS[ord("j")] = _A_GET4  # LONG_BINGET
    _PICKLE_ARGS[0x97] = _A_BUFFER    # NEXT_BUFFER


_init_pickle_args()


cdef inline uint64_t _le(const uint8_t *p, int nbytes) noexcept nogil:
    cdef uint64_t v = 0
    cdef int k
    for k in range(nbytes):
        v |= (<uint64_t>p[k]) << (8 * k)
    return v


@cython.boundscheck(False)
@cython.wraparound(False)
cdef str _check_pickle(const uint8_t *p, uint64_t n, uint32_t nbuf):
    """None if p[:n] is a protocol-5 pickle stream of the shape described
    above, else what is wrong with it (for the error message)."""
    cdef uint64_t i = 2, arg, memo = 0, buffers = 0
    cdef unsigned char op, kind
    cdef int width
    if n < 3 or p[0] != 0x80 or p[1] != 5:
        return "it does not start with PROTO 5"
    while i < n:
        op = p[i]
        kind = _PICKLE_ARGS[op]
        i += 1
        if kind == _A_NONE:
            continue
        if kind == _A_STOP:
            if i != n:
                return f"STOP at byte {i - 1} of {n}"
            break
        if kind == _A_INVALID or kind == _A_PROTO:
            return f"opcode {op:#04x} at byte {i - 1} is not one a protocol-5 pickler writes"
        if kind == _A_MEMOIZE:
            memo += 1
            continue
        if kind == _A_BUFFER:
            buffers += 1
            continue
        if kind == _A_FIX1 or kind == _A_LEN1 or kind == _A_GET1:
            width = 1
        elif kind == _A_FIX2:
            width = 2
        elif kind == _A_FIX4 or kind == _A_LEN4 or kind == _A_LONG4 or kind == _A_GET4:
            width = 4
        else:
            width = 8
        if n - i < <uint64_t>width:
            return f"opcode {op:#04x} at byte {i - 1}: its argument runs past the end"
        arg = _le(p + i, width)
        i += width
        if kind == _A_GET1 or kind == _A_GET4:
            if arg >= memo:
                return f"memo index {arg} at byte {i - 1 - width} (only {memo} memoized)"
        elif kind == _A_FRAME:
            if arg > n - i:
                return f"frame of {arg} bytes at byte {i - 9}, only {n - i} left"
        elif kind == _A_LEN1 or kind == _A_LEN4 or kind == _A_LEN8 or kind == _A_LONG4:
            if kind == _A_LONG4 and arg >= 0x80000000:
                return f"negative length at byte {i - 5}"
            if arg > n - i:
                return f"{arg}-byte argument at byte {i - 1 - width}, only {n - i} left"
            i += arg
    else:
        return "no STOP at the end"
    if buffers != nbuf:
        return f"{buffers} out-of-band buffers used, {nbuf} in the buffer table"
    return None


cdef inline void _copy(void *dst, const void *src, uint64_t n) noexcept:
    if n >= NOGIL_COPY_BYTES:
        with nogil:
            memcpy(dst, src, n)
    else:
        memcpy(dst, src, n)


cdef uint64_t _this_starttime_pid = 0
cdef uint64_t _this_starttime = 0


cdef uint64_t _own_starttime():
    global _this_starttime_pid, _this_starttime
    cdef uint32_t pid = getpid()
    cdef uint64_t st
    if _this_starttime_pid != pid:
        st = shmq_proc_starttime(pid)
        if st == SHMQ_STARTTIME_UNKNOWN:
            return 0  # unknown now (out of fds): pid alone decides; read it next time
        _this_starttime, _this_starttime_pid = st, pid
    return _this_starttime


cdef class Ring:
    """One process's handle on a ring.  Not thread-safe: one thread at a time
    (attach again for another thread)."""
    cdef shmq_ring r
    cdef readonly Mapping mapping
    cdef readonly str name
    cdef readonly bint closed
    cdef bint produced        # this handle has taken the producer role
    cdef bint consuming       # this handle has taken the consumer role
    cdef readonly bint anonymous  # no name: shared only with children forked while open
    cdef bint view_open       # a get_view() record is held
    cdef uint64_t view_pos, view_bytes
    cdef bint reserve_open    # a reserve() record is held
    cdef uint64_t reserve_pos, reserve_bytes
    cdef int32_t child_slot   # reserved in the parent for a child being forked

    def __dealloc__(self):
        # A handle dropped without close() must not keep counting as a live
        # producer; the mapping is still referenced here, so the slot is safe
        # to touch.
        if not self.closed and self.mapping is not None and self.r.slot >= 0:
            shmq_slot_close(&self.r, self.r.slot)

    # --- construction -----------------------------------------------------

    @staticmethod
    def create(int fd, uint64_t capacity, bint mpsc, str name, bint anonymous=False):
        cdef uint64_t so, ao, dof
        shmq_layout(capacity, mpsc, SHMQ_MAX_ATTACH, &so, &ao, &dof)
        cdef Mapping m = Mapping.map_ring(fd, dof, capacity)
        shmq_init(m.base, capacity, mpsc, getpid(), _own_starttime(), shmq_self_pidns())
        cdef Ring ring = Ring._bind(m, name, capacity, mpsc)
        ring.anonymous = anonymous
        return ring

    @staticmethod
    def attach(int fd, uint64_t file_bytes, bytes header_copy, str name,
               int32_t adopt_slot=-1, uint32_t adopt_from_pid=0):
        """Attach to an existing segment.  header_copy holds its first bytes,
        read with pread, so a hostile header is validated before anything
        is mapped at the sizes it claims."""
        cdef int bad = 0
        cdef const shmq_header *h
        if file_bytes < sizeof(shmq_header) or len(header_copy) < sizeof(shmq_header):
            raise IncompatibleRing(
                f"{name!r} is {file_bytes} bytes, smaller than a shmq header "
                f"({sizeof(shmq_header)} bytes): not a shmq queue, or its creator died while creating it")
        h = <const shmq_header *><const char *>header_copy
        if shmq_validate(h, file_bytes, 0, &bad) != SHMQ_OK:
            raise IncompatibleRing(_header_problem(name, bad, h, file_bytes))
        # The geometry comes from this private copy, validated: what we map
        # by and bind with can no longer change (NOTE [validation]).
        cdef uint64_t capacity = h.capacity_bytes, dof = h.data_offset
        cdef bint mpsc = (h.flags & SHMQ_FLAG_MPSC) != 0
        cdef Mapping m = Mapping.map_ring(fd, dof, capacity)
        # Validate again on the shared copy: positions and roles are read
        # from there.
        if shmq_validate(m.base, file_bytes, 1, &bad) != SHMQ_OK or \
                (<shmq_header *>m.base).capacity_bytes != capacity or \
                (<shmq_header *>m.base).data_offset != dof:
            raise IncompatibleRing(_header_problem(name, bad, <shmq_header *>m.base, file_bytes))
        return Ring._bind(m, name, capacity, mpsc, adopt_slot, adopt_from_pid)

    @staticmethod
    cdef Ring _bind(Mapping m, str name, uint64_t capacity, bint mpsc, int32_t adopt_slot=-1,
                    uint32_t adopt_from_pid=0):
        cdef Ring ring = Ring.__new__(Ring)
        ring.mapping = m
        ring.name = name
        ring.child_slot = -1
        shmq_bind(&ring.r, m.base, capacity, mpsc)
        ring._take_slot(adopt_slot, adopt_from_pid)
        return ring

    cdef int _take_slot(self, int32_t adopt_slot, uint32_t adopt_from_pid) except -1:
        """Adopt the slot another process reserved for us (see
        reserve_pending_slot), or take a free one."""
        cdef uint64_t expect = (<uint64_t>adopt_from_pid << 32) | SHMQ_SLOT_OPEN | SHMQ_SLOT_PENDING
        if 0 <= adopt_slot < <int32_t>SHMQ_MAX_ATTACH:
            self.r.slots[adopt_slot].starttime = _own_starttime()
            if shmq_slot_update(&self.r, adopt_slot, expect, (<uint64_t>getpid() << 32) | SHMQ_SLOT_OPEN):
                self.r.slot = adopt_slot
                return 0
        self.r.slot = shmq_slot_acquire(&self.r, getpid(), _own_starttime(), SHMQ_SLOT_OPEN)
        if self.r.slot < 0:
            self.closed = True
            raise ShmqError(
                f"shmq queue {self.name!r} has all {SHMQ_MAX_ATTACH} attachment slots held by live "
                f"handles; close handles you no longer need (each attach() and each forked "
                f"child holding a handle takes one)")
        return 0

    # --- properties -------------------------------------------------------

    @property
    def capacity_bytes(self):
        return self.r.capacity

    @property
    def multi_producer(self):
        return bool(self.r.mpsc)

    def stats(self):
        """A snapshot of the shared counters (for diagnostics and tests)."""
        self._check_open()
        h = self.r.hdr
        return {
            "head_pos": h.head_pos,
            "tail_pos": h.tail_pos,
            "used_bytes": h.tail_pos - h.head_pos,
            "closed_writers": h.closed_writers,
            "gone_writers": h.gone_writers,
            "skipped_records": h.skipped_records,
            "consumer_slot": h.consumer_slot,
        }

    # --- roles ------------------------------------------------------------

    cdef inline int _check_open(self) except -1:
        if self.closed:
            raise ValueError(f"operation on a closed shmq queue handle ({self.name!r}); "
                             f"use Queue.attach(name) for a new handle")
        return 0

    cdef int _ensure_producer(self) except -1:
        cdef int64_t holder
        cdef uint64_t o
        self._check_open()
        if self.produced:
            return 0
        if not self.r.mpsc:
            holder = shmq_take_role(&self.r, &self.r.hdr.producer_slot, self.r.slot,
                                    SHMQ_SLOT_PRODUCED, 1)
            if holder == SHMQ_ROLE_CORRUPT:
                self._raise_status(SHMQ_CORRUPT, "put")
            if holder >= 0:
                raise ShmqError(
                    f"shmq queue {self.name!r} is single-producer and pid {holder} is already "
                    f"putting into it (this is pid {getpid()}); create the queue with "
                    f"multi_producer=True to put from several processes")
        else:
            while True:
                o = shmq_slot_owner(&self.r, self.r.slot)
                if shmq_slot_update(&self.r, self.r.slot, o, o | SHMQ_SLOT_PRODUCED):
                    break
        self.produced = True
        return 0

    cdef int _ensure_consumer(self) except -1:
        cdef int64_t holder
        self._check_open()
        if self.consuming:
            return 0
        holder = shmq_take_role(&self.r, &self.r.hdr.consumer_slot, self.r.slot,
                                SHMQ_SLOT_CONSUMER, 0)
        if holder == SHMQ_ROLE_CORRUPT:
            self._raise_status(SHMQ_CORRUPT, "get")
        if holder >= 0:
            raise ShmqError(
                f"shmq queue {self.name!r} already has a consumer (pid {holder}; this is pid "
                f"{getpid()}); a queue has exactly one consumer: use one queue per consumer")
        self.consuming = True
        return 0

    # --- status -> exception: the one place ---------------------------------

    cdef int _raise_status(self, int rc, str op, uint64_t need=0, object timeout=None,
                           uint64_t pos=0, uint32_t pid=0) except -1:
        """Raise the exception for C status rc from operation op ("get",
        "put").  need: bytes asked for (or skipped); pos, pid: the record
        concerned."""
        h = self.r.hdr
        if rc == SHMQ_CORRUPT:
            self._raise_corrupt_field(op, pos)
        if rc == SHMQ_ABANDONED:
            raise PeerLost(
                f"shmq queue {self.name!r}: producer pid {pid} died while writing a "
                f"{need}-byte record at position {pos}; the record was dropped and the "
                f"other producers' messages follow: call get() again to continue")
        if rc == SHMQ_AMBIGUOUS:
            raise PeerLost(
                f"shmq queue {self.name!r}: several dead producers claimed position {pos} "
                f"with different sizes, so the next record cannot be located; recreate the queue")
        if rc == SHMQ_FULL:
            raise Full(f"shmq queue {self.name!r}: no room for a {need}-byte record within "
                       f"timeout={timeout!r}s ({h.tail_pos - h.head_pos} of {self.r.capacity} "
                       f"bytes in use); get() faster, wait longer, or use a larger capacity_bytes")
        if rc == SHMQ_EMPTY:
            raise Empty(f"shmq queue {self.name!r}: no message within timeout={timeout!r}s")
        if op == "get":
            if rc == SHMQ_PEERS_CLOSED:
                raise Closed(f"shmq queue {self.name!r}: every producer closed and the ring is "
                             f"drained ({h.closed_writers} closed); no more messages will arrive")
            if rc == SHMQ_PEERS_LOST:
                raise PeerLost(
                    f"shmq queue {self.name!r}: {h.gone_writers} producer(s) died without "
                    f"closing and no producer is left; the ring is drained. Check how the "
                    f"producer processes ended (killed by a signal, os._exit, out of memory)")
        else:
            pid = self._consumer_pid()
            if rc == SHMQ_PEERS_CLOSED:
                raise Closed(f"shmq queue {self.name!r}: the consumer (pid {pid}) closed the queue; "
                             f"nothing more can be delivered")
            if rc == SHMQ_PEERS_LOST:
                raise PeerLost(
                    f"shmq queue {self.name!r}: the consumer (pid {pid}) died without closing "
                    f"while this producer (pid {getpid()}) waited for {need} free bytes; stop "
                    f"producing, or start a new consumer with Queue.attach({self.name!r})")
        raise ShmqError(f"shmq queue {self.name!r}: unexpected status {rc} in {op}")

    cdef int _raise_corrupt_field(self, str op, uint64_t pos) except -1:
        """A shared field failed NOTE [validation] in shmq_ring.h; the handle
        says which, the value read and the limit it broke."""
        cdef int field = self.r.bad_field
        cdef uint64_t v = self.r.bad_value, lim = self.r.bad_limit
        name = _FIELD_NAMES.get(field, f"#{field}")
        if field == SHMQ_FIELD_POSITIONS:
            what = (f"head_pos {v} and tail_pos {lim} are not a valid pair (tail - head must "
                    f"be a multiple of 64 in [0, {self.r.capacity}])")
        elif field == SHMQ_FIELD_RECORD_BYTES:
            what = (f"the record at position {pos} says it is {v} bytes long; it must be a "
                    f"multiple of 64 in [{sizeof(shmq_record)}, {lim}] (the bytes published "
                    f"after it)")
        elif field == SHMQ_FIELD_CONSUMER_SLOT or field == SHMQ_FIELD_PRODUCER_SLOT:
            what = f"{<int64_t>v} is not -1 or a slot index below {lim}"
        elif field == SHMQ_FIELD_CLAIM:
            what = (f"slot {lim} claims {v} bytes at position {pos} for a producer that died; "
                    f"a claim is a multiple of 64 within the published bytes")
        else:
            what = f"value {v} (limit {lim})"
        raise IncompatibleRing(
            f"shmq queue {self.name!r} ({op}): field {name}: {what}. The segment was "
            f"written by an incompatible shmq version or corrupted by another program of this "
            f"user; recreate the queue")

    cdef object _consumer_pid(self):
        cdef int32_t c = self.r.hdr.consumer_slot
        if c < 0 or c >= <int32_t>SHMQ_MAX_ATTACH:
            return None
        return shmq_slot_owner(&self.r, c) >> 32

    cdef int _corrupt(self, uint64_t pos, str what, str remedy=None, object cause=None) except -1:
        """A record failed the decoder's checks.  Names the record by
        position and producer pid; the producer pid is only informational
        (it is read from the same record)."""
        cdef uint32_t pid = (<shmq_record *>shmq_at(&self.r, pos)).producer_pid
        if remedy is None:
            remedy = ("the record was dropped. The segment was written by an incompatible shmq "
                      "version or corrupted by another program of this user: if this repeats, "
                      "recreate the queue")
        err = IncompatibleRing(f"shmq queue {self.name!r}: record at position {pos} (producer pid "
                               f"{pid}) is malformed: {what}; {remedy}")
        if cause is None:
            raise err
        raise err from cause

    # --- producer ---------------------------------------------------------

    cdef uint64_t _claim(self, uint64_t need, object timeout) except? 0:
        """Claim `need` bytes, waiting in bounded slices.  Returns the
        position (callers treat 0 as a real position; errors raise)."""
        cdef uint64_t pos = 0
        cdef int rc, st
        cdef uint64_t slice_ns
        if self.reserve_open:
            # SPSC: the reservation has not moved tail_pos, so this claim
            # would overlap it.  MPSC: this claim's announcement would
            # replace the reservation's in our slot, and if we died the
            # consumer could not find the reservation to skip it.
            raise ShmqError(
                f"shmq queue {self.name!r}: this handle holds an open reserve() block (position "
                f"{self.reserve_pos}); put() on the same handle inside that block would corrupt "
                f"the ring and is refused. Put after the block ends"
                + (", or through another handle (Queue.attach)" if self.r.mpsc else ""))
        if need > self.r.capacity:
            raise MessageTooLarge(
                f"shmq queue {self.name!r}: message needs {need} bytes but the ring holds "
                f"{self.r.capacity}; create the queue with capacity_bytes >= {need}")
        self._ensure_producer()
        rc = shmq_claim(&self.r, need, &pos)
        if rc == SHMQ_OK:
            return pos
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if rc == SHMQ_CORRUPT:
                self._raise_status(rc, "put", need)
            st = shmq_reader_status(&self.r)
            if st != SHMQ_PEERS_OPEN:
                self._raise_status(st, "put", need)
            if deadline is None:
                slice_ns = WAIT_SLICE_NS
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._raise_status(SHMQ_FULL, "put", need, timeout)
                slice_ns = min(WAIT_SLICE_NS, <uint64_t>(left * 1e9) + 1)
            with nogil:
                shmq_wait_writable(&self.r, need, slice_ns)
            PyErr_CheckSignals()
            rc = shmq_claim(&self.r, need, &pos)
            if rc == SHMQ_OK:
                return pos

    cdef inline shmq_record *_start_record(self, uint64_t pos, uint64_t need, uint32_t kind,
                                           uint32_t nbuffers, uint64_t meta_bytes) noexcept:
        cdef shmq_record *rec = <shmq_record *>shmq_at(&self.r, pos)
        rec.record_bytes = need
        rec.kind = kind
        rec.nbuffers = nbuffers
        rec.meta_bytes = meta_bytes
        rec.producer_pid = getpid()
        rec.reserved = 0
        return rec

    cdef inline void _publish(self, uint64_t pos, uint64_t need) noexcept:
        _maybe_die(KILL_BEFORE_PUBLISH)
        shmq_publish(&self.r, pos, need)

    def put(self, obj, object timeout):
        """Copy obj into the ring: a C-contiguous array of a plain dtype as
        one ARRAY record, anything else as a TREE record (codec.encode)."""
        cdef bytes code
        if type(obj) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>obj) and \
                cnp.PyArray_NDIM(<cnp.ndarray>obj) <= <int>SHMQ_MAX_NDIM:
            code = _dtype_code(<object><PyObject *>cnp.PyArray_DESCR(<cnp.ndarray>obj))
            if code:
                self._put_array(<cnp.ndarray>obj, code, timeout)
                return
        pickled, buffers = codec.encode(obj)
        self.put_tree(pickled, buffers, timeout)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef uint8_t *_claim_array_record(self, int ndim, cnp.npy_intp *dims, bytes code,
                                      uint64_t nbytes, object timeout, uint64_t *pos,
                                      uint64_t *need) except NULL:
        """Claim an ARRAY record and write everything but the data; returns
        where the data goes."""
        cdef uint64_t meta = sizeof(shmq_array_meta) + 8 * ndim + len(code)
        cdef uint64_t data_off = shmq_align_up(sizeof(shmq_record) + meta, SHMQ_RECORD_ALIGN)
        need[0] = shmq_align_up(data_off + nbytes, SHMQ_RECORD_ALIGN)
        pos[0] = self._claim(need[0], timeout)
        _maybe_die(KILL_AFTER_CLAIM)
        cdef shmq_record *rec = self._start_record(pos[0], need[0], SHMQ_KIND_ARRAY, 1, meta)
        cdef shmq_array_meta *am = <shmq_array_meta *>(<uint8_t *>rec + sizeof(shmq_record))
        am.ndim = ndim
        am.dtype_chars = len(code)
        am.data_offset = data_off
        am.data_bytes = nbytes
        cdef uint64_t *shape = <uint64_t *>(<uint8_t *>am + sizeof(shmq_array_meta))
        cdef int i
        for i in range(ndim):
            shape[i] = dims[i]
        memcpy(<uint8_t *>(shape + ndim), <const char *>code, len(code))
        return <uint8_t *>rec + data_off

    cdef int _put_array(self, cnp.ndarray arr, bytes code, object timeout) except -1:
        """Fast path: one C-contiguous array of a plain dtype."""
        cdef uint64_t nbytes = cnp.PyArray_NBYTES(arr), pos, need
        cdef uint8_t *data = self._claim_array_record(cnp.PyArray_NDIM(arr), cnp.PyArray_DIMS(arr),
                                                      code, nbytes, timeout, &pos, &need)
        if _kill_point == KILL_MID_COPY:
            _copy(data, cnp.PyArray_DATA(arr), nbytes // 2)
            _maybe_die(KILL_MID_COPY)
        _copy(data, cnp.PyArray_DATA(arr), nbytes)
        self._publish(pos, need)
        return 0

    def put_tree(self, bytes pickled, list buffers, object timeout):
        """A pickle-5 stream and its out-of-band buffers (PickleBuffer), in
        one record; each buffer is copied once, 64-byte aligned."""
        cdef Py_ssize_t nbuf = len(buffers), i
        cdef list views = [pb.raw() for pb in buffers]
        cdef uint64_t meta = sizeof(shmq_tree_meta) + nbuf * sizeof(shmq_buffer_entry)
        cdef uint64_t pickle_off = sizeof(shmq_record) + meta
        cdef uint64_t end = pickle_off + len(pickled)
        cdef list offsets = []
        cdef const uint8_t[::1] mv
        for i in range(nbuf):
            end = shmq_align_up(end, SHMQ_RECORD_ALIGN)
            offsets.append(end)
            end += len(views[i])
        cdef uint64_t need = shmq_align_up(end, SHMQ_RECORD_ALIGN)
        cdef uint64_t pos = self._claim(need, timeout)
        _maybe_die(KILL_AFTER_CLAIM)
        cdef shmq_record *rec = self._start_record(pos, need, SHMQ_KIND_TREE, nbuf, meta)
        cdef uint8_t *base = <uint8_t *>rec
        cdef shmq_tree_meta *tm = <shmq_tree_meta *>(base + sizeof(shmq_record))
        cdef shmq_buffer_entry *entries = <shmq_buffer_entry *>(base + sizeof(shmq_record) + sizeof(shmq_tree_meta))
        try:
            tm.pickle_offset = pickle_off
            tm.pickle_bytes = len(pickled)
            memcpy(base + pickle_off, <const char *>pickled, len(pickled))
            for i in range(nbuf):
                mv = views[i]
                entries[i].offset = offsets[i]
                entries[i].nbytes = mv.shape[0]
                if mv.shape[0]:
                    if _kill_point == KILL_MID_COPY:
                        _copy(base + <uint64_t>offsets[i], &mv[0], mv.shape[0] // 2)
                        _maybe_die(KILL_MID_COPY)
                    _copy(base + <uint64_t>offsets[i], &mv[0], mv.shape[0])
        except BaseException:
            self._cancel_claim(pos, need)  # a claim must end published, whatever happens
            raise
        self._publish(pos, need)

    def reserve_array(self, tuple shape, cnp.dtype dtype, object timeout):
        """Claim a record for an array and return a writable view of its
        data; commit_reserved() publishes it, cancel_reserved() drops it."""
        if self.reserve_open:
            raise ShmqError(f"shmq queue {self.name!r}: this handle already holds a reservation; "
                            f"commit or cancel it (leave its `with` block) before reserving again")
        cdef bytes code = _dtype_code(dtype)
        if not code:
            raise TypeError(f"reserve() needs a plain numeric, bool or fixed-width bytes/str dtype, "
                            f"not {dtype!r}")
        cdef int ndim = len(shape), i
        if ndim > <int>SHMQ_MAX_NDIM:
            raise ValueError(f"reserve() supports at most {SHMQ_MAX_NDIM} dimensions, got {ndim}")
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape!r}")
        # numpy's own limit, checked before anything is claimed: itemsize
        # times every non-zero dimension must fit in npy_intp, even when
        # another dimension is 0 (shape (0, 2**62) of float64 is refused).
        if dtype.itemsize * math.prod([d for d in shape if d]) > 0x7fffffffffffffff:
            raise ValueError(f"reserve({shape}, {dtype}): numpy cannot make an array of this "
                             f"shape (its non-zero dimensions times the itemsize exceed 2**63 - 1 "
                             f"bytes); use a smaller shape")
        size = dtype.itemsize * math.prod(shape)  # a Python int: cannot overflow
        if size > self.r.capacity:
            raise MessageTooLarge(
                f"shmq queue {self.name!r}: reserve({shape}, {dtype}) needs {size} bytes but the "
                f"ring holds {self.r.capacity}; create the queue with capacity_bytes >= {size + 4096}")
        cdef cnp.npy_intp dims[32]
        for i in range(ndim):
            dims[i] = shape[i]
        cdef uint64_t pos, need
        cdef uint8_t *data = self._claim_array_record(ndim, dims, code, size, timeout, &pos, &need)
        try:
            arr = self._view_array(data, ndim, dims, dtype)
        except BaseException:
            # Claimed but never handed out: give the space back, or an MPSC
            # consumer would wait at it for as long as this process lives.
            self._cancel_claim(pos, need)
            raise
        self.reserve_open = True
        self.reserve_pos = pos
        self.reserve_bytes = need
        return arr

    def commit_reserved(self):
        if not self.reserve_open:
            raise ShmqError(f"shmq queue {self.name!r}: no reservation to commit")
        self.reserve_open = False
        self._publish(self.reserve_pos, self.reserve_bytes)

    def cancel_reserved(self):
        """Publish the reserved record as SKIP: the space was claimed and the
        consumer must step over it, but nothing is delivered."""
        if not self.reserve_open:
            return
        self.reserve_open = False
        self._cancel_claim(self.reserve_pos, self.reserve_bytes)

    cdef void _cancel_claim(self, uint64_t pos, uint64_t need) noexcept:
        """Publish claimed space as a SKIP record: the consumer steps over
        it, and on an MPSC ring the claim stops holding up the queue."""
        self._start_record(pos, need, SHMQ_KIND_SKIP, 0, 0)
        shmq_publish(&self.r, pos, need)

    # --- consumer ---------------------------------------------------------

    cdef int _next(self, object timeout, uint64_t *pos, uint64_t *nbytes) except -1:
        """Wait for the next deliverable record at head."""
        cdef int rc, st
        cdef uint64_t skip = 0
        cdef uint32_t dead_pid = 0
        cdef uint64_t slice_ns
        cdef bint waited = False
        self._ensure_consumer()
        if self.view_open:
            raise ShmqError(f"shmq queue {self.name!r}: a get_view() block is still open on this "
                            f"handle; leave it before getting the next message")
        deadline = None
        while True:
            rc = shmq_peek(&self.r, pos, nbytes)
            if rc == SHMQ_OK:
                if (<shmq_record *>shmq_at(&self.r, pos[0])).kind == SHMQ_KIND_SKIP:
                    shmq_release(&self.r, pos[0], nbytes[0])
                    continue
                return 0
            if rc == SHMQ_CORRUPT:
                self._raise_status(rc, "get", 0, None, pos[0])
            if self.reserve_open and pos[0] == self.reserve_pos:
                # Waiting would wait for ourselves: nothing else can arrive
                # first (MPSC: our claim is next; SPSC: we are the producer).
                raise ShmqError(
                    f"shmq queue {self.name!r}: the next message is this handle's own open "
                    f"reserve() block (position {pos[0]}), which arrives only after that block "
                    f"ends; leave the block before calling get(), or reserve through another "
                    f"handle (Queue.attach) on a multi-producer queue")
            if rc == SHMQ_PENDING:
                if waited:
                    rc = shmq_resolve_pending(&self.r, pos[0], &skip, &dead_pid)
                    if rc == SHMQ_ABANDONED:
                        shmq_release(&self.r, pos[0], skip)
                    if rc != SHMQ_PENDING:
                        self._raise_status(rc, "get", skip, None, pos[0], dead_pid)
            elif rc == SHMQ_EMPTY and (waited or self.r.hdr.closed_writers or self.r.hdr.gone_writers):
                # Only scan the slots once someone finished or a slice passed:
                # the streaming fast path never touches /proc.
                st = shmq_writers_status(&self.r)
                if st != SHMQ_PEERS_OPEN:
                    # A producer may have published and closed after our peek.
                    if shmq_peek(&self.r, pos, nbytes) != SHMQ_EMPTY:
                        continue
                    self._raise_status(st, "get")
            if timeout is not None:
                if deadline is None:
                    deadline = time.monotonic() + timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    self._raise_status(SHMQ_EMPTY, "get", 0, timeout)
                slice_ns = min(WAIT_SLICE_NS, <uint64_t>(left * 1e9) + 1)
            else:
                slice_ns = WAIT_SLICE_NS
            with nogil:
                rc = shmq_wait_readable(&self.r, slice_ns)
            PyErr_CheckSignals()
            waited = rc == SHMQ_TIMEOUT

    cdef object _view_array(self, uint8_t *data, int ndim, cnp.npy_intp *dims, cnp.dtype dtype):
        return _array_over(self.mapping, data, ndim, dims, dtype)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef object _decode(self, uint64_t pos, uint64_t n, bint copy):
        """Build the message at pos (n bytes, already checked against the
        ring by shmq_peek).  Every field is read once into a local, then
        validated against the record before use (NOTE [validation])."""
        cdef uint8_t *base = shmq_at(&self.r, pos)
        cdef shmq_record *rec = <shmq_record *>base
        cdef uint32_t kind = rec.kind
        cdef uint64_t meta = rec.meta_bytes
        if meta > n - sizeof(shmq_record):
            self._corrupt(pos, f"meta_bytes {meta} exceeds record_bytes {n}")
        if kind == SHMQ_KIND_ARRAY:
            return self._decode_array(pos, base, n, meta, copy)
        if kind == SHMQ_KIND_TREE:
            return self._decode_tree(pos, base, n, meta, rec.nbuffers, copy)
        self._corrupt(pos, f"unknown kind {kind}")

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.cdivision(True)
    cdef object _decode_array(self, uint64_t pos, uint8_t *base, uint64_t n, uint64_t meta,
                              bint copy):
        cdef shmq_array_meta *am = <shmq_array_meta *>(base + sizeof(shmq_record))
        cdef uint32_t ndim = am.ndim, chars = am.dtype_chars
        cdef uint64_t doff = am.data_offset, dbytes = am.data_bytes
        if ndim > SHMQ_MAX_NDIM or chars == 0 or chars > SHMQ_MAX_DTYPE_CHARS:
            self._corrupt(pos, f"ndim {ndim} / dtype_chars {chars} out of range")
        if sizeof(shmq_array_meta) + 8 * ndim + chars > meta:
            self._corrupt(pos, f"array metadata ({ndim} dims) overruns meta_bytes {meta}")
        if doff % SHMQ_RECORD_ALIGN or doff < sizeof(shmq_record) + meta or doff > n or dbytes > n - doff:
            self._corrupt(pos, f"data_offset {doff} / data_bytes {dbytes} outside the {n}-byte record")
        cdef uint64_t *shape = <uint64_t *>(<uint8_t *>am + sizeof(shmq_array_meta))
        cdef bytes code = (<char *>(shape + ndim))[:chars]
        cdef cnp.dtype dt = _dtype_from_code(code, self, pos)
        cdef cnp.npy_intp dims[32]
        # The array's size as numpy computes it: itemsize times every
        # non-zero dimension must fit in npy_intp (even when another
        # dimension is 0), and then it must equal data_bytes.
        cdef uint64_t total = <uint64_t>dt.itemsize, d
        cdef uint64_t INTP_MAX = 0x7fffffffffffffff
        cdef uint32_t i
        cdef bint zero = False
        for i in range(ndim):
            d = shape[i]
            if d > INTP_MAX:
                self._corrupt(pos, f"shape[{i}] = {d} overflows")
            dims[i] = <cnp.npy_intp>d
            if d == 0:
                zero = True
            elif total > INTP_MAX // d:
                self._corrupt(pos, f"shape[{i}] = {d}: the array would exceed 2**63 bytes")
            else:
                total *= d
        if zero:
            total = 0
        if total != dbytes:
            self._corrupt(pos, f"shape x itemsize = {total} != data_bytes {dbytes}")
        if not copy:
            return self._view_array(base + doff, ndim, dims, dt)
        Py_INCREF(dt)  # PyArray_Empty steals a reference
        arr = PyArray_Empty(ndim, dims, <cnp.PyArray_Descr *>dt, 0)
        _copy(cnp.PyArray_DATA(arr), base + doff, dbytes)
        return arr

    cdef object _decode_tree(self, uint64_t pos, uint8_t *base, uint64_t n, uint64_t meta,
                             uint32_t nbuf, bint copy):
        cdef shmq_tree_meta *tm = <shmq_tree_meta *>(base + sizeof(shmq_record))
        cdef uint64_t poff = tm.pickle_offset, pbytes = tm.pickle_bytes
        if meta < sizeof(shmq_tree_meta) or \
                (meta - sizeof(shmq_tree_meta)) // sizeof(shmq_buffer_entry) < nbuf:
            self._corrupt(pos, f"{nbuf} buffer entries overrun meta_bytes {meta}")
        if poff > n or pbytes > n - poff:
            self._corrupt(pos, f"pickle_offset {poff} / pickle_bytes {pbytes} outside the record")
        cdef shmq_buffer_entry *entries = <shmq_buffer_entry *>(<uint8_t *>tm + sizeof(shmq_tree_meta))
        cdef list spans = []
        cdef uint32_t i
        cdef uint64_t off, nb
        for i in range(nbuf):
            off = entries[i].offset
            nb = entries[i].nbytes
            if off % SHMQ_RECORD_ALIGN or off > n or nb > n - off:
                self._corrupt(pos, f"buffer {i} (offset {off}, {nb} bytes) outside the record")
            spans.append((off, nb))
        cdef cnp.npy_intp whole = n
        cdef const uint8_t *stream_data
        if copy:
            # One copy of the record into private memory; every array of the
            # message then views that block, and the pickle stream is read
            # from it: nothing can change under the checks below.
            block = cnp.PyArray_EMPTY(1, &whole, cnp.NPY_UINT8, 0)
            _copy(cnp.PyArray_DATA(block), base, n)
            stream_data = <const uint8_t *>cnp.PyArray_DATA(block) + poff
            stream = block[poff:poff + pbytes]
        else:
            block = self._view_array(base, 1, &whole, np.dtype(np.uint8))
            # Arrays view the ring, but the (small) pickle stream is copied
            # out first: it is checked, then unpickled, and another process
            # must not be able to change it in between.
            stream = PyBytes_FromStringAndSize(<const char *>base + poff, pbytes)
            stream_data = <const uint8_t *>PyBytes_AS_STRING(stream)
        problem = _check_pickle(stream_data, pbytes, nbuf)
        if problem is not None:
            self._corrupt(pos, f"its pickle stream ({pbytes} bytes) is malformed: {problem}")
        buffers = [block[o:o + b] for o, b in spans]
        try:
            return pickle.loads(stream, buffers=buffers)
        except Exception as e:
            # The stream is well-formed but rebuilding the tree failed: a
            # class missing here, a reducer that raised, or bytes changed
            # inside an argument.  Either way this record cannot be had.
            self._corrupt(pos, f"its tree could not be rebuilt: {type(e).__name__}: {e}",
                          "if the producer sent an object this process cannot rebuild (its "
                          "class is not importable here, or its __setstate__ failed: see the "
                          "exception this one was raised from), send plainer data; otherwise "
                          "the segment was corrupted. The record was dropped: get() again "
                          "for the next one", e)

    def get(self, object timeout):
        """The next message, owned by the caller (copied out of the ring)."""
        cdef uint64_t pos, n
        self._next(timeout, &pos, &n)
        try:
            return self._decode(pos, n, True)
        finally:
            shmq_release(&self.r, pos, n)

    def get_view(self, object timeout):
        """The next message with arrays viewing ring memory; the record stays
        held until release_view()."""
        cdef uint64_t pos, n
        self._next(timeout, &pos, &n)
        try:
            obj = self._decode(pos, n, False)
        except BaseException:
            shmq_release(&self.r, pos, n)
            raise
        self.view_open = True
        self.view_pos = pos
        self.view_bytes = n
        return obj

    def release_view(self):
        if self.view_open:
            self.view_open = False
            shmq_release(&self.r, self.view_pos, self.view_bytes)

    # --- lifetime ---------------------------------------------------------

    def close(self):
        """End this handle: drop any held record, close the slot.  The
        mapping lives on while arrays still view it."""
        if self.closed:
            return
        self.cancel_reserved()
        self.release_view()
        if self.r.slot >= 0:
            shmq_slot_close(&self.r, self.r.slot)
        self.closed = True
        if self.anonymous and not self._others_open():
            # Nobody can reach an anonymous ring once its last handle is
            # closed (it has no name to attach by), so its memory goes back
            # now, even in processes that still map it: a child forked while
            # the ring was open keeps the mapping until it exits.
            madvise(self.r.data, self.r.capacity, MADV_REMOVE)

    cdef bint _others_open(self):
        """Does a live handle other than this one hold a slot?"""
        cdef uint32_t i
        cdef uint64_t o
        for i in range(SHMQ_MAX_ATTACH):
            if <int32_t>i == self.r.slot:
                continue
            o = shmq_slot_owner(&self.r, i)
            if (<uint32_t>o & SHMQ_SLOT_STATE_MASK) == SHMQ_SLOT_OPEN and \
                    shmq_owner_alive(&self.r.slots[i], o):
                return True
        return False

    def reserve_pending_slot(self):
        """Reserve a slot for a process that will adopt it: a child about to
        be forked, or a process this queue is pickled for.  It counts as an
        open producer from now on, owned by this pid until adopted.  Returns
        the slot index, -1 if none is free."""
        if self.closed:
            return -1
        return shmq_slot_acquire(&self.r, getpid(), 0, SHMQ_SLOT_OPEN | SHMQ_SLOT_PENDING)

    def reserve_child_slot(self):
        """Before fork: reserve the child's slot (see adopt_child_slot)."""
        self.child_slot = self.reserve_pending_slot()

    def forget_child_slot(self):
        """In the parent after fork: the child owns the reserved slot now."""
        self.child_slot = -1

    def adopt_child_slot(self, uint32_t parent_pid):
        """In the child after fork: take over the slot the parent reserved,
        so the child counts as a potential producer from the instant it
        exists.  Roles and held records stay with the parent."""
        if self.closed:
            return
        self.produced = self.consuming = self.view_open = self.reserve_open = False
        cdef int32_t slot = self.child_slot
        self.child_slot = -1
        try:
            self._take_slot(slot, parent_pid)
        except ShmqError:
            pass  # every slot is taken: the child's handle is closed, its use raises


cdef str _header_problem(str name, int bad, const shmq_header *h, uint64_t file_bytes):
    field = _FIELD_NAMES.get(bad, "header")
    if bad == SHMQ_FIELD_MAGIC:
        detail = f"magic is {h.magic:#x}, expected {SHMQ_MAGIC:#x} (not a shmq ring, or its creator died while creating it)"
    elif bad == SHMQ_FIELD_VERSION:
        detail = f"layout version {h.version}, this shmq reads version {SHMQ_VERSION}; use the same shmq version on both sides"
    elif bad == SHMQ_FIELD_FILE_SIZE:
        detail = f"file is {file_bytes} bytes, header implies {h.data_offset + h.capacity_bytes}"
    elif bad == SHMQ_FIELD_CAPACITY:
        detail = f"capacity_bytes {h.capacity_bytes} is not a power of two in [{SHMQ_MIN_CAPACITY}, {SHMQ_MAX_CAPACITY}]"
    elif bad == SHMQ_FIELD_POSITIONS:
        detail = (f"head_pos {h.head_pos} / tail_pos {h.tail_pos}: tail - head must be a multiple "
                  f"of 64 in [0, capacity_bytes]")
    elif bad == SHMQ_FIELD_CONSUMER_SLOT:
        detail = f"{h.consumer_slot} is not -1 or a slot index below {SHMQ_MAX_ATTACH}"
    elif bad == SHMQ_FIELD_PRODUCER_SLOT:
        detail = f"{h.producer_slot} is not -1 or a slot index below {SHMQ_MAX_ATTACH}"
    else:
        detail = "inconsistent with the rest of the header"
    return f"cannot attach to {name!r}: field {field}: {detail}"


include "_fork.pxi"
