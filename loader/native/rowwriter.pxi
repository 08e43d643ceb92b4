# Included by _native.pyx: the worker's per-sample path of NOTE [ Direct row
# writes ] (shared/table.py), compiled.  Per sample: match the sample against the
# plan of its batch's layout (one walk of its tree with C type checks, no
# signature tuple built), then the table protocol with raw atomics, and
# memcpy of each array leaf into its row.  Anything unusual (a new layout,
# a torch tensor, a non-contiguous array, a number that does not fit) takes
# the Python path of shared/layout.py, which is the reference.
#
# Table words and their meaning are defined in shared/table.py (STAMP, OFFSET,
# ROWS, DIGEST0, DIGEST1, FILLED, TOKEN, SEQ); the constants below MUST
# MATCH it (tests/loader_layer/test_loader_units.py compares them).

from cpython.object cimport PyObject, PyTypeObject, Py_TYPE
from cpython.long cimport PyLong_AsLongLong
from cpython.float cimport PyFloat_AsDouble
from cpython.complex cimport PyComplex_RealAsDouble, PyComplex_ImagAsDouble
from cpython.dict cimport PyDict_Next
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

cdef extern from *:
    int64_t __atomic_load_n64 "__atomic_load_n"(int64_t *ptr, int memorder) nogil
    void __atomic_store_n64 "__atomic_store_n"(int64_t *ptr, int64_t val, int memorder) nogil
    int64_t __atomic_fetch_add64 "__atomic_fetch_add"(int64_t *ptr, int64_t val, int memorder) nogil
    bint __atomic_compare_exchange_n64 "__atomic_compare_exchange_n"(
        int64_t *ptr, int64_t *expected, int64_t desired, bint weak, int success_memorder,
        int failure_memorder) nogil
    int __ATOMIC_RELEASE

cdef extern from "numpy/arrayobject.h":
    int PyArray_EquivTypes(cnp.PyArray_Descr *a, cnp.PyArray_Descr *b)
    void PyArray_ScalarAsCtype(object scalar, void *ctypeptr)

# shared/table.py's word indices and flags
cdef enum:
    W_STAMP = 0
    W_OFFSET = 1
    W_DIGEST0 = 3
    W_DIGEST1 = 4
    W_FILLED = 5
    W_TOKEN = 6
    W_SEQ = 7
    ENTRY_WORDS = 8
cdef int64_t VERSION_MASK = (1 << 28) - 1
cdef int64_t F_CONFIRMED = 1 << 28
cdef int64_t F_REFUSED = 1 << 29
TABLE_CONSTANTS = dict(STAMP=W_STAMP, OFFSET=W_OFFSET, DIGEST0=W_DIGEST0, DIGEST1=W_DIGEST1,
                       FILLED=W_FILLED, TOKEN=W_TOKEN, SEQ=W_SEQ, WORDS=ENTRY_WORDS,
                       CONFIRMED=F_CONFIRMED, REFUSED=F_REFUSED)

# leaf kinds (as _layout.ARRAY / NUMBER / OTHER) and how a Python number is stored
cdef enum:
    K_ARRAY = 0
    K_NUMBER = 1
    K_OTHER = 2
    K_TENSOR = 3        # stored as an array; always matched in Python
cdef enum:
    N_INT64 = 0
    N_FLOAT64 = 1
    N_BOOL = 2
    N_COMPLEX128 = 3
    N_OTHER = 4         # only numpy scalars have this dtype
# structure node kinds
cdef enum:
    S_DICT = 1
    S_LIST = 2
    S_TUPLE = 3
    S_TYPED = 4         # namedtuple / mapping: rare, matched in Python
# what RowWriter.place did
cdef enum:
    P_WRITTEN = 0
    P_SENT = 1
    P_DROPPED = 2
    P_ENDED = 3
WRITTEN, SENT, DROPPED, ENDED = P_WRITTEN, P_SENT, P_DROPPED, P_ENDED

from loader.shared import layout as _layout
from loader.shared.messages import NO_VERSION


cdef struct LeafSpec:
    int kind
    int number
    bint python_only      # a tensor (bfloat16 ones too): only the Python path matches it
    int ndim
    cnp.npy_intp dims[32]
    PyObject *descr       # kept alive by Plan.keep
    PyObject *code        # structured dtypes: the dtype code (kept alive by Plan.keep), else NULL
    PyObject *pytype      # numbers: the Python type with this dtype (bool, int...), or NULL
    PyObject *scalar      # numbers: the numpy scalar type of this dtype
    Py_ssize_t offset
    Py_ssize_t row_nbytes


