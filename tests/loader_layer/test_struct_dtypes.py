"""Structured and unusual dtypes (issue 13 item 4, issue 15 item 7).

Structured dtypes keep their fields, names, offsets, itemsize, titles and
alignment through shmq and the loader (NOTE [ Dtype codes ] in
loader/shared/layout.py); two structured dtypes of one itemsize in one batch, or
a structured and a plain one, are a BatchMismatch, never stacked or
promoted; a V0 leaf or .npy file is an UnsupportedLeaf naming the leaf,
the sample index and the file."""

import os
import re

import numpy as np
import pytest

import shmq
from loader import BatchMismatch, FileDataset, ShmLoader, UnsupportedLeaf
from loader.shared import layout as _layout

pytestmark = pytest.mark.timeout(60)

NESTED = np.dtype([("id", "<i8"),
                   ("pos", [("x", "<f4"), ("y", "<f4"), ("flags", [("a", "u1"), ("b", "?")])]),
                   ("tag", "S5")])
ALIGNED = np.dtype([("a", "u1"), ("b", "<f8"), ("c", "<i2"), ("d", [("e", "u1"), ("f", "<i4")])],
                   align=True)
SUBARRAY = np.dtype([("m", "<f4", (2, 3)), ("n", "<i2", (4,)),
                     ("s", [("q", "<u4", (2,)), ("r", "<c8")], (2,))])
TITLED = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "titles": ["alpha", None]})
# explicit offsets out of field order, trailing padding, a big-endian field, a date
SPREAD = np.dtype({"names": ["late", "early", "when"], "formats": [">i4", "<f2", "<M8[s]"],
                   "offsets": [12, 0, 4], "itemsize": 20})
DTYPES = {"nested": NESTED, "aligned": ALIGNED, "subarray": SUBARRAY, "titled": TITLED,
          "spread": SPREAD}

A = np.dtype([("a", "<i4"), ("b", "<f8")])
B = np.dtype([("b", "<f8"), ("a", "<i4")])      # same itemsize (12), other fields


def fill(arr, seed):
    """Every field of arr given values of its own kind, from seed."""
    for name in arr.dtype.names:
        f = arr[name]
        if f.dtype.names is not None:
            fill(f, seed + 1)
            continue
        values = (np.arange(f.size).reshape(f.shape) * 3 + seed) % 97
        if f.dtype.kind == "M":
            values = values.astype("<M8[s]")
        elif f.dtype.kind == "S":
            values = values.astype("S5")
        f[...] = values


def record(dt, i, shape=(3,)):
    arr = np.zeros(shape, dt)
    fill(arr, i)
    return arr


def sample(i):
    s = {name: record(dt, i) for name, dt in DTYPES.items()}
    s["zero_d"] = record(ALIGNED, i, ())
    s["y"] = i
    return s


class Records:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return sample(i)


def assert_same_records(got, want):
    """Values of every field (nested ones too) and the dtype, exactly."""
    assert got.dtype == want.dtype
    assert got.dtype.names == want.dtype.names
    assert got.dtype.itemsize == want.dtype.itemsize
    assert got.dtype.isalignedstruct == want.dtype.isalignedstruct
    assert got.dtype.fields == want.dtype.fields  # offsets and titles
    assert got.shape == want.shape
    for name in want.dtype.names:
        if want.dtype[name].names is not None:
            assert_same_records(got[name], want[name])
        else:
            assert np.array_equal(got[name], want[name]), name


def rows(arrays):
    """np.stack, but exact: numpy's stacking repacks a structured dtype
    (native byte order, no padding, fields in offset order)."""
    out = np.empty((len(arrays),) + arrays[0].shape, arrays[0].dtype)
    for k, a in enumerate(arrays):
        out[k] = a
    return out


def check_batches(batches, n):
    seen = []
    for batch in batches:
        ys = [int(y) for y in batch["y"]]
        seen += ys
        for name, dt in DTYPES.items():
            assert_same_records(batch[name], rows([record(dt, i) for i in ys]))
        assert_same_records(batch["zero_d"], rows([record(ALIGNED, i, ()) for i in ys]))
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("output", ["numpy", "keep"])
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_structured_dtypes_exact_through_the_loader(num_workers, in_order, output):
    with ShmLoader(Records(), batch_size=4, num_workers=num_workers, in_order=in_order,
                   output=output, timeout=30) as loader:
        for _ in range(2):  # the second epoch on layouts made by the first
            batches = list(loader)
            assert [len(b["y"]) for b in batches] == [4, 4, 2] or not in_order
            check_batches(batches, 10)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_structured_bare_and_unbatched(num_workers):
    """A sample that is the structured array itself; batch_size=None."""
    class Bare:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return record(SUBARRAY, i, (2,))

    with ShmLoader(Bare(), batch_size=3, num_workers=num_workers, timeout=30) as loader:
        got = list(loader)
    for k, batch in enumerate(got):
        want = [record(SUBARRAY, i, (2,)) for i in range(3 * k, 3 * k + 3)]
        assert_same_records(batch, rows(want))
    assert len(got) == 2
    with ShmLoader(Bare(), batch_size=None, num_workers=num_workers, timeout=30) as loader:
        for i, got in enumerate(loader):
            assert_same_records(got, record(SUBARRAY, i, (2,)))


