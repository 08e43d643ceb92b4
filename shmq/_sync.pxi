# Included by _core.pyx: atomics and futex waits on words of shared arrays
# (shmq.sync.shared_array), for programs that coordinate processes through
# shared memory next to their queues.  shmq_sync.h holds the primitive and
# the pattern ("eventcount") that makes waits lossless.
#
# Memory orders: load is acquire, store is release, add and cas are
# sequentially consistent.  A flag that publishes data is stored with
# atomic_store after the data is written and read with atomic_load before
# the data is read (the pair is a synchronisation point); an eventcount's
# announce and check need the seq_cst add/cas.

from shmq.sync cimport SHMQ_WAKE_ALL, shmq_word_wait, shmq_word_wake

cdef extern from *:
    int32_t __atomic_load_n "__atomic_load_n"(int32_t *ptr, int memorder) nogil
    void __atomic_store_n "__atomic_store_n"(int32_t *ptr, int32_t val, int memorder) nogil
    int32_t __atomic_fetch_add "__atomic_fetch_add"(int32_t *ptr, int32_t val, int memorder) nogil
    bint __atomic_compare_exchange_n "__atomic_compare_exchange_n"(
        int32_t *ptr, int32_t *expected, int32_t desired, bint weak, int success_memorder,
        int failure_memorder) nogil
    int64_t __atomic_load_n64 "__atomic_load_n"(int64_t *ptr, int memorder) nogil
    void __atomic_store_n64 "__atomic_store_n"(int64_t *ptr, int64_t val, int memorder) nogil
    int64_t __atomic_fetch_add64 "__atomic_fetch_add"(int64_t *ptr, int64_t val, int memorder) nogil
    bint __atomic_compare_exchange_n64 "__atomic_compare_exchange_n"(
        int64_t *ptr, int64_t *expected, int64_t desired, bint weak, int success_memorder,
        int failure_memorder) nogil
    int __ATOMIC_ACQUIRE
    int __ATOMIC_RELEASE


cdef void *_word(cnp.ndarray arr, Py_ssize_t index, int *width) except NULL:
    """Address of arr[index] in a 1-d C-contiguous int32/uint32/int64 array;
    width is 4 or 8."""
    if arr.ndim != 1 or not arr.flags.c_contiguous:
        raise TypeError("atomic operations need a 1-d C-contiguous int32 or int64 array")
    cdef int type_num = cnp.PyArray_TYPE(arr)
    if type_num == cnp.NPY_INT64:
        width[0] = 8
    elif type_num == cnp.NPY_INT32 or type_num == cnp.NPY_UINT32:
        width[0] = 4
    else:
        raise TypeError(f"atomic operations need an int32 or int64 array, not {arr.dtype}")
    if not 0 <= index < arr.shape[0]:
        raise IndexError(f"index {index} out of range for an array of {arr.shape[0]}")
    if not arr.flags.writeable:
        raise ValueError("atomic operations need a writable array")
    return <char *>cnp.PyArray_DATA(arr) + index * width[0]


def atomic_load(cnp.ndarray arr not None, Py_ssize_t index):
    """arr[index] read with acquire order: what the writer stored before
    its atomic_store of this value is visible after this load."""
    cdef int width
    cdef void *p = _word(arr, index, &width)
    if width == 8:
        return __atomic_load_n64(<int64_t *>p, __ATOMIC_ACQUIRE)
    if cnp.PyArray_TYPE(arr) == cnp.NPY_UINT32:
        return <uint32_t>__atomic_load_n(<int32_t *>p, __ATOMIC_ACQUIRE)
    return __atomic_load_n(<int32_t *>p, __ATOMIC_ACQUIRE)


def atomic_store(cnp.ndarray arr not None, Py_ssize_t index, int64_t value):
    """Store value into arr[index] with release order (see atomic_load)."""
    cdef int width
    cdef void *p = _word(arr, index, &width)
    if width == 8:
        __atomic_store_n64(<int64_t *>p, value, __ATOMIC_RELEASE)
    else:
        __atomic_store_n(<int32_t *>p, <int32_t>value, __ATOMIC_RELEASE)