cdef class Plan:
    """A Layout compiled for matching and writing samples in C."""

    cdef readonly object layout
    cdef object program           # the structure, with int node kinds
    cdef list keep
    cdef LeafSpec *leaves
    cdef Py_ssize_t nleaves
    cdef list found               # the leaves of the sample being matched
    cdef readonly int64_t digest0, digest1
    cdef Py_ssize_t tags_offset

    def __cinit__(self):
        self.leaves = NULL

    def __dealloc__(self):
        if self.leaves != NULL:
            PyMem_Free(self.leaves)

    def __init__(self, layout):
        self.layout = layout
        self.keep = []
        self.program = _compile(layout.structure)
        _, meta = layout.signature
        self.nleaves = len(meta)
        self.leaves = <LeafSpec *>PyMem_Malloc(max(1, self.nleaves) * sizeof(LeafSpec))
        if self.leaves == NULL:
            raise MemoryError()
        self.found = [None] * self.nleaves
        self.digest0, self.digest1 = layout.digest
        self.tags_offset = layout.tags_offset
        cdef Py_ssize_t i, d
        cdef LeafSpec *s
        for i in range(self.nleaves):
            s = &self.leaves[i]
            kind, dtype_str, shape = meta[i]
            s.kind = layout.kinds[i]
            s.offset = layout.offsets[i]
            s.row_nbytes = layout.row_nbytes[i]
            s.descr = s.pytype = s.scalar = s.code = NULL
            s.ndim = 0
            s.number = N_OTHER
            s.python_only = kind == K_TENSOR
            if kind == K_TENSOR:
                kind = s.kind = K_ARRAY
            if kind == K_OTHER:
                continue
            dt = _layout.storage_dtype(dtype_str)
            self.keep.append(dt)
            s.descr = <PyObject *>dt
            if dt.names is not None:
                self.keep.append(dtype_str)
                s.code = <PyObject *>dtype_str
            if kind == K_ARRAY:
                s.ndim = len(shape)
                for d in range(s.ndim):
                    s.dims[d] = shape[d]
            elif s.kind == K_NUMBER:
                # Python's bool/int/float/complex and numpy's scalar of the
                # same dtype have the same signature: both are accepted.
                s.number = _number_code(dtype_str)
                s.scalar = <PyObject *>dt.type
                self.keep.append(dt.type)
                t = _NUMBER_TYPES.get(dtype_str)
                if t is not None:
                    s.pytype = <PyObject *>t
            else:  # a number kept as a value (unbatched layouts)
                s.kind = K_OTHER

    cdef bint match(self, object sample) except -1:
        """Does sample have exactly this layout's signature?  Its leaves
        are left in self.found."""
        cdef Py_ssize_t i = 0
        if not _match_node(self, sample, self.program, &i):
            return False
        return i == self.nleaves

    cdef list write(self, char *slab, Py_ssize_t row, int64_t tag):
        """Write the leaves found by match() and the tag into their row;
        returns the non-numeric leaves.  Raises CollateError (through the
        Python path) for what cannot be stored."""
        cdef list values = []
        (<int64_t *>(slab + self.tags_offset))[row] = tag
        cdef Py_ssize_t i
        cdef LeafSpec *s
        cdef char *dst
        cdef void *src
        cdef Py_ssize_t n
        cdef cnp.ndarray arr
        cdef object leaf
        for i in range(self.nleaves):
            s = &self.leaves[i]
            leaf = self.found[i]
            if s.kind == K_OTHER:
                values.append(leaf)
                continue
            dst = slab + s.offset + row * s.row_nbytes
            if s.kind == K_ARRAY:
                if type(leaf) is np.ndarray and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>leaf):
                    arr = <cnp.ndarray>leaf
                    src = cnp.PyArray_DATA(arr)
                    n = s.row_nbytes
                    if n >= NOGIL_COPY_BYTES:  # other threads (thread workers) run meanwhile
                        with nogil:
                            memcpy(dst, src, n)
                    else:
                        memcpy(dst, src, n)
                    continue
            elif _store_number(s, leaf, dst):
                continue
            # The reference path: strided arrays, deferred (file) arrays, numbers
            # that do not fit.
            self.layout.write_leaf(slab_view(slab, s.offset + row * s.row_nbytes, s.row_nbytes),
                                   i, leaf)
        return values


