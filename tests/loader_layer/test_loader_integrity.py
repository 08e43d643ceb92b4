"""Nothing silently wrong (R20) and nothing held longer than needed: every
sample type users return comes back with exact contents and the expected
container types; dtypes that differ within a batch are promoted, never
truncated, or refused with the remedy; a closed loader gives its memory
back, and a loader of tiny batches stays small."""

import collections
import ctypes
import dataclasses
import gc
import mmap
from collections.abc import Mapping

import numpy as np
import pytest

from loader import CollateError, ShmLoader
from shared_datasets import Filled

pytestmark = pytest.mark.timeout(120)

Point = collections.namedtuple("Point", "a b")


@dataclasses.dataclass
class Record:
    name: str
    arr: np.ndarray


class Frozen(Mapping):
    """A read-only mapping type of the user's (rebuilt from a dict)."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, k):
        return self._items[k]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


class Everything:
    """Sample i holds one of every kind of leaf and container, all encoding
    i; with varying=True the shape of "var" changes every 4 samples (in
    order, a relayout every batch)."""

    def __init__(self, varying):
        self.varying = varying

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return {
            "arr": np.full((3, 2), i, np.float32),
            "var": np.full(1 + (i // 4) % 3 if self.varying else 2, i, np.int16),
            "zero_d": np.array(i, np.int64),
            "int": i, "float": i + 0.5, "bool": i % 2 == 0, "complex": complex(i, -i),
            "np_scalar": np.uint8(i % 256),
            "str": f"s{i}", "bytes": bytes([i % 256]) * 3, "none": None,
            "tuple": (np.arange(2) + i, i), "list": [i, np.full(2, i, np.float64)],
            "point": Point(np.full(4, i, np.int32), f"p{i}"),
            "ordered": collections.OrderedDict([("z", i), ("a", np.full(1, i))]),
            "frozen": Frozen({"k": np.full(2, -i)}),
            "record": Record(f"r{i}", np.full(5, i, np.int8)),  # a leaf object: kept whole
        }


def check_everything(b, ids, varying):
    ids = np.asarray(ids)
    n = len(ids)
    np.testing.assert_array_equal(b["arr"], np.broadcast_to(ids[:, None, None], (n, 3, 2)))
    assert b["arr"].dtype == np.float32
    width = 1 + (ids[0] // 4) % 3 if varying else 2
    np.testing.assert_array_equal(b["var"], np.broadcast_to(ids[:, None], (n, width)))
    assert b["var"].dtype == np.int16
    assert b["zero_d"].shape == (n,) and b["zero_d"].tolist() == ids.tolist()
    assert b["int"].dtype == np.int64 and b["int"].tolist() == ids.tolist()
    assert b["float"].dtype == np.float64 and b["float"].tolist() == (ids + 0.5).tolist()
    assert b["bool"].dtype == np.bool_ and b["bool"].tolist() == (ids % 2 == 0).tolist()
    assert b["complex"].tolist() == [complex(k, -k) for k in ids.tolist()]
    assert b["np_scalar"].dtype == np.uint8 and b["np_scalar"].tolist() == (ids % 256).tolist()
    assert b["str"] == [f"s{k}" for k in ids.tolist()]
    assert b["bytes"] == [bytes([k % 256]) * 3 for k in ids.tolist()]
    assert b["none"] == [None] * n
    assert isinstance(b["tuple"], tuple) and isinstance(b["list"], list)
    np.testing.assert_array_equal(b["tuple"][0], np.arange(2)[None, :] + ids[:, None])
    assert b["tuple"][1].tolist() == ids.tolist()
    assert b["list"][0].tolist() == ids.tolist()
    np.testing.assert_array_equal(b["list"][1], np.broadcast_to(ids[:, None], (n, 2)))
    assert type(b["point"]) is Point
    np.testing.assert_array_equal(b["point"].a, np.broadcast_to(ids[:, None], (n, 4)))
    assert b["point"].b == [f"p{k}" for k in ids.tolist()]
    assert type(b["ordered"]) is collections.OrderedDict and list(b["ordered"]) == ["z", "a"]
    assert b["ordered"]["z"].tolist() == ids.tolist()
    assert type(b["frozen"]) is Frozen
    np.testing.assert_array_equal(b["frozen"]["k"], -np.broadcast_to(ids[:, None], (n, 2)))
    assert [r.name for r in b["record"]] == [f"r{k}" for k in ids.tolist()]
    for r, k in zip(b["record"], ids.tolist()):
        np.testing.assert_array_equal(r.arr, np.full(5, k, np.int8))


@pytest.mark.parametrize("in_order", [True, False])
def test_every_leaf_and_container_type_comes_back_exact(in_order):
    # First-ready batches mix samples in arrival order: shapes stay fixed there.
    with ShmLoader(Everything(varying=in_order), batch_size=4, num_workers=3, in_order=in_order,
                   timeout=30) as loader:
        for epoch in range(3):
            seen = []
            kept = []
            for b in loader:
                ids = b["int"].tolist()
                check_everything(b, ids, in_order)
                seen += ids
                kept.append((b, ids))
            assert sorted(seen) == list(range(48))
            if in_order:
                assert seen == list(range(48))
            for b, ids in kept:  # batches kept past later ones are intact too
                check_everything(b, ids, in_order)
            if in_order:
                assert loader.stats()["relayouts"] >= 1


def test_object_leaves_holding_arrays_never_see_another_samples_bytes():
    """The batcher keeps nothing that views ring memory: arrays inside
    leaf objects (here a dataclass) travel with their row's values and stay
    intact however many messages follow (the old loader's corruption)."""
    class Objects:
        def __len__(self):
            return 256

        def __getitem__(self, i):
            return {"big": np.full((1 << 16) + (i // 64) % 2, i, np.float32),
                    "rec": Record(str(i), np.full(1000, i, np.int64))}

    with ShmLoader(Objects(), batch_size=64, num_workers=2, timeout=30) as loader:
        for epoch in range(2):
            batches = list(loader)
            for k, b in enumerate(batches):
                ids = np.arange(64 * k, 64 * k + 64)
                np.testing.assert_array_equal(b["big"][:, 0], ids)
                for rec, i in zip(b["rec"], ids.tolist()):
                    assert rec.name == str(i)
                    np.testing.assert_array_equal(rec.arr, np.full(1000, i, np.int64))


class Mixed:
    """Leaf "y" is int in even samples and float in odd ones (the report);
    "w" mixes bool and int; "a" mixes float32 and float64 arrays; "u" mixes
    uint8 and int8."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {"y": 1 if i % 2 == 0 else 1.5,
                "w": True if i % 3 == 0 else i,
                "a": np.full(3, i + 0.25, np.float32 if i % 4 else np.float64),
                "u": np.uint8(200) if i % 2 else np.int8(-3)}


@pytest.mark.parametrize("in_order", [True, False])
def test_numbers_whose_type_differs_within_a_batch_are_promoted_never_truncated(in_order):
    with ShmLoader(Mixed(), batch_size=4, num_workers=2, in_order=in_order, timeout=30) as loader:
        for epoch in range(2):
            rows = 0
            for b in loader:
                ids = (b["a"][:, 0] - 0.25).astype(int).tolist()
                # np.result_type over the batch's own samples (in first-ready
                # mode a batch may hold samples of one type only)
                samples = [Mixed()[k] for k in ids]
                for leaf in "ywau":
                    expected = np.result_type(*[np.asarray(s[leaf]).dtype if leaf in "au"
                                                else type(s[leaf]) for s in samples])
                    assert b[leaf].dtype == expected, (leaf, ids)
                assert b["y"].tolist() == [1.0 if k % 2 == 0 else 1.5 for k in ids]
                assert b["w"].tolist() == [1 if k % 3 == 0 else k for k in ids]
                np.testing.assert_array_equal(b["a"], np.broadcast_to((np.array(ids) + 0.25)[:, None],
                                                                      (4, 3)))
                assert b["u"].tolist() == [200 if k % 2 else -3 for k in ids]
                if in_order:  # every batch mixes the types
                    assert [b[leaf].dtype for leaf in "ywau"] == [np.float64, np.int64, np.float64,
                                                                  np.int16]
                rows += 4
            assert rows == 32


def test_a_batch_of_one_type_keeps_that_type():
    """Promotion is per batch, over the batch's own samples: an all-int
    batch stays int64 whatever the batches before it were."""
    class Blocks:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return i if (i // 4) % 2 == 0 else i + 0.5

    with ShmLoader(Blocks(), batch_size=4, num_workers=2, timeout=30) as loader:
        for _ in range(2):
            for k, b in enumerate(loader):
                if k % 2 == 0:
                    assert b.dtype == np.int64 and b.tolist() == list(range(4 * k, 4 * k + 4))
                else:
                    assert b.dtype == np.float64
                    assert b.tolist() == [x + 0.5 for x in range(4 * k, 4 * k + 4)]


@pytest.mark.parametrize("sample, message", [
    (lambda i: np.zeros(i % 2 + 1), r"leaf 0 has shape \(\d,\) where the batch has shape"),
    (lambda i: "text" if i % 2 else 3, r"leaf 0 is a (number|non-numeric value) where the batch has"),
    (lambda i: {"a": 1} if i % 2 else {"b": 1}, "a different structure"),
    (lambda i: np.array(["x"] if i % 2 else [1.0]), "leaf 0 has dtype"),
])
def test_samples_that_cannot_share_a_batch_are_refused_with_the_remedy(sample, message):
    class Bad:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return sample(i)

    with ShmLoader(Bad(), batch_size=4, num_workers=2, timeout=30) as loader:
        for _ in range(2):  # the same answer every time: the loader stays usable
            with pytest.raises(CollateError, match=message) as info:
                list(loader)
            assert "pass collate_fn" in str(info.value)


def test_an_integer_too_large_for_int64_is_refused_not_wrapped():
    class Huge:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return 2 ** 70 if i == 2 else i

    with ShmLoader(Huge(), batch_size=4, num_workers=2, timeout=30) as loader:
        with pytest.raises(CollateError, match="(?s)sample 2 in its batch.*CollateError"):
            list(loader)


# --- memory ------------------------------------------------------------------------

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(arr: np.ndarray) -> int:
    """Bytes of the shared memory under arr that are resident (mincore:
    for shared memory this is the object's pages, whatever process touched
    them)."""
    start = arr.ctypes.data
    assert start % PAGE == 0
    pages = -(-arr.nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int((np.frombuffer(vec, np.uint8) & 1).sum()) * PAGE


# 64 samples of 4 MiB (float32 holding i): 16 MiB per batch of 4
BLOCKS16 = dict(n=64, shape=1 << 20, dtype=np.float32)


def test_close_gives_the_memory_back_except_what_you_hold():
    loader = ShmLoader(Filled(**BLOCKS16), batch_size=4, num_workers=2, timeout=30)
    for _ in range(2):
        for b in loader:
            pass
    kept = b
    arena = loader._session.shared.arena
    assert resident_bytes(arena) >= 4 * (16 << 20)  # the batches in flight were faulted in
    # its children map the arena too
    later = ShmLoader(Filled(**BLOCKS16), batch_size=1, num_workers=2)
    next(iter(later))
    loader.close()
    assert resident_bytes(arena) <= (16 << 20) + 2 * PAGE  # only the batch held here
    np.testing.assert_array_equal(kept[:, 0], np.arange(60, 64))
    del kept, b
    gc.collect()
    assert resident_bytes(arena) <= 2 * PAGE  # its pages went back when it was dropped
    later.close()


def test_a_loader_of_tiny_batches_stays_small():
    class Tiny:
        def __len__(self):
            return 1000

        def __getitem__(self, i):
            return np.full(16, i, np.float32)  # 64 bytes

    with ShmLoader(Tiny(), batch_size=4, num_workers=2, timeout=30) as loader:
        for _ in range(3):
            assert sum(len(b) for b in loader) == 1000
        # the old loader faulted in 256 MiB; writers populate the pages of the
        # 2 MiB chunk a slab lies in (NOTE [ Warming the arena ])
        assert resident_bytes(loader._session.shared.arena) <= 2 << 20