def atomic_add(cnp.ndarray arr not None, Py_ssize_t index, int64_t delta):
    """Atomically add delta to arr[index] and return the value before the
    addition (sequentially consistent)."""
    cdef int width
    cdef void *p = _word(arr, index, &width)
    if width == 8:
        return __atomic_fetch_add64(<int64_t *>p, delta, __ATOMIC_SEQ_CST)
    if cnp.PyArray_TYPE(arr) == cnp.NPY_UINT32:
        return <uint32_t>__atomic_fetch_add(<int32_t *>p, <int32_t>delta, __ATOMIC_SEQ_CST)
    return __atomic_fetch_add(<int32_t *>p, <int32_t>delta, __ATOMIC_SEQ_CST)


def atomic_cas(cnp.ndarray arr not None, Py_ssize_t index, int64_t expected, int64_t new):
    """Atomically set arr[index] to new if it equals expected; True if it
    did (sequentially consistent)."""
    cdef int width
    cdef void *p = _word(arr, index, &width)
    cdef int32_t e32 = <int32_t>expected
    if width == 8:
        return __atomic_compare_exchange_n64(<int64_t *>p, &expected, new, False,
                                             __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)
    return __atomic_compare_exchange_n(<int32_t *>p, &e32, <int32_t>new, False,
                                       __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)


cdef uint32_t *_futex_word(cnp.ndarray arr, Py_ssize_t index) except NULL:
    cdef int width
    cdef void *p = _word(arr, index, &width)
    if width != 4:
        raise TypeError("wait() and wake() work on int32 or uint32 words (futexes are 32 bits)")
    return <uint32_t *>p


def wait(cnp.ndarray arr not None, Py_ssize_t index, int64_t expected, timeout=None):
    """Sleep while arr[index] == expected (an int32/uint32 word of a shared
    array), until another process changes it and calls wake(), for at most
    timeout seconds (None: no limit).  Returns True if the word differs
    from expected, False on timeout.  Sleeps without the GIL, in slices of
    at most 0.1 s between which Ctrl-C raises KeyboardInterrupt.

    To wait for a condition without missing a wake-up, follow the pattern
    in shmq_sync.h: read the word, announce yourself, re-check the
    condition, then wait on the value you read."""
    cdef uint32_t *word = _futex_word(arr, index)
    cdef uint32_t expect = <uint32_t>expected
    cdef uint64_t slice_ns
    timeout = _check_wait_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if __atomic_load_n(<int32_t *>word, __ATOMIC_ACQUIRE) != <int32_t>expect:
            return True
        if deadline is None:
            slice_ns = WAIT_SLICE_NS
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            slice_ns = min(WAIT_SLICE_NS, <uint64_t>(left * 1e9) + 1)
        with nogil:
            shmq_word_wait(word, expect, slice_ns)
        PyErr_CheckSignals()


def wake(cnp.ndarray arr not None, Py_ssize_t index, n=None):
    """Wake up to n processes (None: all) sleeping in wait() on
    arr[index]; returns how many were woken.  Change the word first."""
    cdef uint32_t *word = _futex_word(arr, index)
    cdef int count = SHMQ_WAKE_ALL if n is None else n
    if count < 1:
        raise ValueError(f"n must be >= 1 or None, got {n!r}")
    return shmq_word_wake(word, count)


cdef object _check_wait_timeout(object timeout):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
    if timeout != timeout or timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    return timeout


def discard_pages(cnp.ndarray arr not None):
    """Give the memory under the whole pages of a C-contiguous array of
    shared memory (shmq.sync.shared_array) back to the system, in every process
    that maps it: the pages read as zeros afterwards and are faulted in
    again on the next write.  Partial pages at either end are kept."""
    if not arr.flags.c_contiguous:
        raise ValueError("discard_pages needs a C-contiguous array")
    cdef size_t page = os.sysconf("SC_PAGE_SIZE")
    cdef size_t start = <size_t>cnp.PyArray_DATA(arr)
    cdef size_t end = start + <size_t>cnp.PyArray_NBYTES(arr)
    cdef size_t lo = (start + page - 1) & ~(page - 1)
    cdef size_t hi = end & ~(page - 1)
    cdef int rc = 0
    if hi <= lo:
        return
    with nogil:
        rc = madvise(<void *>lo, hi - lo, MADV_REMOVE)
    if rc != 0:
        raise OSError(errno, f"cannot discard {hi - lo} bytes of shared memory: {os.strerror(errno)}")
