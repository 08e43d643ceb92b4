"""Batch layout: how a sample tree becomes a row of a slab, and a slab a batch.

The default collate (like PyTorch's) stacks each array leaf of the sample
tree along a new first axis, turns numbers into a 1-d array, and gives any
other leaf (str, bytes, None, arbitrary objects) as a list.  Here the
stacking happens in place: each sample is written into its row of the slab
by the worker that loaded it (NOTE [ Direct row writes ] in shared/table.py), so
a batch is never assembled twice.

A *signature* says what fixes a sample's place in a batch: its structure
(containers, keys, lengths, container types) and, per leaf, its kind,
dtype and shape.  Samples with equal signatures share a Layout.  A batch
whose samples differ only in dtypes (an int in one, a float in another) is
promoted like ``np.result_type`` over the batch; any other difference is
refused (CollateError with the remedy), never truncated or guessed.

What travels to main is a *spec*: the batch tree with every array leaf
replaced by an ArrayLeaf (where in the slab, which dtype and shape) and
every other leaf by a Value.  Main turns it into views (materialize).
"""

from __future__ import annotations

import ast
import hashlib
import io
import math
import pickle
from collections.abc import Mapping, MutableMapping, Sequence
from typing import NamedTuple

import numpy as np

from loader.errors import BatchMismatch, CollateError, UnsupportedLeaf
from loader.shared.class_identity import found_by_name
from loader.shared.optional import imported_torch

ALIGN = 64
ARRAY, NUMBER, OTHER, TENSOR = 0, 1, 2, 3   # leaf kinds; a TENSOR is stored as an ARRAY

# Container nodes of a structure: None is a leaf; otherwise a tuple whose
# first item says how to rebuild it.
DICT, MAPPING, NAMEDTUPLE, TUPLE, LIST, SEQUENCE = (
    "dict", "mapping", "namedtuple", "tuple", "list", "sequence")

# dtype of each kind of Python number (numpy scalars keep their own)
_NUMBER_DTYPES = {bool: "|b1", int: "<i8", float: "<f8", complex: "<c16"}

# torch.bfloat16 has no numpy dtype: its leaves are stored as uint16 words
# and carry this code instead of a numpy dtype string.
BFLOAT16 = "bf16"


# NOTE [ Dtype codes ]
# A signature names each array leaf's dtype by a string code, and the code
# alone must give the dtype back exactly in every process (signatures
# travel to the batcher, specs to main).  dtype.str does for a plain
# dtype, but says only "|V12" for a structured one, losing its fields:
# those are named by str(dtype) instead, which numpy writes as the literal
# np.dtype() takes back (names, formats, offsets, itemsize, titles,
# "aligned", nested and sub-array fields).  Equal codes are equal dtypes,
# so a batch of two structured dtypes of one itemsize has two signatures
# (BatchMismatch), and only numeric codes are ever promoted or cast.

_CODES: dict = {}    # (structured dtype, aligned) -> its code
_DTYPES: dict = {}   # code -> dtype: main calls storage_dtype for every leaf of every batch


def dtype_code(dt: np.dtype) -> str:
    """The exact code of an array's dtype (NOTE [ Dtype codes ])."""
    if dt.names is None:
        return dt.str
    # Keyed with the aligned flag: dtypes that differ only in it compare equal.
    key = (dt, dt.isalignedstruct)
    code = _CODES.get(key)
    if code is None:
        code = str(dt)
        try:
            back = _parse_code(code)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            back = None
        if back != dt or back.isalignedstruct != dt.isalignedstruct:
            raise UnsupportedLeaf(f"cannot describe the structured dtype {dt} exactly to other "
                                  f"processes (numpy does not read its description back); use "
                                  f"fields of plain numpy dtypes, or pass collate_fn")
        if len(_CODES) >= 256:
            _CODES.clear()  # a dataset making ever new dtypes must not grow it without bound
        _CODES[key] = code
    return code