def test_dtype_codes_are_exact_and_cached():
    for dt in list(DTYPES.values()) + [A, B]:
        code = _layout.dtype_code(dt)
        back = _layout.storage_dtype(code)
        assert back == dt and back.isalignedstruct == dt.isalignedstruct
        assert _layout.storage_dtype(code) is back
    assert _layout.dtype_code(np.dtype("<f4")) == "<f4"  # plain dtypes: dtype.str, as before
    assert _layout.dtype_code(A) != _layout.dtype_code(B)
    packed = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8],
                       "itemsize": 16})
    aligned = np.dtype([("a", "u1"), ("b", "<f8")], align=True)
    assert packed == aligned  # numpy's equality ignores the aligned flag; the code does not
    assert _layout.storage_dtype(_layout.dtype_code(aligned)).isalignedstruct
    assert not _layout.storage_dtype(_layout.dtype_code(packed)).isalignedstruct


def test_structured_dtypes_are_never_promoted_or_cast():
    X = np.dtype([("x", "<i4"), ("y", "<f8")])
    Y = np.dtype([("p", "<i4"), ("q", "<f8")])
    assert np.can_cast(X, Y, "safe")  # numpy casts structs by position...
    pairs = [(A, B), (X, Y), (A, np.dtype("V12")), (np.dtype([("v", "<f8")]), np.dtype("<f8")),
             (np.dtype("<f8"), np.dtype([("v", "<f8")]))]
    for da, db in pairs:
        sa, sb = _layout.signature(np.zeros(2, da)), _layout.signature(np.zeros(2, db))
        assert _layout.promoted(sa, sb) is None, (da, db)     # ...the loader never does
        assert not _layout.castable(sb, _layout.Layout(sa, 2)), (da, db)
        assert str(da) in _layout.describe_difference(sa, sb) and str(db) in _layout.describe_difference(sa, sb)
    # numbers still promote as before
    assert _layout.promoted(_layout.signature(np.zeros(2, "<i4")), _layout.signature(np.zeros(2, "<f4")))


def test_unusable_leaves_are_named_by_their_place_in_the_sample():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    sample = {"x": [1, (np.zeros(2), Pair(3, np.zeros(2, "V0")))],
              "o": OrderedDict(k=np.zeros(1))}
    with pytest.raises(UnsupportedLeaf, match=r"leaf 3 \(sample\['x'\]\[1\]\[1\]\.b\)"):
        _layout.signature(sample)
    with pytest.raises(UnsupportedLeaf, match=r"leaf 0 \(the sample itself\)"):
        _layout.signature(np.zeros(2, "V0"))


class Mixed:
    """Batch 1 (samples 4..7 with batch_size 4) mixes `other` into `first`."""

    def __init__(self, first, other):
        self.first, self.other = first, other

    def __len__(self):
        return 12

    def __getitem__(self, i):
        dt = self.other if i == 5 else self.first
        return {"y": i, "rec": np.zeros(2, dt)}


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("other", [B, np.dtype("V12"), np.dtype("S12")], ids=str)
def test_mixed_dtypes_of_one_itemsize_are_a_batch_mismatch(num_workers, other):
    with ShmLoader(Mixed(A, other), batch_size=4, num_workers=num_workers, timeout=30) as loader:
        for _ in range(2):  # the loader goes on: the epoch's other batches, the next epoch
            it = iter(loader)
            assert [int(y) for y in next(it)["y"]] == [0, 1, 2, 3]
            with pytest.raises(BatchMismatch) as e:
                next(it)
            msg = str(e.value)
            assert "sample['rec']" in msg and str(A) in msg and str(other) in msg, msg
            # With two workers, sample 5 may be the first of its batch: then
            # the batch has its dtype and another sample is the one refused.
            index = int(re.search(r"sample index (\d+)", msg).group(1))
            assert index == 5 if num_workers < 2 else 4 <= index <= 7, msg
            last = next(it)
            assert [int(y) for y in last["y"]] == [8, 9, 10, 11] and last["rec"].dtype == A
            assert next(it, None) is None


