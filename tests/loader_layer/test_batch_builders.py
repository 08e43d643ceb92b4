"""Main's per-batch path (issue 16, W12 main-thread CPU): a batch's arrays
are built from a leaf plan compiled once per distinct spec (Materializer in
main/materialize.py, SlabLease.arrays in native/leases.pxi), and a BatchReady crosses the
to_main ring in a wire form of plain tuples (batch_ready_wire in
shared/memory.py).  These tests check exact contents, never speed: batches held
across layout changes, a second iterator, kept batches moved out of the
pool, every container shape and output the plans take.  Every loader test
is time-limited; the autouse guards (conftest.py) check that nothing is
left in /dev/shm and that no process outlives its test."""

import gc
import pickle
from collections import namedtuple

import numpy as np
import pytest

from loader import ShmLoader
from loader.shared import messages as _protocol
from loader.shared.layout import ArrayLeaf, Spec, Value
from loader.main.materialize import Materializer
from loader.shared.memory import batch_ready_from_wire, batch_ready_wire
from loader.batcher.slabs import Slab

torch = pytest.importorskip("torch")
from loader import DataLoader  # noqa: E402  (needs torch)

pytestmark = pytest.mark.timeout(180)

Pair = namedtuple("Pair", "a b")


class Shifting:
    """Sample i's structure, dtype and shape change every `every` samples
    (a new layout, so a new leaf plan, each time), and every value says i."""

    def __init__(self, n, every=64):
        self.n, self.every = n, every

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        phase = (i // self.every) % 3
        if phase == 0:
            return np.full(5, i, np.int64), np.full((2, 3), i, np.float32)
        if phase == 1:
            return {"x": np.full(7, i, np.int32), "y": np.int64(i)}
        return np.full((4, 2), i, np.float64)


def expected(i):
    return Shifting(i + 1)[i]


def check_batch(batch, first, rows, as_torch):
    """batch holds samples first .. first + rows - 1 of Shifting, exactly."""
    def arr(x):
        assert isinstance(x, torch.Tensor if as_torch else np.ndarray), type(x)
        return x.numpy() if as_torch else x
    idx = np.arange(first, first + rows)
    sample = expected(first)
    if isinstance(sample, tuple):
        assert type(batch) is tuple and len(batch) == 2
        a, b = arr(batch[0]), arr(batch[1])
        assert a.dtype == np.int64 and a.shape == (rows, 5)
        assert b.dtype == np.float32 and b.shape == (rows, 2, 3)
        assert np.array_equal(a, np.repeat(idx[:, None], 5, 1))
        assert np.array_equal(b, np.broadcast_to(idx[:, None, None], (rows, 2, 3)))
    elif isinstance(sample, dict):
        assert type(batch) is dict and list(batch) == ["x", "y"]
        x, y = arr(batch["x"]), arr(batch["y"])
        assert x.dtype == np.int32 and x.shape == (rows, 7)
        assert np.array_equal(x, np.repeat(idx[:, None], 7, 1))
        assert y.dtype == np.int64 and np.array_equal(y, idx)
    else:
        a = arr(batch)
        assert a.dtype == np.float64 and a.shape == (rows, 4, 2)
        assert np.array_equal(a, np.broadcast_to(idx[:, None, None], (rows, 4, 2)))


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_batches_held_across_layout_changes_read_right(output):
    n, rows = 64 * 7 + 16, 16  # layouts change every 4 batches; a short last phase
    with ShmLoader(Shifting(n), batch_size=rows, num_workers=2, output=output, seed=0) as ld:
        for _ in range(2):  # the second epoch reuses the plans of the first
            held = list(ld)  # every batch of the epoch alive at once
            assert len(held) == n // rows
            for k, batch in enumerate(held):
                check_batch(batch, k * rows, rows, output == "torch")
            del held, batch
            gc.collect()
        # a second iterator, and one superseded mid-way: what was taken stays right
        first = iter(ld)
        kept = [next(first) for _ in range(5)]
        second = list(iter(ld))
        for k, batch in enumerate(kept):
            check_batch(batch, k * rows, rows, output == "torch")
        for k, batch in enumerate(second):
            check_batch(batch, k * rows, rows, output == "torch")


class Shapes:
    """Containers a leaf plan builds directly, and those it leaves to
    unflatten (nested, named tuples); a bfloat16 tensor (a conversion of
    its own) when `bf`."""

    def __init__(self, bf):
        self.bf = bf

    def __len__(self):
        return 24

    def __getitem__(self, i):
        sample = {"list": [np.full(2, i, np.int16), np.full(3, i, np.uint8)],
                  "pair": Pair(np.float32(i), np.full((2, 2), i, np.int64)),
                  "nested": {"one": np.full(1, i, np.float64)}}
        if self.bf:
            sample["bf"] = torch.full((3,), float(i), dtype=torch.bfloat16)
        return sample


@pytest.mark.parametrize("output", ["numpy", "torch", "keep"])
def test_every_container_and_output_matches_the_general_path(output):
    rows, bf = 8, output != "numpy"  # (numpy has no bfloat16 without ml_dtypes)
    with ShmLoader(Shapes(bf), batch_size=rows, num_workers=1, output=output, seed=0) as ld:
        for _ in range(2):
            for k, b in enumerate(ld):
                idx = np.arange(k * rows, (k + 1) * rows)
                tensors = output == "torch"
                assert set(b) == {"list", "pair", "nested"} | ({"bf"} if bf else set())
                assert type(b["list"]) is list and type(b["pair"]) is Pair
                for leaf, width in zip(b["list"], (2, 3)):
                    assert isinstance(leaf, torch.Tensor if tensors else np.ndarray)
                    got = leaf.numpy() if tensors else leaf
                    assert np.array_equal(got, np.repeat(idx[:, None], width, 1))
                a = b["pair"].a.numpy() if tensors else b["pair"].a
                assert np.array_equal(a, idx.astype(np.float32))
                one = b["nested"]["one"]
                one = one.numpy() if tensors else one
                assert one.dtype == np.float64 and np.array_equal(one, idx[:, None])
                if bf:  # torch, and keep: it was a tensor in the sample
                    assert isinstance(b["bf"], torch.Tensor) and b["bf"].dtype == torch.bfloat16
                    assert torch.equal(b["bf"].float(), torch.from_numpy(
                        np.repeat(idx[:, None], 3, 1).astype(np.float32)))
            assert k == 2


class Tuples:
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.full(4, i, np.int64), np.full(2, -i, np.int64)


def test_dataloader_gets_torch_lists_from_the_plans():
    """loader.DataLoader: torch's default_collate makes a list of a batch of
    tuples; the plan's flat-tuple shortcut keeps that rule."""
    dl = DataLoader(Tuples(), batch_size=8, num_workers=2, persistent_workers=True)
    try:
        for _ in range(2):
            for k, b in enumerate(dl):
                assert type(b) is list and len(b) == 2
                idx = torch.arange(k * 8, (k + 1) * 8)
                assert torch.equal(b[0], idx[:, None].repeat(1, 4))
                assert torch.equal(b[1], -idx[:, None].repeat(1, 2))
    finally:
        dl.close()


def test_materializer_rebuilds_each_batch_structure_of_one_leaf_plan():
    """Two specs with equal leaves but dict keys 1 and True (equal in
    Python): one leaf plan, and each batch keeps its own keys."""
    arena = np.zeros(64, np.uint8)

    class Slab:  # SlabLease.arrays, over a plain array
        def arrays(self, leaves):
            return [arena[a:a + n].view(dt).reshape(shape) for a, n, dt, shape in leaves]

    m = Materializer("numpy", False)
    leaves = (ArrayLeaf(0, "<i8", (2,), False),)
    one = m(Spec(("dict", (1,), (None,)), leaves), Slab())
    true = m(Spec(("dict", (True,), (None,)), leaves), Slab())
    assert len(m.plans) == 1
    assert type(next(iter(one))) is int and type(next(iter(true))) is bool
    # a spec with values is never compiled (its values change every batch)
    with_values = Spec(("tuple", (None, None)), leaves + (Value(["a", "b"]),))
    assert m(with_values, arena)[1] == ["a", "b"]
    assert len(m.plans) == 1


def test_batch_ready_wire_round_trip():
    msg = _protocol.BatchReady(3, 7, Slab(5, 2, 4096, 8192),
                               Spec(("tuple", (None, None, ("list", (None,)))),
                                    (ArrayLeaf(0, "<i8", (4, 2), False), Value(["a", "b", "c", "d"], True),
                                     ArrayLeaf(128, "|b1", (4,), True)), None), 1024, 4, 99)
    wire = batch_ready_wire(msg)
    assert type(wire) is tuple and all(type(x) in (int, str, tuple, type(None))
                                       for x in wire)
    back = batch_ready_from_wire(pickle.loads(pickle.dumps(wire, protocol=5)))
    assert back == msg and type(back) is _protocol.BatchReady and type(back.slab) is Slab
    assert [type(x) for x in back.spec.leaves] == [ArrayLeaf, Value, ArrayLeaf]
    assert type(back.spec) is Spec and back.spec.leaves[2].tensor is True