def _parse_code(code: str) -> np.dtype:
    if code == BFLOAT16:
        return np.dtype(np.uint16)
    if code[:1] in ("[", "{"):  # a structured dtype's str(): a literal, never code to run
        return np.dtype(ast.literal_eval(code))
    return np.dtype(code)


def storage_dtype(code: str) -> np.dtype:
    """The numpy dtype a leaf's bytes are stored as."""
    dt = _DTYPES.get(code)
    if dt is None:
        dt = _parse_code(code)
        if len(_DTYPES) >= 256:
            _DTYPES.clear()
        _DTYPES[code] = dt
    return dt


def _numeric(code: str) -> bool:
    """May a leaf of this dtype code be promoted or cast to another?
    Numbers only: bfloat16 mixes with nothing (numpy cannot promote it),
    and structured, void, string and date dtypes are kept exactly as they
    are (np.result_type would pad voids or match fields by position)."""
    return code != BFLOAT16 and storage_dtype(code).kind in "biufc"


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class ArrayLeaf(NamedTuple):
    offset: int
    dtype: str       # dtype code (NOTE [ Dtype codes ]), or BFLOAT16
    shape: tuple
    tensor: bool     # it was a torch tensor in the sample (output="keep" gives one back)


class Value(NamedTuple):
    value: object
    batched: bool = True   # a column of one leaf per row (else one value: unbatched)


class Spec(NamedTuple):
    """A batch as main receives it: the structure of its tree and its
    leaves (ArrayLeaf: where in the slab; Value: the values themselves).
    The containers are built only in main, around the real arrays (a
    container type may check what it is given: torch's PackedSequence)."""
    structure: object
    leaves: tuple
    rows_values: tuple | None = None  # rows' values by reference: see Layout.spec


# --- structure -------------------------------------------------------------

def flatten(obj, leaves: list):
    """The structure of obj (hashable, exact) and its leaves, depth first."""
    t = type(obj)
    if t is dict:
        return (DICT, tuple(obj), tuple(flatten(v, leaves) for v in obj.values()))
    if t is list:
        return (LIST, tuple(flatten(v, leaves) for v in obj))
    if t is tuple:
        return (TUPLE, tuple(flatten(v, leaves) for v in obj))
    if isinstance(obj, tuple) and hasattr(t, "_fields"):  # a namedtuple keeps its type
        return (NAMEDTUPLE, t, tuple(flatten(v, leaves) for v in obj))
    if isinstance(obj, Mapping):  # OrderedDict and other mappings: rebuilt as their type
        return (MAPPING, t, tuple(obj), tuple(flatten(v, leaves) for v in obj.values()))
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes, bytearray)):
        # a list subclass or another sequence type (a range, say): rebuilt
        # as its type when it can be built from a list, else a list
        return (SEQUENCE, t, tuple(flatten(v, leaves) for v in obj))
    leaves.append(obj)
    return None


def unflatten(structure, leaves, tuples_as_lists: bool = False):
    """The tree of `structure` with these leaves.  tuples_as_lists: torch's
    default_collate makes a list of a batch of tuples."""
    return _unflatten(structure, iter(leaves), tuples_as_lists)


def _unflatten(s, it, lists):
    # Module level, not a nested recursive closure: such a closure is a
    # reference cycle, and would keep what it references (in materialize:
    # the slab) alive until the cyclic GC runs.
    if s is None:
        return next(it)
    kind = s[0]
    if kind == DICT:
        return {k: _unflatten(v, it, lists) for k, v in zip(s[1], s[2])}
    if kind == LIST:
        return [_unflatten(v, it, lists) for v in s[1]]
    if kind == TUPLE:
        items = [_unflatten(v, it, lists) for v in s[1]]
        return items if lists else tuple(items)
    if kind == NAMEDTUPLE:
        return s[1](*(_unflatten(v, it, lists) for v in s[2]))
    if kind == SEQUENCE:
        return rebuild(s[1], [_unflatten(v, it, lists) for v in s[2]])
    return rebuild(s[1], {k: _unflatten(v, it, lists) for k, v in zip(s[2], s[3])})