class ZeroItemsize:
    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 6:
            return {"y": i, "e": np.zeros(3, self.bad)}
        return {"y": i, "e": np.zeros(3, "V2")}


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("bad", [np.dtype("V0"), np.dtype([])], ids=str)
def test_zero_itemsize_leaf_is_a_typed_error_naming_leaf_and_index(num_workers, bad):
    with ShmLoader(ZeroItemsize(bad), batch_size=4, num_workers=num_workers,
                   timeout=30) as loader:
        for _ in range(2):
            it = iter(loader)
            assert next(it)["e"].dtype == np.dtype("V2")
            with pytest.raises(UnsupportedLeaf) as e:
                next(it)
            msg = str(e.value)
            assert "leaf 1 (sample['e'])" in msg and "no bytes" in msg, msg
            assert "sample index 6" in msg, msg
            assert next(it, None) is None


def write_npy(dirpath, i, arr):
    path = os.path.join(dirpath, f"s{i:02d}.npy")
    np.save(path, arr)
    return path


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("bad", ["V0", "struct"])
def test_bad_npy_file_names_leaf_index_and_file(tmp_path, num_workers, bad):
    arrays = [np.arange(6, dtype=np.float32) + i for i in range(6)]
    for i, a in enumerate(arrays):
        write_npy(tmp_path, i, a)
    bad_path = write_npy(tmp_path, 4, np.zeros(6, "V0" if bad == "V0" else A))  # in batch 1
    expected = UnsupportedLeaf if bad == "V0" else BatchMismatch
    with ShmLoader(FileDataset(str(tmp_path / "*.npy")), batch_size=3, num_workers=num_workers,
                   timeout=30) as loader:
        for _ in range(2):  # the loader stays usable: the next epoch is the same again
            it = iter(loader)
            np.testing.assert_array_equal(next(it), np.stack(arrays[:3]))
            with pytest.raises(expected) as e:
                next(it)
            msg = str(e.value)
            index = int(re.search(r"sample index (\d+)", msg).group(1))
            path = re.search(r"file '([^']+)'", msg).group(1)
            if bad == "V0" or num_workers < 2:
                assert (index, path) == (4, bad_path), msg
            else:  # the struct file may have been the batch's first: a float file is refused
                assert 3 <= index <= 5 and path == os.path.join(tmp_path, f"s{index:02d}.npy"), msg
            assert ("no bytes" in msg) if bad == "V0" else (str(A) in msg and "float32" in msg), msg
            assert next(it, None) is None


def test_structured_npy_files_come_back_exact(tmp_path):
    # (a .npy header describes a dtype by its descr: no out-of-order fields there)
    for dt in (NESTED, SUBARRAY, ALIGNED):
        folder = tmp_path / dt.names[0]
        folder.mkdir()
        want = [np.load(write_npy(folder, i, record(dt, i, (4,)))) for i in range(6)]
        with ShmLoader(FileDataset(str(folder / "*.npy")), batch_size=3, num_workers=2,
                       timeout=30) as loader:
            got = list(loader)
        assert len(got) == 2
        for k in range(2):
            assert_same_records(got[k], rows(want[3 * k:3 * k + 3]))


# --- shmq -------------------------------------------------------------------------------

def every_record():
    out = {name: record(dt, 7) for name, dt in DTYPES.items()}
    out["zero_d"] = record(ALIGNED, 3, ())
    out["fortran"] = np.asfortranarray(rows([record(SPREAD, 1), record(SPREAD, 2)]).T)
    return out


def test_structured_dtypes_exact_through_shmq_put_get_and_get_view():
    want = every_record()
    with shmq.Queue(1 << 20) as q:
        for name, arr in want.items():
            q.put(arr)  # one array alone
            assert_same_records(q.get(timeout=5), arr)
            q.put({name: arr, "n": 1})  # inside a tree
            with q.get_view(timeout=5) as got:
                assert_same_records(got[name], arr)
        for empty in (np.zeros(4, "V0"), np.zeros(4, [])):  # no bytes, still exact
            q.put(empty)
            got = q.get(timeout=5)
            assert got.dtype == empty.dtype and got.shape == (4,)


def put_records(q):
    for name, arr in every_record().items():
        q.put({"name": name, "arr": arr}, timeout=10)
    q.close()


def test_structured_dtypes_exact_between_processes(procs):
    want = every_record()
    with shmq.Queue(1 << 20) as q:
        procs.fork(put_records, q)
        for name in want:
            got = q.get(timeout=20)
            assert got["name"] == name
            assert_same_records(got["arr"], want[name])
        with pytest.raises(shmq.Closed):
            q.get(timeout=20)