cdef Py_ssize_t NOGIL_COPY_BYTES = 1 << 16


cdef object slab_view(char *p, Py_ssize_t offset, Py_ssize_t n):
    cdef cnp.npy_intp dims = n
    return cnp.PyArray_SimpleNewFromData(1, &dims, cnp.NPY_UINT8, p + offset)


_NUMBER_TYPES = {"|b1": bool, "<i8": int, "<f8": float, "<c16": complex}


cdef int _number_code(str dtype_str):
    if dtype_str == "<i8":
        return N_INT64
    if dtype_str == "<f8":
        return N_FLOAT64
    if dtype_str == "|b1":
        return N_BOOL
    if dtype_str == "<c16":
        return N_COMPLEX128
    return N_OTHER


cdef object _compile(object s):
    """_layout's structure with the container kinds as ints."""
    if s is None:
        return None
    kind = s[0]
    if kind == _layout.DICT:
        return (S_DICT, s[1], tuple(_compile(c) for c in s[2]))
    if kind == _layout.LIST:
        return (S_LIST, len(s[1]), tuple(_compile(c) for c in s[1]))
    if kind == _layout.TUPLE:
        return (S_TUPLE, len(s[1]), tuple(_compile(c) for c in s[1]))
    return (S_TYPED, s, None)  # namedtuples and mappings: rare, matched in Python


cdef bint _match_node(Plan plan, object obj, object node, Py_ssize_t *i) except -1:
    cdef Py_ssize_t pos = 0, k = 0, n
    cdef PyObject *key
    cdef PyObject *value
    if node is None:
        if i[0] >= plan.nleaves or not _leaf_matches(&plan.leaves[i[0]], obj):
            return False
        plan.found[i[0]] = obj
        i[0] += 1
        return True
    kind = <int>node[0]
    if kind == S_DICT:
        if type(obj) is not dict:
            return False
        keys, children = <tuple>node[1], <tuple>node[2]
        n = len(keys)
        if len(<dict>obj) != n:
            return False
        while PyDict_Next(obj, &pos, &key, &value):
            if <object>key is not keys[k] and <object>key != keys[k]:
                return False
            if not _match_node(plan, <object>value, children[k], i):
                return False
            k += 1
        return True
    if kind == S_LIST or kind == S_TUPLE:
        if type(obj) is not (list if kind == S_LIST else tuple):
            return False
        n = <Py_ssize_t>node[1]
        if len(obj) != n:
            return False
        children = <tuple>node[2]
        for k in range(n):
            if not _match_node(plan, obj[k], children[k], i):
                return False
        return True
    # a namedtuple or mapping: its own structure must be this node's
    leaves = []
    if _layout.flatten(obj, leaves) != node[1]:
        return False
    for leaf in leaves:
        if not _match_node(plan, leaf, None, i):
            return False
    return True


cdef bint _leaf_matches(LeafSpec *s, object leaf) except -1:
    cdef cnp.ndarray arr
    cdef int d
    if s.kind == K_ARRAY:
        if type(leaf) is not np.ndarray or s.python_only:
            return False  # a tensor, a subclass: the Python path decides
        arr = <cnp.ndarray>leaf
        if cnp.PyArray_NDIM(arr) != s.ndim:
            return False
        for d in range(s.ndim):
            if cnp.PyArray_DIMS(arr)[d] != s.dims[d]:
                return False
        if <PyObject *>cnp.PyArray_DESCR(arr) == s.descr:
            return True
        if not PyArray_EquivTypes(cnp.PyArray_DESCR(arr), <cnp.PyArray_Descr *>s.descr):
            return False
        # Structured dtypes that are equivalent in numpy's sense may still
        # differ in field titles or the aligned flag: the batch keeps one
        # exact dtype (NOTE [ Dtype codes ] in shared/layout.py).
        return s.code == NULL or _layout.dtype_code(
            <object><PyObject *>cnp.PyArray_DESCR(arr)) == <object>s.code
    cdef PyObject *t = <PyObject *>Py_TYPE(leaf)
    if s.kind == K_NUMBER:
        return t == s.pytype or t == s.scalar
    # OTHER: exactly what _layout.leaf_meta calls OTHER
    t2 = type(leaf)
    if t2 is str or t2 is bytes or leaf is None:
        return True
    return _layout.leaf_meta(leaf)[0] == K_OTHER


