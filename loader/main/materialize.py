"""Main's side of a batch: the user's arrays (numpy or torch) viewing a
slab, in the structure of the samples, from the batch's Spec (shared/layout.py).
Materializer compiles a leaf plan once per distinct spec and builds every
array of a batch in one SlabLease.arrays() call (native/leases.pxi);
materialize() is the plain path (num_workers=0, one-off batches)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from loader.shared.layout import (BFLOAT16, DICT, LIST, TUPLE, ArrayLeaf, Spec, Value, storage_dtype,
                            unflatten)


def materialize(spec: Spec, slab: np.ndarray, output: str = "numpy", torch_rules: bool = False):
    """Main side: the batch, with every array a view of the slab.  No
    reference cycle may hold the slab (see _unflatten): the slab is freed,
    and its lease released, the moment the user drops the batch.

    output: "numpy" (arrays), "torch" (tensors sharing the slab; arrays of
    dtypes torch has no tensor for, strings or dates, stay arrays) or
    "keep" (what each leaf was in the sample: a collate_fn's output comes
    back as it returned it).  torch_rules (DataLoader): what torch's
    default_collate gives (tuples become lists; a numpy scalar given
    unbatched becomes a 0-d tensor; arrays of strings or objects are a
    TypeError)."""
    leaves = [_leaf(leaf, slab, output, torch_rules) for leaf in spec.leaves]
    return unflatten(spec.structure, leaves, torch_rules and output == "torch")


class Materializer:
    """materialize() for one loader's batches, on the per-batch path of
    main: the array leaves of each distinct spec are compiled once into
    (start, nbytes, dtype, shape) and a conversion each (LeafPlan), so a
    batch's arrays come from one SlabLease.arrays() call instead of a
    slice, a view and a reshape per leaf.  Each array still has its own
    leaf lease (NOTE [ Kept batch memory ]), exactly as materialize() gives.

    Keyed by the spec's leaves, which equal for batches of one layout and
    row count; the structure is rebuilt from each batch's own spec (a
    structure's dict keys 1 and True would compare equal).  Specs with
    values (Value leaves) change every batch: they take materialize()."""

    SIZE = 64  # distinct leaf sets remembered; more (varying shapes): start over

    def __init__(self, output: str, torch_rules: bool):
        self.output, self.torch_rules = output, torch_rules
        self.lists = torch_rules and output == "torch"
        self.plans: dict = {}

    def __call__(self, spec: Spec, slab):
        try:
            plan = self.plans.get(spec.leaves)
        except TypeError:  # unhashable values in a Value leaf
            plan = None
        if plan is None:
            plan = self._compile(spec)
            if plan is None:
                return materialize(spec, slab, self.output, self.torch_rules)
        arrays = slab.arrays(plan.leaves)
        if plan.convert is not None:
            arrays = [a if c is None else c(a) for a, c in zip(arrays, plan.convert)]
        elif plan.from_numpy is not None:
            arrays = list(map(plan.from_numpy, arrays))
        return _assemble(spec.structure, arrays, self.lists)

    def from_array(self, spec: Spec, data: np.ndarray):
        """The batch of spec over a plain array (a slab main copied out of
        the pool): views of it, no lease."""
        return materialize(spec, data, self.output, self.torch_rules)

    def _compile(self, spec: Spec):
        """The LeafPlan of spec (remembered), or None: a Value leaf, or a
        leaf materialize() refuses (it raises there, with its words)."""
        if type(spec.leaves) is not tuple or not all(type(x) is ArrayLeaf for x in spec.leaves):
            return None
        torch_out = self.output == "torch"
        leaves, convert = [], []
        for leaf in spec.leaves:
            dtype = storage_dtype(leaf.dtype)
            leaves.append((leaf.offset, dtype.itemsize * math.prod(leaf.shape), dtype,
                           tuple(leaf.shape)))
            as_torch = torch_out or (self.output == "keep" and leaf.tensor)
            if leaf.dtype == BFLOAT16:
                convert.append(_Bfloat16(as_torch))
            elif as_torch and dtype.kind in "biufc":
                import torch

                convert.append(torch.from_numpy)
            elif self.torch_rules and torch_out:
                return None
            else:
                convert.append(None)
        plan = LeafPlan.of(tuple(leaves), convert)
        if len(self.plans) >= self.SIZE:
            self.plans.clear()
        self.plans[spec.leaves] = plan
        return plan


class LeafPlan(NamedTuple):
    """A spec's array leaves, compiled (Materializer)."""
    leaves: tuple          # (start, nbytes, dtype, shape) per leaf, for SlabLease.arrays
    from_numpy: object     # every leaf becomes a tensor: torch.from_numpy
    convert: list | None   # else per leaf: None (the array) or a function of it

    @classmethod
    def of(cls, leaves: tuple, convert: list):
        first = convert[0] if convert else None
        if all(c is first for c in convert):  # one conversion for all: map it
            return cls(leaves, first, None)
        return cls(leaves, None, convert)


class _Bfloat16(NamedTuple):
    as_torch: bool

    def __call__(self, words):
        return _bfloat16(words, self.as_torch)


def _assemble(structure, arrays: list, lists: bool):
    """unflatten(structure, arrays, lists), with the shapes of most batches
    (one leaf, or a flat tuple, list or dict of leaves) built directly."""
    if structure is None:
        return arrays[0]
    kind, children = structure[0], structure[-1]
    if type(children) is tuple and children.count(None) == len(arrays):  # leaves only
        if kind == TUPLE:
            return arrays if lists else tuple(arrays)
        if kind == LIST:
            return arrays
        if kind == DICT:
            return dict(zip(structure[1], arrays))
    return unflatten(structure, arrays, lists)


def _leaf(leaf, slab: np.ndarray, output: str, torch_rules: bool):
    if isinstance(leaf, Value):
        if torch_rules and output == "torch":
            if not leaf.batched and isinstance(leaf.value, (np.generic, np.ndarray)):
                import torch

                return torch.as_tensor(leaf.value)  # default_convert
            if leaf.batched:
                odd = next((v for v in leaf.value if not isinstance(v, (str, bytes))), _NONE)
                if odd is not _NONE:  # torch's default_collate refuses the rest, so do we
                    raise TypeError(f"default_collate: batch must contain tensors, numpy "
                                    f"arrays, numbers, dicts or lists; found {type(odd)}")
        return leaf.value
    dtype = storage_dtype(leaf.dtype)
    n = dtype.itemsize * math.prod(leaf.shape)
    arr = slab[leaf.offset:leaf.offset + n].view(dtype=dtype, type=np.ndarray).reshape(leaf.shape)
    as_torch = output == "torch" or (output == "keep" and leaf.tensor)
    if leaf.dtype == BFLOAT16:
        return _bfloat16(arr, as_torch)
    if as_torch and dtype.kind in "biufc":
        import torch

        return torch.from_numpy(arr)
    if torch_rules and output == "torch":
        raise TypeError(f"default_collate: batch must contain tensors, numpy arrays, numbers, "
                        f"dicts or lists; found {dtype}")  # torch's words (arrays of strings)
    return arr


_NONE = object()


def _bfloat16(words: np.ndarray, as_torch: bool):
    """A bfloat16 leaf, stored as uint16 words."""
    if as_torch:
        import torch

        return torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("a batch leaf is a bfloat16 tensor, which numpy cannot represent: pass "
                        "output='torch' (or install ml_dtypes for numpy bfloat16 arrays)") from None
    return words.view(ml_dtypes.bfloat16)