def rebuild(t: type, items):
    """A container of type t holding items (a list or a dict), as torch's
    default_collate rebuilds mapping and sequence types; the plain list or
    dict when t cannot be built from one."""
    try:
        return t(items)
    except Exception:
        if isinstance(items, dict) and issubclass(t, MutableMapping):
            try:  # e.g. a defaultdict: built empty, then filled
                out = t()
                out.update(items)
                return out
            except Exception:
                pass
        return items


# --- leaves and signatures ---------------------------------------------------

def is_deferred(leaf) -> bool:
    """An array read only when it is stored (a FileDataset file): it has a
    dtype, a shape and read_into(out)."""
    return hasattr(type(leaf), "read_into") and not isinstance(leaf, np.ndarray)


def as_array(leaf):
    """The numpy array behind an array-like leaf (ndarray or CPU tensor; a
    deferred array is its own), or None.  A bfloat16 tensor gives its
    uint16 words."""
    if type(leaf) is np.memmap:
        return leaf.view(np.ndarray)  # only storage: its data is what counts
    if isinstance(leaf, np.ndarray) or is_deferred(leaf):
        return leaf
    torch = imported_torch()
    if torch is not None and isinstance(leaf, torch.Tensor):
        t = leaf.detach().cpu().resolve_conj().resolve_neg()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()
    return None


def _is_bfloat16(leaf) -> bool:
    torch = imported_torch()
    return torch is not None and isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bfloat16


def leaf_meta(leaf):
    """(kind, dtype string, shape) of one leaf."""
    arr = as_array(leaf)
    if arr is not None:
        torch = imported_torch()
        kind = TENSOR if torch is not None and isinstance(leaf, torch.Tensor) else ARRAY
        if _is_bfloat16(leaf):
            return (TENSOR, BFLOAT16, arr.shape)
        if arr.dtype.hasobject:
            raise UnsupportedLeaf(f"cannot stack arrays of dtype {arr.dtype} into shared memory "
                                  f"(their elements are Python objects); convert them to a numeric "
                                  f"dtype, or return a list")
        if type(arr) is not np.ndarray and not is_deferred(arr):
            raise UnsupportedLeaf(f"cannot stack {type(arr).__name__} arrays (an ndarray subclass "
                                  f"would lose its type); return np.asarray(x), or pass collate_fn")
        if arr.dtype.itemsize == 0:
            # No bytes to lay out, and numpy makes no view of dtype V0 over a slab.
            raise UnsupportedLeaf(f"cannot stack arrays of dtype {arr.dtype} (its items have no "
                                  f"bytes); return a dtype with data, or leave the leaf out")
        return (kind, dtype_code(arr.dtype), tuple(arr.shape))
    code = _NUMBER_DTYPES.get(type(leaf))
    if code is not None:
        return (NUMBER, code, ())
    if isinstance(leaf, np.generic) and leaf.dtype.kind in "biufc":
        return (NUMBER, leaf.dtype.str, ())
    return (OTHER, None, None)


def signature_and_leaves(sample):
    leaves: list = []
    structure = flatten(sample, leaves)
    meta = []
    for leaf in leaves:
        try:
            meta.append(leaf_meta(leaf))
        except UnsupportedLeaf as e:  # the leaf's own words, and where it is in the sample
            raise UnsupportedLeaf(f"leaf {len(meta)}{leaf_name(structure, len(meta), leaves)}: "
                                  f"{e}") from None
    return (structure, tuple(meta)), leaves


def leaf_name(structure, i: int, leaves=None) -> str:
    """Where leaf i is in a sample of this structure, as the user indexes
    it, and the file it is read from (a FileDataset's), for messages:
    " (sample['x'][0])"."""
    path = _leaf_path(structure, [i])
    where = "the sample itself" if not path else f"sample{path}"
    leaf = leaves[i] if leaves is not None and i < len(leaves) else None
    if is_deferred(leaf) and hasattr(leaf, "path"):
        where += f", file {leaf.path!r}"
    return f" ({where})"