cdef bint _store_number(LeafSpec *s, object leaf, char *dst) except -1:
    """Store a number leaf; False when it must take the Python path."""
    cdef long long v
    if <PyObject *>Py_TYPE(leaf) == s.scalar:
        PyArray_ScalarAsCtype(leaf, dst)  # a numpy scalar of exactly this dtype
    elif s.number == N_INT64:
        try:
            v = PyLong_AsLongLong(leaf)
        except OverflowError:
            return False
        (<int64_t *>dst)[0] = v
    elif s.number == N_FLOAT64:
        (<double *>dst)[0] = PyFloat_AsDouble(leaf)
    elif s.number == N_BOOL:
        (<uint8_t *>dst)[0] = 1 if leaf is True else 0
    elif s.number == N_COMPLEX128:
        (<double *>dst)[0] = PyComplex_RealAsDouble(leaf)
        (<double *>dst)[1] = PyComplex_ImagAsDouble(leaf)
    else:
        return False
    return True


cdef class RowWriter:
    """Worker side of NOTE [ Direct row writes ]: place one sample in its
    row, writing it directly whenever the batch's layout is its own."""

    cdef object table, arena, hazards, channel, plans, layouts, ctl_array
    cdef Plan last
    cdef int64_t *ctl
    cdef Py_ssize_t finished_word[2]
    cdef int64_t *words
    cdef Py_ssize_t per_run, nwords
    cdef int64_t *hazard
    cdef char *base
    cdef Py_ssize_t arena_bytes
    cdef WarmChunks warm

    def __init__(self, table, cnp.ndarray arena not None, cnp.ndarray hazards not None,
                 int worker_id, channel, cnp.ndarray ctl=None, finished_words=(-1, -1)):
        """ctl and finished_words: the ctl array and, per run parity, the
        index of its FINISHED word (NOTE [ Runs ]): a row of a batch below
        it is dropped."""
        cdef cnp.ndarray words = table.words
        if words.dtype != np.int64 or hazards.dtype != np.int64 or arena.dtype != np.uint8:
            raise TypeError("table words and hazards are int64, the arena uint8")
        if not 0 <= worker_id < hazards.shape[0]:
            raise IndexError(f"worker {worker_id} has no hazard word among {hazards.shape[0]}")
        self.table, self.arena, self.hazards, self.channel = table, arena, hazards, channel
        self.words = <int64_t *>cnp.PyArray_DATA(words)
        self.nwords = words.shape[0]
        self.per_run = table.per_run
        self.hazard = <int64_t *>cnp.PyArray_DATA(hazards) + worker_id
        self.base = <char *>cnp.PyArray_DATA(arena)
        self.arena_bytes = arena.nbytes
        self.warm = WarmChunks(arena)
        self.plans = {}
        self.layouts = _layout.LayoutCache()
        self.last = None
        self.ctl = NULL
        if ctl is not None:
            if ctl.dtype != np.int64 or not 0 <= min(finished_words) <= max(finished_words) \
                    < ctl.shape[0]:
                raise IndexError("finished_words must index the int64 ctl array")
            self.ctl_array = ctl
            self.ctl = <int64_t *>cnp.PyArray_DATA(ctl)
            self.finished_word[0], self.finished_word[1] = finished_words

    cdef Plan _plan(self, object sample, Py_ssize_t rows, bint batched):
        """The plan whose layout is sample's own, with its leaves found."""
        cdef Plan plan = self.last
        if plan is not None and plan.layout.rows == rows and plan.layout.batched == batched \
                and plan.match(sample):
            return plan
        sig, leaves = _layout.signature_and_leaves(sample)  # CollateError if no batch can take it
        layout = self.layouts.get(sig, rows, batched)
        plan = self.plans.get(id(layout))
        if plan is None or plan.layout is not layout:
            if len(self.plans) > 64:
                self.plans.clear()
            plan = self.plans[id(layout)] = Plan(layout)
        if not plan.match(sample):
            # Leaves only the Python path knows (a torch tensor, an ndarray
            # whose dtype compares equal but is another object): its leaves,
            # arrays as numpy, are what write() takes.
            plan.found = [_layout.as_array(leaf) if kind == K_ARRAY or kind == K_TENSOR else leaf
                          for leaf, kind in zip(leaves, layout.kinds)]
        self.last = plan
        return plan

    def place(self, int64_t run, int64_t batch, Py_ssize_t row, Py_ssize_t rows, int64_t pos,
              sample, bint batched=True):
        """Place sample in row `row` of batch `batch` (which has `rows`
        rows).  Returns WRITTEN, SENT (the batcher has it), DROPPED (the
        batch was refused) or ENDED (the run ended meanwhile).  Raises
        CollateError for a sample no batch could take."""
        cdef Plan plan = self._plan(sample, rows, batched)
        cdef Py_ssize_t entry = (run % 2) * self.per_run + batch % self.per_run
        cdef int64_t *e = self.words + entry * ENTRY_WORDS
        cdef int64_t want = (run << 32) | (batch + 1)
        cdef int64_t seq, filled, stamp, d0, d1, offset, token, version, flags, old, asked = -2
        cdef Py_ssize_t nbytes = plan.layout.nbytes
        cdef list values
        cdef bint counted
        if (entry + 1) * ENTRY_WORDS > self.nwords:
            raise IndexError("batch table entry out of range")
        while True:
            if self.ctl != NULL and batch < __atomic_load_n64(
                    self.ctl + self.finished_word[run % 2], __ATOMIC_ACQUIRE):
                return P_DROPPED  # given up (a sample of it failed): see FINISHED in NOTE [ Runs ]
            seq = __atomic_load_n64(e + W_SEQ, __ATOMIC_ACQUIRE)
            if seq & 1:  # the batcher is changing it
                if not self.channel.wait_for_entry(run, batch, entry * ENTRY_WORDS, seq):
                    return P_ENDED
                continue
            filled = __atomic_load_n64(e + W_FILLED, __ATOMIC_ACQUIRE)
            stamp = __atomic_load_n64(e + W_STAMP, __ATOMIC_ACQUIRE)
            d0 = e[W_DIGEST0]
            d1 = e[W_DIGEST1]
            offset = e[W_OFFSET]
            token = e[W_TOKEN]
            if __atomic_load_n64(e + W_SEQ, __ATOMIC_ACQUIRE) != seq:
                continue  # changed while we read it
            if stamp != want:
                if asked == -2:  # once: the batcher remembers the batch
                    self.channel.request_layout(run, batch, row, plan.layout.signature, NO_VERSION,
                                                rows, batched)
                    asked = seq
                if not self.channel.wait_for_entry(run, batch, entry * ENTRY_WORDS, seq):
                    return P_ENDED
                continue
            flags = (filled >> 32) & ~VERSION_MASK
            if flags & F_REFUSED:
                return P_DROPPED
            version = (filled >> 32) & VERSION_MASK
            if d0 == plan.digest0 and d1 == plan.digest1:
                if offset < 0 or offset + nbytes > self.arena_bytes:
                    raise RuntimeError(f"batch table entry points outside the arena "
                                       f"({offset} + {nbytes} > {self.arena_bytes})")
                __atomic_fetch_add64(self.hazard, token, __ATOMIC_SEQ_CST)  # SYNC POINT: then re-check
                try:
                    if __atomic_load_n64(e + W_SEQ, __ATOMIC_ACQUIRE) != seq:
                        continue  # changed meanwhile: look again
                    with nogil:  # page tables in bulk, once per chunk: NOTE [ Warming the arena ]
                        self.warm.ensure(offset, nbytes)
                    values = plan.write(self.base + offset, row, pos)
                    if values:
                        self.channel.row_values(run, batch, row, plan.layout.values_key, values)
                    counted = False
                    while True:
                        old = __atomic_load_n64(e + W_FILLED, __ATOMIC_ACQUIRE)
                        if ((old >> 32) & VERSION_MASK) != version:
                            break  # the batch was laid out again: write it there
                        if __atomic_compare_exchange_n64(e + W_FILLED, &old, old + 1, False,
                                                         __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST):
                            counted = True
                            break
                finally:
                    __atomic_store_n64(self.hazard, 0, __ATOMIC_RELEASE)
                if not counted:
                    continue
                if (old & 0xFFFFFFFF) + 1 == rows:
                    self.channel.filled(run, batch)
                return P_WRITTEN
            if not (flags & F_CONFIRMED) and (filled & 0xFFFFFFFF) == 0:
                if asked != seq:
                    self.channel.request_layout(run, batch, row, plan.layout.signature, version,
                                                rows, batched)
                    asked = seq
                if not self.channel.wait_for_entry(run, batch, entry * ENTRY_WORDS, seq):
                    return P_ENDED
                continue
            self.channel.sample_row(run, batch, row, pos, sample, version)
            return P_SENT
