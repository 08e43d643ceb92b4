"""Batch layout: how a sample tree becomes a slab, and a slab a batch.

The default collate (like PyTorch's) stacks each array leaf of the sample
tree along a new first axis, turns numbers into a 1-d array, and gives any
other leaf (str, bytes, None...) as a list.  Here the stacking happens in
place: the collator writes each sample into its row of the slab as it
arrives, so a batch is never assembled twice.

What travels to main is a *spec*: the batch tree with every array leaf
replaced by an ArrayLeaf (where in the slab, which dtype and shape) and
every other leaf by a Value.  Main turns it into views (materialize).
"""

from __future__ import annotations

import math
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


class Layout:
    """Where each leaf of a batch of `rows` samples lives in its slab."""

    def __init__(self, sample, rows: int):
        leaves: list = []
        self.structure = flatten(sample, leaves)
        self.rows = rows
        self.kinds, self.dtypes, self.shapes, self.offsets = [], [], [], []
        offset = 0
        for leaf in leaves:
            kind = leaf_kind(leaf)
            if kind == ARRAY:
                arr = as_array(leaf)
                if arr.dtype.hasobject:
                    raise CollateError(f"cannot collate arrays of dtype {arr.dtype} into shared memory")
                dtype, shape = arr.dtype, arr.shape
            elif kind == NUMBER:
                dtype, shape = np.asarray(leaf).dtype, ()
            else:
                dtype, shape = None, None
            self.kinds.append(kind)
            self.dtypes.append(dtype)
            self.shapes.append(shape)
            self.offsets.append(offset)
            if dtype is not None:
                offset = align(offset + rows * dtype.itemsize * math.prod(shape))
        self.nbytes = offset

    def views(self, slab: np.ndarray) -> list:
        """Per leaf: an array of (rows,) + shape over the slab, or a list."""
        out = []
        for kind, dtype, shape, off in zip(self.kinds, self.dtypes, self.shapes, self.offsets):
            if kind == OTHER:
                out.append([None] * self.rows)
            else:
                n = self.rows * dtype.itemsize * math.prod(shape)
                out.append(slab[off:off + n].view(dtype).reshape((self.rows,) + shape))
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