def _leaf_path(s, left: list):
    """The index path of leaf left[0] under node s ("" for s itself), or
    None when s holds fewer leaves (left[0] then counts down past them)."""
    if s is None:
        left[0] -= 1
        return "" if left[0] < 0 else None
    kind = s[0]
    if kind == DICT:
        keys, children = s[1], s[2]
    elif kind == MAPPING:
        keys, children = s[2], s[3]
    elif kind == NAMEDTUPLE:
        keys, children = s[1]._fields, s[2]
    else:
        children = s[2] if kind == SEQUENCE else s[1]
        keys = range(len(children))
    for key, child in zip(keys, children):
        rest = _leaf_path(child, left)
        if rest is not None:
            return (f".{key}" if kind == NAMEDTUPLE else f"[{key!r}]") + rest
    return None


def signature(sample):
    return signature_and_leaves(sample)[0]


def promoted(sig_a, sig_b):
    """The signature both samples fit once dtypes are promoted (numbers and
    arrays of equal shapes, like np.result_type over the batch), or None
    when they differ in anything else."""
    (struct_a, meta_a), (struct_b, meta_b) = sig_a, sig_b
    if struct_a != struct_b:
        return None
    meta = []
    for (ka, da, sa), (kb, db, sb) in zip(meta_a, meta_b):
        if ka != kb or sa != sb:
            return None
        if ka == OTHER or da == db:
            meta.append((ka, da, sa))
            continue
        if not (_numeric(da) and _numeric(db)):
            return None  # strings, dates, structs... are not promoted
        meta.append((ka, np.result_type(storage_dtype(da), storage_dtype(db)).str, sa))
    return (struct_a, tuple(meta))


def describe_difference(sig_a, sig_b, leaves=None) -> str:
    """Why two samples cannot share a layout, for error messages (leaves:
    the second sample's, to name the file a leaf is read from)."""
    (struct_a, meta_a), (struct_b, meta_b) = sig_a, sig_b
    if struct_a != struct_b:
        return "a different structure (keys, nesting, lengths or container types)"
    names = ("an array", "a number", "a non-numeric value", "a tensor")
    for i, ((ka, da, sa), (kb, db, sb)) in enumerate(zip(meta_a, meta_b)):
        where = leaf_name(struct_b, i, leaves)
        if ka != kb:
            return f"leaf {i} is {names[kb]} where the batch has {names[ka]}{where}"
        if sa != sb:
            return f"leaf {i} has shape {sb} where the batch has shape {sa}{where}"
        if da != db:
            return (f"leaf {i} has dtype {_dtype_name(db)} where the batch has "
                    f"{_dtype_name(da)}{where}")
    return "the same signature"


def misfit(batch: int, row: int, batch_sig, sig, leaves=None) -> "CollateError":
    """The error for a sample (its leaves, if known) that cannot join its batch."""
    return BatchMismatch(
        f"a sample of batch {batch} (row {row}) does not fit the batch: "
        f"{describe_difference(batch_sig, sig, leaves)}. Default collate stacks samples of "
        f"equal structure and shapes, and of equal dtypes unless both are numeric: pad or "
        f"convert them, or pass collate_fn")


def stack(samples: list, cache: "LayoutCache", buffer=np.empty, batch: int = 0,
          index_of=None):
    """Default collate in one process (num_workers=0): the samples stacked
    by the rules the workers and the batcher follow (promotion, refusal),
    as (spec, buffer).  index_of: row -> the sample's dataset index, for errors."""
    sig, rows = None, []
    for r, sample in enumerate(samples):
        try:
            s, leaves = signature_and_leaves(sample)
            if sig is not None and s != sig:
                wider = promoted(sig, s)
                if wider is None:
                    raise misfit(batch, r, sig, s, leaves)
                s = wider
        except CollateError as e:
            if index_of is None:
                raise
            # what the workers' errors say (raise_reported in errors.py): which sample
            raise type(e)(f"on sample index {index_of(r)}: {e}") from None
        sig = s
        rows.append(leaves)
    layout = cache.get(sig, len(samples))
    buf = buffer(layout.nbytes, np.uint8)
    values = {}
    for r, leaves in enumerate(rows):
        v = layout.write_row(buf, r, leaves, r)
        if layout.value_leaves:
            values[r] = v
    return layout.spec(len(samples), values), buf


