"""Batch layout: how a sample tree becomes a row of a slab, and a slab a batch.

The default collate (like PyTorch's) stacks each array leaf of the sample
tree along a new first axis, turns numbers into a 1-d array, and gives any
other leaf (str, bytes, None, arbitrary objects) as a list.  Here the
stacking happens in place: each sample is written into its row of the slab
by the worker that loaded it (NOTE [ Direct row writes ] in _table.py), so
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

import hashlib
import math
import pickle
import sys
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

ALIGN = 64
ARRAY, NUMBER, OTHER = 0, 1, 2

# Container nodes of a structure: None is a leaf; otherwise a tuple whose
# first item says how to rebuild it.
DICT, MAPPING, NAMEDTUPLE, TUPLE, LIST = "dict", "mapping", "namedtuple", "tuple", "list"

# dtype of each kind of Python number (numpy scalars keep their own)
_NUMBER_DTYPES = {bool: "|b1", int: "<i8", float: "<f8", complex: "<c16"}


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class ArrayLeaf(NamedTuple):
    offset: int
    dtype: str
    shape: tuple


class Value(NamedTuple):
    value: object


class CollateError(ValueError):
    """Samples of a batch cannot be stacked into one layout."""


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
    leaves.append(obj)
    return None


def unflatten(structure, leaves):
    return _unflatten(structure, iter(leaves))


def _unflatten(s, it):
    # Module level, not a nested recursive closure: such a closure is a
    # reference cycle, and would keep what it references (in materialize:
    # the slab) alive until the cyclic GC runs.
    if s is None:
        return next(it)
    kind = s[0]
    if kind == DICT:
        return {k: _unflatten(v, it) for k, v in zip(s[1], s[2])}
    if kind == LIST:
        return [_unflatten(v, it) for v in s[1]]
    if kind == TUPLE:
        return tuple(_unflatten(v, it) for v in s[1])
    if kind == NAMEDTUPLE:
        return s[1](*(_unflatten(v, it) for v in s[2]))
    items = {k: _unflatten(v, it) for k, v in zip(s[2], s[3])}
    try:
        return s[1](items)
    except TypeError:  # a mapping type that cannot be built from a dict
        return items


# --- leaves and signatures ---------------------------------------------------

def as_array(leaf):
    """The numpy array behind an array-like leaf (ndarray or CPU tensor), or None."""
    if isinstance(leaf, np.ndarray):
        return leaf
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf.detach().cpu().resolve_conj().resolve_neg().numpy()
    return None


def leaf_meta(leaf):
    """(kind, dtype string, shape) of one leaf."""
    arr = as_array(leaf)
    if arr is not None:
        if arr.dtype.hasobject:
            raise CollateError(f"cannot stack arrays of dtype {arr.dtype} into shared memory "
                               f"(their elements are Python objects); convert them to a numeric "
                               f"dtype, or return a list")
        if type(arr) is not np.ndarray:
            raise CollateError(f"cannot stack {type(arr).__name__} arrays (an ndarray subclass "
                               f"would lose its type); return np.asarray(x), or pass collate_fn")
        return (ARRAY, arr.dtype.str, arr.shape)
    code = _NUMBER_DTYPES.get(type(leaf))
    if code is not None:
        return (NUMBER, code, ())
    if isinstance(leaf, np.generic) and leaf.dtype.kind in "biufc":
        return (NUMBER, leaf.dtype.str, ())
    return (OTHER, None, None)


def signature_and_leaves(sample):
    leaves: list = []
    structure = flatten(sample, leaves)
    return (structure, tuple(leaf_meta(leaf) for leaf in leaves)), leaves


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
        common = np.result_type(np.dtype(da), np.dtype(db))
        if common.kind not in "biufc":
            return None  # strings, dates... are not promoted
        meta.append((ka, common.str, sa))
    return (struct_a, tuple(meta))


def describe_difference(sig_a, sig_b) -> str:
    """Why two samples cannot share a layout, for error messages."""
    (struct_a, meta_a), (struct_b, meta_b) = sig_a, sig_b
    if struct_a != struct_b:
        return "a different structure (keys, nesting, lengths or container types)"
    names = ("an array", "a number", "a non-numeric value")
    for i, ((ka, da, sa), (kb, db, sb)) in enumerate(zip(meta_a, meta_b)):
        if ka != kb:
            return f"leaf {i} is {names[kb]} where the batch has {names[ka]}"
        if sa != sb:
            return f"leaf {i} has shape {sb} where the batch has shape {sa}"
        if da != db:
            return f"leaf {i} has dtype {np.dtype(db)} where the batch has {np.dtype(da)}"
    return "the same signature"


def _digest(obj) -> tuple[int, int]:
    """128 bits naming obj in every process: pickling is exact where
    hash() is not (hash(-1) == hash(-2))."""
    d = hashlib.blake2b(pickle.dumps(obj), digest_size=16).digest()
    return tuple(int(w) for w in np.frombuffer(d, np.int64))


class Layout:
    """Where each leaf of a batch of `rows` samples with a given signature
    lives in its slab: array and number leaf i is a (rows,) + shape block
    at offsets[i]; other leaves are kept as lists (values).

    batched=False lays out one collate_fn output as it is: only its arrays
    go to the slab, with no leading axis; numbers stay values."""

    def __init__(self, sig, rows: int, batched: bool = True):
        self.signature, self.rows, self.batched = sig, rows, batched
        self.structure, meta = sig
        self.kinds = [kind if batched or kind != NUMBER else OTHER for kind, _, _ in meta]
        self.dtypes = [None if kind == OTHER else np.dtype(d)
                       for kind, (_, d, _) in zip(self.kinds, meta)]
        self.shapes = [shape for _, _, shape in meta]
        self.offsets, self.row_nbytes = [], []
        offset = 0
        for dtype, shape in zip(self.dtypes, self.shapes):
            self.offsets.append(offset)
            row = 0 if dtype is None else dtype.itemsize * math.prod(shape)
            self.row_nbytes.append(row)
            offset = align(offset + rows * row)
        self.nbytes = offset
        self.value_leaves = [i for i, kind in enumerate(self.kinds) if kind == OTHER]
        self.digest = _digest((sig, rows, batched))
        # Rows' non-numeric leaves, sent apart, fit any layout of the same
        # structure and kinds (dtypes may be promoted in between).
        self.values_key = _digest((self.structure, tuple(self.value_leaves)))[0]

    def write_row(self, slab: np.ndarray, row: int, leaves: list) -> list:
        """Write a sample's leaves into its row of slab (casting numbers and
        arrays to this layout's dtypes, which a caller checked are safe);
        returns its non-numeric leaves, which are not written."""
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
            if self.kinds[i] == ARRAY:
                dst.view(dtype).reshape(self.shapes[i])[...] = as_array(leaf)
            else:
                dst.view(dtype)[0] = leaf
        except (OverflowError, ValueError, TypeError) as e:
            raise CollateError(f"leaf {i} ({type(leaf).__name__}) cannot be stored as {dtype}: "
                               f"{e}; return a value that fits, or pass collate_fn") from e

    def views(self, slab: np.ndarray) -> list:
        """Per leaf: an array of (rows,) + shape over the slab, or None."""
        return [None if kind == OTHER else
                slab[off:off + self.rows * n].view(dtype).reshape((self.rows,) + shape)
                for kind, dtype, shape, off, n in zip(self.kinds, self.dtypes, self.shapes,
                                                      self.offsets, self.row_nbytes)]

    def spec(self, rows: int, values: dict):
        """The batch tree for main, trimmed to `rows` (a short last batch);
        values maps each row to its non-numeric leaves."""
        columns = iter(zip(*(values[r] for r in range(rows)))) if self.value_leaves else iter(())
        leaves = []
        for kind, dtype, shape, off in zip(self.kinds, self.dtypes, self.shapes, self.offsets):
            if kind == OTHER:
                column = list(next(columns)) if rows else []
                leaves.append(Value(column if self.batched else column[0]))
            else:
                leaves.append(ArrayLeaf(off, dtype.str, (rows,) + shape if self.batched else shape))
        return unflatten(self.structure, leaves)


def castable(sig, layout: Layout) -> bool:
    """Can a sample of signature sig be written into layout with only safe
    casts (an int into a float64 batch, say)?"""
    structure, meta = sig
    if structure != layout.structure:
        return False
    for (kind, dtype, shape), lkind, ldtype, lshape in zip(meta, layout.kinds, layout.dtypes,
                                                          layout.shapes):
        if kind != lkind or shape != lshape:
            return False
        if kind != OTHER and not np.can_cast(np.dtype(dtype), ldtype, "safe"):
            return False
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


def materialize(spec, slab: np.ndarray, as_torch: bool):
    """Main side: the batch, with every array a view of the slab.  No
    reference cycle may hold the slab (see _unflatten): the slab is freed,
    and its lease released, the moment the user drops the batch."""
    if isinstance(spec, ArrayLeaf):
        dtype = np.dtype(spec.dtype)
        n = dtype.itemsize * math.prod(spec.shape)
        arr = slab[spec.offset:spec.offset + n].view(dtype=dtype, type=np.ndarray).reshape(spec.shape)
        if as_torch:
            import torch

            return torch.from_numpy(arr)
        return arr
    if isinstance(spec, Value):
        return spec.value
    t = type(spec)
    if t is dict:
        return {k: materialize(v, slab, as_torch) for k, v in spec.items()}
    if t is list:
        return [materialize(v, slab, as_torch) for v in spec]
    if t is tuple:
        return tuple(materialize(v, slab, as_torch) for v in spec)
    if isinstance(spec, tuple) and hasattr(t, "_fields"):
        return t(*(materialize(v, slab, as_torch) for v in spec))
    if isinstance(spec, Mapping):
        items = {k: materialize(v, slab, as_torch) for k, v in spec.items()}
        try:
            return t(items)
        except TypeError:
            return items
    return spec
