"""Batch layout: how a sample tree becomes a slab, and a slab a batch.

The default collate (like PyTorch's) stacks each array leaf of the sample
tree along a new first axis, turns numbers into a 1-d array, and gives any
other leaf (str, bytes, None...) as a list.  Here the stacking happens in
place: each sample is written into its row of the slab as it arrives (by
its worker, or by the collator: NOTE [ Direct row writes ] in _table.py),
so a batch is never assembled twice.

What travels to main is a *spec*: the batch tree with every array leaf
replaced by an ArrayLeaf (where in the slab, which dtype and shape) and
every other leaf by a Value.  Main turns it into views (materialize).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import sys
from typing import NamedTuple

import numpy as np

from loader._slabs import align

ARRAY, NUMBER, OTHER = 0, 1, 2


class ArrayLeaf(NamedTuple):
    offset: int
    dtype: str
    shape: tuple


class Value(NamedTuple):
    value: object


class CollateError(ValueError):
    """A sample does not fit the layout of the batch it belongs to."""


def flatten(obj, leaves: list):
    """Structure of obj (hashable) and its leaves, depth first."""
    t = type(obj)
    if t is dict:
        return ("dict", tuple((k, flatten(v, leaves)) for k, v in obj.items()))
    if t is list or t is tuple:
        return (t.__name__, tuple(flatten(v, leaves) for v in obj))
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
    kind, items = s
    if kind == "dict":
        return {k: _unflatten(v, it) for k, v in items}
    seq = [_unflatten(v, it) for v in items]
    return seq if kind == "list" else tuple(seq)


def as_array(leaf):
    """The numpy array behind an array-like leaf, or None."""
    if isinstance(leaf, np.ndarray):
        return leaf
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf.detach().cpu().numpy()
    return None


def leaf_kind(leaf) -> int:
    if as_array(leaf) is not None:
        return ARRAY
    if isinstance(leaf, (bool, int, float, complex, np.generic)) and not isinstance(leaf, (np.str_, np.bytes_)):
        return NUMBER
    return OTHER


def signature(sample):
    """What fixes a sample's place in a batch: its structure and, per leaf,
    (kind, dtype, shape); None for dtype and shape of a non-numeric leaf.
    Samples with equal signatures share a batch layout (hashable, exact)."""
    return signature_and_leaves(sample)[0]


def signature_and_leaves(sample):
    leaves: list = []
    structure = flatten(sample, leaves)
    meta = []
    for leaf in leaves:
        kind = leaf_kind(leaf)
        if kind == ARRAY:
            arr = as_array(leaf)
            if arr.dtype.hasobject:
                raise CollateError(f"cannot collate arrays of dtype {arr.dtype} into shared memory")
            meta.append((kind, arr.dtype.str, arr.shape))
        elif kind == NUMBER:
            meta.append((kind, np.asarray(leaf).dtype.str, ()))
        else:
            meta.append((kind, None, None))
    return (structure, tuple(meta)), leaves


class Layout:
    """Where each leaf of a batch of `rows` samples with a given signature
    lives in its slab: leaf i is a (rows,) + shape block at offsets[i]."""

    def __init__(self, sig, rows: int):
        self.signature, self.rows = sig, rows
        self.structure, meta = sig
        self.kinds = [kind for kind, _, _ in meta]
        self.dtypes = [None if d is None else np.dtype(d) for _, d, _ in meta]
        self.shapes = [shape for _, _, shape in meta]
        self.offsets = []
        self.row_nbytes = []
        offset = 0
        for dtype, shape in zip(self.dtypes, self.shapes):
            self.offsets.append(offset)
            row = 0 if dtype is None else dtype.itemsize * math.prod(shape)
            self.row_nbytes.append(row)
            offset = align(offset + rows * row)
        self.nbytes = offset
        # leaves that are Python objects (strings...): kept in lists, not in the slab
        self.value_leaves = [i for i, kind in enumerate(self.kinds) if kind == OTHER]
        # 128 bits that name (signature, rows) in every process: pickling is
        # exact where hash() is not (hash(-1) == hash(-2))
        d = hashlib.blake2b(pickle.dumps((sig, rows)), digest_size=16).digest()
        self.digest = tuple(int(w) for w in np.frombuffer(d, np.int64))

    def write_row(self, slab: np.ndarray, row: int, leaves: list) -> list:
        """Write the leaves of a sample whose signature is this layout's
        into its row of slab; returns its non-numeric leaves (not written)."""
        values = []
        for leaf, kind, dtype, shape, off, n in zip(leaves, self.kinds, self.dtypes, self.shapes,
                                                     self.offsets, self.row_nbytes):
            if kind == OTHER:
                values.append(leaf)
                continue
            start = off + row * n
            dst = slab[start:start + n].view(dtype)
            if kind == ARRAY:
                dst.reshape(shape)[...] = as_array(leaf)
            else:
                dst[0] = leaf
        return values

    def views(self, slab: np.ndarray) -> list:
        """Per leaf: an array of (rows,) + shape over the slab, or a list."""
        out = []
        for kind, dtype, shape, off, row in zip(self.kinds, self.dtypes, self.shapes, self.offsets,
                                                self.row_nbytes):
            if kind == OTHER:
                out.append([None] * self.rows)
            else:
                out.append(slab[off:off + self.rows * row].view(dtype).reshape((self.rows,) + shape))
        return out

    def write(self, views: list, row: int, sample, where: str) -> None:
        leaves: list = []
        if flatten(sample, leaves) != self.structure:
            raise CollateError(f"{where} has a different structure (keys, nesting or length) "
                               f"than the first sample of its batch; pass collate_fn to batch "
                               f"samples of varying structure")
        for i, (leaf, kind, view) in enumerate(zip(leaves, self.kinds, views)):
            if kind == OTHER:
                view[row] = leaf
                continue
            arr = as_array(leaf) if kind == ARRAY else leaf
            if kind == ARRAY and (arr is None or arr.shape != self.shapes[i]):
                got = "a non-array" if arr is None else f"shape {arr.shape}"
                raise CollateError(f"{where}: leaf {i} has {got} but the first sample of its batch "
                                   f"has shape {self.shapes[i]}; default collate stacks equal "
                                   f"shapes only: pad, or pass collate_fn")
            view[row] = arr

    def spec(self, views: list, rows: int):
        """The batch tree for main, trimmed to `rows` (a short last batch)."""
        leaves = []
        for kind, dtype, shape, off, view in zip(self.kinds, self.dtypes, self.shapes, self.offsets, views):
            if kind == OTHER:
                leaves.append(Value(view[:rows]))
            else:
                leaves.append(ArrayLeaf(off, dtype.str, (rows,) + shape))
        return unflatten(self.structure, leaves)


class LayoutCache:
    """(signature, rows) -> Layout for the most recent layouts: building one
    pickles and hashes its signature, so it is built once."""

    SIZE = 64

    def __init__(self):
        self._found: dict = {}

    def get(self, sig, rows: int) -> Layout:
        layout = self._found.get((sig, rows))
        if layout is None:
            layout = self._found[sig, rows] = Layout(sig, rows)
            if len(self._found) > self.SIZE:  # varying layouts: forget the oldest
                del self._found[next(iter(self._found))]
        return layout


class OutputPlan:
    """Where the arrays of a collate_fn's output go in a slab: first its
    size (nbytes), then write(slab) copies them in and returns the spec."""

    def __init__(self, output):
        self.leaves: list = []
        self.structure = flatten(output, self.leaves)
        self.arrays = [as_array(leaf) for leaf in self.leaves]
        self.offsets, offset = [], 0
        for arr in self.arrays:
            self.offsets.append(offset)
            if arr is not None:
                if arr.dtype.hasobject:
                    raise CollateError(f"collate_fn returned an array of dtype {arr.dtype}; only "
                                       f"numeric, bool and fixed-width string arrays go to shared "
                                       f"memory")
                offset = align(offset + arr.nbytes)
        self.nbytes = offset

    def write(self, slab: np.ndarray):
        spec_leaves = []
        for leaf, arr, off in zip(self.leaves, self.arrays, self.offsets):
            if arr is None:
                spec_leaves.append(Value(leaf))
            else:
                slab[off:off + arr.nbytes].view(arr.dtype).reshape(arr.shape)[...] = arr
                spec_leaves.append(ArrayLeaf(off, arr.dtype.str, arr.shape))
        return unflatten(self.structure, spec_leaves)


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
    if t is list or t is tuple:
        return t(materialize(v, slab, as_torch) for v in spec)
    return spec