def _dtype_name(code: str) -> str:
    return "bfloat16" if code == BFLOAT16 else str(storage_dtype(code))


class _DigestPickler(pickle.Pickler):
    """Pickles a signature for its digest.  A container type pickle cannot
    find by name is named by its qualified name and identity instead (it
    can only be met in one process, or in processes forked after it was
    made, where it has the same identity)."""

    def reducer_override(self, obj):
        if isinstance(obj, type) and not found_by_name(obj):
            return str, (f"{obj.__module__}.{obj.__qualname__}#{id(obj)}",)
        return NotImplemented


def _digest(obj) -> tuple[int, int]:
    """128 bits naming obj in every process: pickling is exact where
    hash() is not (hash(-1) == hash(-2))."""
    buf = io.BytesIO()
    _DigestPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    d = hashlib.blake2b(buf.getvalue(), digest_size=16).digest()
    return tuple(int(w) for w in np.frombuffer(d, np.int64))


class Layout:
    """Where each leaf of a batch of `rows` samples with a given signature
    lives in its slab: array and number leaf i is a (rows,) + shape block
    at offsets[i]; other leaves are kept as lists (values).  After them,
    tags_offset holds one int64 per row, the tag its writer gives it (the
    sample's position in the run, or its number in a worker's stream):
    main reads them to know which samples it delivered (state_dict).

    batched=False lays out one collate_fn output as it is: only its arrays
    go to the slab, with no leading axis; numbers stay values."""

    def __init__(self, sig, rows: int, batched: bool = True):
        self.signature, self.rows, self.batched = sig, rows, batched
        self.structure, meta = sig
        self.kinds = [kind if batched or kind != NUMBER else OTHER for kind, _, _ in meta]
        self.codes = [None if kind == OTHER else d for kind, (_, d, _) in zip(self.kinds, meta)]
        self.dtypes = [None if code is None else storage_dtype(code) for code in self.codes]
        self.shapes = [shape for _, _, shape in meta]
        self.offsets, self.row_nbytes = [], []
        offset = 0
        for dtype, shape in zip(self.dtypes, self.shapes):
            self.offsets.append(offset)
            row = 0 if dtype is None else dtype.itemsize * math.prod(shape)
            self.row_nbytes.append(row)
            offset = align(offset + rows * row)
        self.tags_offset = offset
        self.nbytes = align(offset + 8 * rows)
        self.value_leaves = [i for i, kind in enumerate(self.kinds) if kind == OTHER]
        self.digest = _digest((sig, rows, batched))
        # Rows' non-numeric leaves, sent apart, fit any layout of the same
        # structure and kinds (dtypes may be promoted in between).
        self.values_key = _digest((self.structure, tuple(self.value_leaves)))[0]

    def write_row(self, slab: np.ndarray, row: int, leaves: list, tag: int = -1) -> list:
        """Write a sample's leaves and tag into its row of slab (casting
        numbers and arrays to this layout's dtypes, which a caller checked
        are safe); returns its non-numeric leaves, which are not written."""
        self.tags(slab)[row] = tag
        values = []
        for i, (leaf, kind, off, n) in enumerate(zip(leaves, self.kinds, self.offsets,
                                                     self.row_nbytes)):
            if kind == OTHER:
                values.append(leaf)
            else:
                self.write_leaf(slab[off + row * n:off + row * n + n], i, leaf)
        return values

    def write_leaf(self, dst: np.ndarray, i: int, leaf) -> None:
        """Store array or number leaf i into dst, the uint8 bytes of its row."""
        dtype = self.dtypes[i]
        try:
            if self.kinds[i] != NUMBER:
                out = dst.view(dtype).reshape(self.shapes[i])
                if is_deferred(leaf):
                    leaf.read_into(out)  # straight into the row
                else:
                    out[...] = as_array(leaf)
            else:
                dst.view(dtype)[0] = leaf
        except (OverflowError, ValueError, TypeError) as e:
            raise CollateError(f"leaf {i} ({type(leaf).__name__}) cannot be stored as {dtype}: "
                               f"{e}; return a value that fits, or pass collate_fn") from e

    def tags(self, slab: np.ndarray) -> np.ndarray:
        """The rows' tags in slab (an int64 array of `rows`)."""
        return slab[self.tags_offset:self.tags_offset + 8 * self.rows].view(np.int64)

    def views(self, slab: np.ndarray) -> list:
        """Per leaf: an array of (rows,) + shape over the slab, or None."""
        return [None if kind == OTHER else
                slab[off:off + self.rows * n].view(dtype).reshape((self.rows,) + shape)
                for kind, dtype, shape, off, n in zip(self.kinds, self.dtypes, self.shapes,
                                                      self.offsets, self.row_nbytes)]

    def spec(self, rows: int, values: dict):
        """The batch tree for main, trimmed to `rows` (a short last batch);
        values maps each row to its non-numeric leaves: a list, or a
        reference to a block of them in the spill heap, which main opens
        (NOTE [ Spilled messages ]): then the spec keeps the rows' entries
        and its Value leaves are filled in main (with_values)."""
        rows_values = [values[r] for r in range(rows)] if self.value_leaves else []
        by_reference = any(type(v) is not list for v in rows_values)
        columns = iter(()) if by_reference else _columns(rows_values, len(self.value_leaves))
        leaves = []
        for kind, code, shape, off in zip(self.kinds, self.codes, self.shapes, self.offsets):
            if kind == OTHER:
                leaves.append(Value(None if by_reference else
                                    _column_value(next(columns), self.batched), self.batched))
            else:
                leaves.append(ArrayLeaf(off, code, (rows,) + shape if self.batched else shape,
                                        kind == TENSOR))
        return Spec(self.structure, tuple(leaves), tuple(rows_values) if by_reference else None)


def _columns(rows_values: list, n: int):
    """Per value leaf, its column (a list of one value per row)."""
    return iter([list(c) for c in zip(*rows_values)] if rows_values else [[] for _ in range(n)])


def _column_value(column: list, batched: bool):
    return column if batched else column[0]


def with_values(spec: Spec, rows_values: list) -> Spec:
    """spec with its Value leaves filled from the rows' values (lists), for
    a spec made with references (Layout.spec)."""
    n = sum(type(leaf) is Value for leaf in spec.leaves)
    columns = _columns(rows_values, n)
    return Spec(spec.structure, tuple(
        Value(_column_value(next(columns), leaf.batched), leaf.batched) if type(leaf) is Value
        else leaf for leaf in spec.leaves))


def castable(sig, layout: Layout) -> bool:
    """Can a sample of signature sig be written into layout with only safe
    casts (an int into a float64 batch, say)?"""
    structure, meta = sig
    if structure != layout.structure:
        return False
    for (kind, code, shape), lkind, lcode, lshape in zip(meta, layout.kinds, layout.codes,
                                                         layout.shapes):
        if kind != lkind or shape != lshape:
            return False
        if kind == OTHER or code == lcode:
            continue
        if not (_numeric(code) and _numeric(lcode)) or \
                not np.can_cast(storage_dtype(code), storage_dtype(lcode), "safe"):
            return False  # (numpy casts one struct to another by position: never here)
    return True


class LayoutCache:
    """(signature, rows, batched) -> Layout for the most recent layouts:
    building one pickles and hashes its signature, so it is built once."""

    SIZE = 64

    def __init__(self):
        self._found: dict = {}

    def get(self, sig, rows: int, batched: bool = True) -> Layout:
        key = (sig, rows, batched)
        layout = self._found.get(key)
        if layout is None:
            layout = self._found[key] = Layout(sig, rows, batched)
            if len(self._found) > self.SIZE:  # varying layouts: forget the oldest
                del self._found[next(iter(self._found))]
        return layout
