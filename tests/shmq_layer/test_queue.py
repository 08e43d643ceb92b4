"""Single-process behaviour of shmq.Queue: contents, errors, lifetimes."""

import gc
import queue as stdlib_queue
import threading
import warnings

import numpy as np
import pytest

import shmq
from shmq import _core, sync

DTYPES = ["?", "i1", "u1", "<i2", ">i2", "<u4", "<i8", ">u8", "<f2", "<f4", ">f8", "<c8",
          "<c16", "<M8[ns]", "<m8[s]", "S7", "<U3", "V5"]


@pytest.fixture
def q():
    with shmq.Queue(capacity_bytes=1 << 20) as q:
        yield q


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 0, 2), (4, 7), (2, 3, 4, 5)])
def test_array_roundtrip_every_dtype_and_shape(q, dtype, shape):
    a = sample(dtype, shape)
    q.put(a)
    b = q.get(timeout=0)
    assert_same(a, b)
    assert b.flags.c_contiguous and b.flags.writeable and b.flags.owndata


def test_ndim_limits(q):
    a = np.arange(1, dtype="i4").reshape((1,) * _core.MAX_NDIM)
    q.put(a)
    assert_same(a, q.get(timeout=0))
    deeper = np.zeros((1,) * 40, np.int8)  # beyond the fast path: pickled layout, same bytes
    q.put(deeper)
    assert_same(deeper, q.get(timeout=0))


def test_non_contiguous_and_fortran_arrays_arrive_equal(q):
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    for a in (base[::2, 1::3], base.T, np.asfortranarray(base), base[:, 3]):
        q.put(a)
        b = q.get(timeout=0)
        assert b.shape == a.shape and b.dtype == a.dtype
        np.testing.assert_array_equal(a, b)
    q.put(np.asfortranarray(base))
    assert q.get(timeout=0).flags.f_contiguous  # layout kept, not re-copied


def test_tree_with_extras(q):
    msg = {
        "image": sample("u1", (3, 8, 8)),
        "label": 7,
        "score": 0.25,
        "path": "a/b.png",
        "raw": b"\x00\x01",
        "none": None,
        "nested": [sample("<f4", (2, 2), 1), (sample("<i8", (0,)), "x")],
        "structured": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        "scalar": np.float32(1.5),
    }
    q.put(msg)
    assert_same(msg, q.get(timeout=0))


def round_trips(q, obj):
    """What get() and get_view() give back for obj, at the top level and
    inside a tree."""
    out = []
    for wrap in (lambda x: x, lambda x: {"k": [x, 1]}):
        q.put(wrap(obj))
        got = q.get(timeout=0)
        out.append(got if got is not None and not isinstance(got, dict) else got["k"][0])
        q.put(wrap(obj))
        with q.get_view(timeout=0) as v:
            item = v["k"][0] if isinstance(v, dict) else v
            out.append(item.copy() if isinstance(item, np.ndarray) else item)
    return out


@pytest.mark.parametrize("make", [
    lambda: np.array(3),
    lambda: np.array(2.5, ">f8"),
    lambda: np.array(b"xy"),
    lambda: np.zeros((), dtype=[("a", "<i4"), ("b", "<f8")]),
    lambda: np.array(np.datetime64("2026-01-02", "D")),
], ids=["int", "big-endian", "bytes", "structured", "datetime"])
def test_zero_dim_arrays_stay_zero_dim(q, make):
    a = make()
    for b in round_trips(q, a):
        assert type(b) is np.ndarray and b.shape == () and b.dtype == a.dtype
        assert b.tobytes() == a.tobytes()


@pytest.mark.parametrize("dtype,shape", [
    (np.dtype([]), (3,)),
    (np.dtype([]), (2, 0)),
    (np.dtype([]), ()),
    (np.dtype([("a", "<i4", (0,))]), (4,)),
    (np.dtype("V0"), (5,)),
])
def test_zero_itemsize_dtypes_round_trip(q, dtype, shape):
    """repro_shmq_zero_itemsize.py: put() accepted them and get() failed in
    np.frombuffer; they carry no bytes, so they are rebuilt from dtype and
    shape."""
    a = np.empty(shape, dtype)
    for b in round_trips(q, a):
        assert type(b) is np.ndarray and b.dtype == dtype and b.shape == shape
    q.put(np.asfortranarray(np.empty((2, 3), dtype)))
    assert q.get(timeout=0).flags.f_contiguous


def test_numpy_subclasses_come_back_as_themselves(q):
    matrix = np.arange(1, 5, dtype=np.int16).reshape(2, 2).view(np.matrix)  # np.matrix() warns
    rec = np.rec.array([(1, 2.0), (3, 4.0)], dtype=[("a", "<i4"), ("b", "<f8")])
    with warnings.catch_warnings():  # numpy >= 2.5 deprecates chararray; shmq still carries it
        warnings.simplefilter("ignore", DeprecationWarning)
        chars = np.char.array(["ab", "c"])
    for a in (matrix, rec, chars, matrix.T):
        for b in round_trips(q, a):
            assert type(b) is type(a) and b.dtype == a.dtype and b.shape == a.shape
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    for b in round_trips(q, rec):
        assert b.dtype.type is np.record and b.a.tolist() == [1, 3]  # attribute access works


@pytest.mark.parametrize("make", [
    lambda: np.ma.MaskedArray([1.0, 2.0, 3.0], mask=[0, 1, 0], fill_value=7.5),
    lambda: np.ma.MaskedArray([1, 2], mask=False),                 # an all-False mask array
    lambda: np.ma.MaskedArray(np.arange(6).reshape(2, 3)),         # nomask
    lambda: np.ma.MaskedArray([5, 6, 7], mask=[1, 0, 0], hard_mask=True),
    lambda: np.ma.masked_array(np.zeros(2, [("a", "i4"), ("b", "f4")]), mask=[(0, 1), (1, 0)]),
    lambda: np.ma.MaskedArray(np.arange(12.0).reshape(3, 4)[:, ::2], mask=np.eye(3, 2)),
], ids=["values", "all-false", "nomask", "hard", "structured", "strided"])
def test_masked_arrays_keep_mask_fill_value_and_hardness(q, make):
    a = make()
    for b in round_trips(q, a):
        assert type(b) is np.ma.MaskedArray and b.dtype == a.dtype and b.shape == a.shape
        assert np.ma.getdata(b).tobytes() == np.ma.getdata(a).tobytes()
        if a.mask is np.ma.nomask:
            assert b.mask is np.ma.nomask
        else:
            assert b.mask.dtype == a.mask.dtype and b.mask.tobytes() == a.mask.tobytes()
        assert b.fill_value.tobytes() == a.fill_value.tobytes()
        assert b.hardmask == a.hardmask


def test_masked_constant_stays_the_singleton(q):
    q.put({"m": np.ma.masked})
    assert q.get(timeout=0)["m"] is np.ma.masked


def test_memmap_arrives_as_its_contents(q, tmp_path):
    m = np.memmap(tmp_path / "data", dtype="<i4", mode="w+", shape=(4, 3))
    m[:] = np.arange(12).reshape(4, 3)
    for b in round_trips(q, m[1:3]):
        assert type(b) is np.ndarray and b.tolist() == [[3, 4, 5], [6, 7, 8]]
    del m


class Tagged(np.ndarray):
    """A user subclass with an attribute shmq cannot know about."""

    def __array_finalize__(self, obj):
        self.unit = getattr(obj, "unit", "m")


def test_other_ndarray_subclasses_are_refused_before_claiming(q):
    before = q.stats()
    for bad in (np.arange(3).view(Tagged), {"x": np.zeros(2).view(Tagged)},
                np.ma.MaskedArray([1, 2]).view(type("MyMasked", (np.ma.MaskedArray,), {}))):
        with pytest.raises(TypeError, match=r"ndarray subclass.*np\.asarray\(x\)"):
            q.put(bad)
    assert q.stats() == before
    q.put(np.asarray(np.arange(3).view(Tagged)))  # the remedy works
    assert_same(np.arange(3), q.get(timeout=0))


def test_torch_tensors_keep_their_shape_including_zero_dim(q):
    torch = pytest.importorskip("torch")
    cases = [torch.tensor(3), torch.tensor(2.5, dtype=torch.float32), torch.tensor(True),
             torch.arange(6.0).reshape(2, 3).t(), torch.ones(3, requires_grad=True),
             torch.zeros(0, 4, dtype=torch.int16)]
    for t in cases:
        for b in round_trips(q, t):
            assert isinstance(b, torch.Tensor) and b.shape == t.shape and b.dtype == t.dtype
            assert torch.equal(b, t.detach())


@pytest.mark.parametrize("dtype", ["<M8[ns]", ">m8[s]", [("t", "<M8[s]"), ("v", "<i4")]])
def test_datetime_arrays_inside_trees(q, dtype):
    """numpy exports no buffer for datetime dtypes; they used to fail in
    put() inside a tree (and off the fast path)."""
    a = sample(dtype, (2, 3))
    for b in round_trips(q, a):
        assert_same(a, b)
    q.put(np.asfortranarray(np.zeros((2, 3), dtype)))
    assert q.get(timeout=0).flags.f_contiguous
    q.put(np.zeros((3, 4), dtype)[:, ::2])  # strided: off the fast path
    assert_same(np.zeros((3, 2), dtype), q.get(timeout=0))


def test_tree_arrays_are_out_of_band_and_copied_once(q):
    big = np.arange(100_000, dtype=np.float64)
    pickled, buffers = shmq.codec.encode({"a": big})
    assert len(pickled) < 300, "array bytes must not be in the pickle stream"
    assert len(buffers) == 1 and buffers[0].raw().nbytes == big.nbytes
    assert np.shares_memory(np.asarray(buffers[0]), big)  # no copy before the ring


def test_get_returns_owned_memory(q):
    q.put(np.full(10, 1.0))
    first = q.get(timeout=0)
    for i in range(50):  # rewrite the ring many times over
        q.put(np.full(10_000, float(i)))
        q.get(timeout=0)
    np.testing.assert_array_equal(first, np.full(10, 1.0))


def test_get_view_is_zero_copy_and_releases_on_exit(q):
    q.put(np.arange(1000, dtype=np.int64))
    used = q.stats()["used_bytes"]
    with q.get_view(timeout=0) as v:
        assert isinstance(v.base, _core.Mapping)  # ring memory, not a copy
        np.testing.assert_array_equal(v, np.arange(1000))
        assert q.stats()["used_bytes"] == used  # still held
    assert q.stats()["used_bytes"] == 0
    q.put({"a": np.ones(4), "b": "x"})
    with q.get_view(timeout=0) as tree:
        assert np.shares_memory(tree["a"], np.asarray(tree["a"].base))
        np.testing.assert_array_equal(tree["a"], np.ones(4))
        assert tree["b"] == "x"


def test_view_survives_close_without_crash():
    q = shmq.Queue(1 << 16)
    q.put(np.arange(16, dtype=np.int32))
    with q.get_view(timeout=0) as v:
        pass
    q.close()
    del q
    gc.collect()
    # The mapping is kept alive by the view: reading is safe.
    np.testing.assert_array_equal(v, np.arange(16, dtype=np.int32))


def test_one_view_at_a_time(q):
    q.put(np.ones(3))
    q.put(np.ones(3))
    with q.get_view(timeout=0):
        with pytest.raises(shmq.ShmqError, match="get_view"):
            q.get(timeout=0)
    assert q.get(timeout=0).shape == (3,)


def test_reserve_commit_and_cancel(q):
    with q.reserve((4, 5), np.float32) as arr:
        assert isinstance(arr.base, _core.Mapping)
        arr[...] = np.arange(20, dtype=np.float32).reshape(4, 5)
    with pytest.raises(RuntimeError, match="boom"):
        with q.reserve(7, "i8") as arr:
            arr[:] = 1
            raise RuntimeError("boom")
    with q.reserve(3, "u1") as arr:
        arr[:] = [1, 2, 3]
    np.testing.assert_array_equal(q.get(timeout=0), np.arange(20, dtype=np.float32).reshape(4, 5))
    np.testing.assert_array_equal(q.get(timeout=0), [1, 2, 3])  # the cancelled one is skipped
    with pytest.raises(shmq.Empty):
        q.get_nowait()


def test_reserve_rejects_bad_requests(q):
    with pytest.raises(TypeError, match="dtype"):
        q.reserve(3, object).__enter__()
    with pytest.raises(ValueError, match="negative"):
        q.reserve((2, -1), "f4").__enter__()
    with pytest.raises(shmq.MessageTooLarge):
        q.reserve((1 << 30,), "f8").__enter__()
    q.put(np.ones(2))
    assert_same(np.ones(2), q.get(timeout=0))


@pytest.mark.parametrize("mpsc", [False, True])
def test_reserve_that_numpy_refuses_is_refused_before_claiming(mpsc):
    """repro_shmq_reserve_phantom.py: shape (0, 2**62) of float64 used to be
    claimed and then refused by numpy, leaving a phantom reservation that
    jammed an MPSC queue for good."""
    with shmq.Queue(1 << 16, multi_producer=mpsc) as q:
        p = shmq.Queue.attach(q.name)
        before = q.stats()
        with pytest.raises(ValueError, match=r"numpy cannot make an array of this shape"):
            with p.reserve((0, 2 ** 62), np.float64):
                pass
        assert q.stats() == before  # nothing claimed
        p.put(np.arange(3))
        assert_same(np.arange(3), q.get(timeout=2))
        with p.reserve((3,), np.int64) as arr:
            arr[:] = [7, 8, 9]
        assert_same(np.array([7, 8, 9]), q.get(timeout=2))
        p.close()


@pytest.mark.parametrize("mpsc", [False, True])
def test_put_inside_reserve_on_the_same_handle_is_refused(mpsc):
    """repro_shmq_put_inside_reserve.py: on an SPSC ring the put claimed the
    reservation's own position (tail had not moved) and the two records
    overlapped; on an MPSC ring it replaced the reservation's claim
    announcement.  Refused now, with the remedy."""
    with shmq.Queue(1 << 16, multi_producer=mpsc) as q:
        p = shmq.Queue.attach(q.name)
        with p.reserve((1000,), np.int64) as arr:
            arr[:] = 7
            with pytest.raises(shmq.ShmqError, match=r"open reserve\(\) block .* refused"):
                p.put({"meta": "hello", "n": np.arange(5)})
            with pytest.raises(shmq.ShmqError, match="open reserve"):
                p.put(np.arange(3))
            with pytest.raises(shmq.ShmqError, match="already holds a reservation"):
                p.reserve(3, "i8").__enter__()
        p.put({"meta": "hello"})  # after the block: fine
        assert_same(np.full(1000, 7, np.int64), q.get(timeout=1))
        assert_same({"meta": "hello"}, q.get(timeout=1))
        with pytest.raises(shmq.Empty):
            q.get_nowait()
        p.close()


@pytest.mark.parametrize("mpsc", [False, True])
def test_get_of_the_handles_own_open_reservation_is_refused(mpsc):
    """A handle that is also the consumer would wait for its own reservation
    (no timeout: forever): refused at once instead."""
    with shmq.Queue(1 << 16, multi_producer=mpsc) as q:
        q.put(np.arange(2))
        with q.reserve((4,), np.int16) as arr:
            assert_same(np.arange(2), q.get(timeout=0))  # before the reservation: fine
            with pytest.raises(shmq.ShmqError, match="own open reserve"):
                q.get()  # timeout=None
            with pytest.raises(shmq.ShmqError, match="own open reserve"):
                with q.get_view(timeout=0):
                    pass
            arr[:] = 5
        assert_same(np.full(4, 5, np.int16), q.get(timeout=0))


def test_view_nesting_rules(q):
    """One get_view block at a time per handle, and no get inside it; put
    (and reserve) inside a view block are fine: they do not touch the
    record it holds."""
    q.put(np.ones(3))
    q.put(np.zeros(2))
    with q.get_view(timeout=0) as v:
        with pytest.raises(shmq.ShmqError, match="get_view"):
            with q.get_view(timeout=0):
                pass
        with pytest.raises(shmq.ShmqError, match="get_view"):
            q.get_nowait()
        q.put(np.full(2, 9.0))
        with q.reserve(1, "u1") as r:
            r[0] = 4
        assert_same(np.ones(3), v)
    assert_same(np.zeros(2), q.get(timeout=0))
    assert_same(np.full(2, 9.0), q.get(timeout=0))
    assert_same(np.array([4], np.uint8), q.get(timeout=0))


def test_object_dtype_refused_before_claim_and_queue_usable(q):
    before = q.stats()
    for bad in (np.array([1, "a"], dtype=object), {"ok": np.ones(2), "bad": np.empty(2, object)}):
        with pytest.raises(TypeError, match="dtype object"):
            q.put(bad)
    assert q.stats() == before  # nothing claimed
    q.put(np.ones(3))
    assert_same(np.ones(3), q.get(timeout=0))


def test_message_too_large_names_both_sizes_and_queue_usable(q):
    with pytest.raises(shmq.MessageTooLarge) as info:
        q.put(np.zeros(200_000))
    text = str(info.value)
    assert "1600" in text and str(q.capacity_bytes) in text and "capacity_bytes" in text
    assert isinstance(info.value, ValueError)
    q.put(np.zeros(10))
    assert_same(np.zeros(10), q.get(timeout=0))


def test_largest_message_fits_whole_capacity():
    with shmq.Queue(1 << 16) as q:
        a = np.arange((q.capacity_bytes - 128) // 8, dtype=np.int64)
        for _ in range(3):  # every start offset after a wrap too
            q.put(a)
            assert_same(a, q.get(timeout=0))
            q.put(np.ones(3))
            q.get(timeout=0)


def test_full_and_empty_are_typed_and_stdlib_compatible(q):
    with pytest.raises(shmq.Empty) as e:
        q.get_nowait()
    assert isinstance(e.value, stdlib_queue.Empty)
    chunk = np.zeros(100_000, np.uint8)
    n = 0
    with pytest.raises(shmq.Full) as f:
        while True:
            q.put_nowait(chunk)
            n += 1
    assert isinstance(f.value, stdlib_queue.Full)
    assert n == q.capacity_bytes // 100_096
    with pytest.raises(shmq.Full):
        q.put(chunk, timeout=0.05)
    for _ in range(n):
        assert q.get(timeout=0).nbytes == 100_000
    with pytest.raises(shmq.Empty):
        q.get(timeout=0.05)


@pytest.mark.parametrize("capacity", [4096, 1 << 16])
def test_wraparound_at_every_boundary(capacity):
    """Start records at every 64-byte offset near the end of the ring and at
    every size class around the end, so each record straddles the mirror
    boundary at a different point."""
    with shmq.Queue(capacity) as q:
        seq = 0
        for pad in range(0, capacity, 64):
            for size in (0, 1, 63, 64, 65, capacity // 3):
                if pad:
                    q.put(np.zeros(max(0, pad - 128), np.uint8))
                    q.get(timeout=0)
                a = (np.arange(size, dtype=np.uint32) * 2654435761 + seq).astype(np.uint8)
                q.put(a)
                assert_same(a, q.get(timeout=0))
                seq += 1


def test_capacity_rounding_and_validation():
    with shmq.Queue(5000) as q:
        assert q.capacity_bytes == 8192
    with shmq.Queue(1) as q:
        assert q.capacity_bytes == 4096
    for bad, exc in ((0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="capacity_bytes"):
            shmq.Queue(bad)


def test_timeout_validation(q):
    for bad, exc in ((-1, ValueError), ("1", TypeError), (float("nan"), ValueError)):
        with pytest.raises(exc, match="timeout"):
            q.get(timeout=bad)
        with pytest.raises(exc, match="timeout"):
            q.put(np.ones(1), timeout=bad)


def test_closed_handle_raises_and_close_is_idempotent():
    q = shmq.Queue(1 << 16)
    q.close()
    q.close()
    with pytest.raises(ValueError, match="closed"):
        q.put(np.ones(1))
    with pytest.raises(ValueError, match="closed"):
        q.get(timeout=0)
    assert q.closed


def test_attach_missing_name():
    with pytest.raises(FileNotFoundError, match="no shmq queue named"):
        shmq.Queue.attach("/shmq-0-doesnotexist")


def test_attach_in_same_process_and_unlink():
    q = shmq.Queue(1 << 16)
    p = shmq.Queue.attach(q.name)
    p.put(np.arange(3))
    assert_same(np.arange(3), q.get(timeout=0))
    with pytest.raises(PermissionError):
        p.unlink()
    q.unlink()
    with pytest.raises(FileNotFoundError):
        shmq.Queue.attach(q.name)
    p.put(np.arange(4))  # existing handles keep working
    assert_same(np.arange(4), q.get(timeout=0))
    p.close()
    q.close()


def test_single_producer_ring_refuses_a_second_producer():
    q = shmq.Queue(1 << 16)
    p = shmq.Queue.attach(q.name)
    q.put(np.ones(1))
    with pytest.raises(shmq.ShmqError, match="multi_producer=True"):
        p.put(np.ones(1))
    q.close()  # the producer role is handed over once its holder closes
    p.put(np.ones(2))
    assert p.get(timeout=0).shape == (1,)
    p.close()


def test_only_one_consumer():
    q = shmq.Queue(1 << 16, multi_producer=True)
    p = shmq.Queue.attach(q.name)
    q.put(np.ones(1))
    q.get(timeout=0)
    with pytest.raises(shmq.ShmqError, match="already has a consumer"):
        p.get(timeout=0)
    p.close()
    q.close()


def test_unclosed_queue_warns_with_creation_site():
    q = shmq.Queue(1 << 16)
    name = q.name
    with pytest.warns(ResourceWarning, match=r"unclosed shmq.Queue .*test_queue.py"):
        del q
        gc.collect()
    with pytest.raises(FileNotFoundError):  # and the creator's GC unlinked it
        shmq.Queue.attach(name)


def test_pickling_a_queue_attaches_by_name():
    import pickle

    with shmq.Queue(1 << 16) as q:
        with warnings.catch_warnings():
            p = pickle.loads(pickle.dumps(q))
        assert p.name == q.name
        p.put(np.arange(2))
        assert_same(np.arange(2), q.get(timeout=0))
        p.close()


def test_repr_and_properties(q):
    assert q.name.startswith("/shmq-")
    assert not q.multi_producer
    assert repr(q).startswith(f"<shmq.Queue {q.name!r} single-producer {q.capacity_bytes}")


SYNC_NAMES = ["shared_array", "atomic_add", "atomic_cas", "atomic_load", "atomic_store", "wait",
              "wake", "prefault", "discard_pages"]


def test_public_surface():
    """The top level is the queue and its errors; the primitives under it
    are shmq.sync's, and only there."""
    errors = ["ShmqError", "Full", "Empty", "Closed", "PeerLost", "IncompatibleRing",
              "MessageTooLarge", "ShmFull", "UntrustedSegment"]
    assert sorted(shmq.__all__) == sorted(["Queue"] + errors)
    for name in errors:
        assert issubclass(getattr(shmq, name), shmq.ShmqError)
    assert sorted(sync.__all__) == sorted(SYNC_NAMES)
    for name in SYNC_NAMES:
        assert not hasattr(shmq, name), name
        assert getattr(sync, name) is getattr(_core, name), name
    assert shmq.sync is sync  # import shmq is enough to reach it


def test_sync_py_beside_sync_pxd_keeps_the_cimport_working():
    """shmq/sync.py (the Python face) sits beside shmq/sync.pxd (the C
    declarations other Cython modules cimport): the loader's compiled
    module, built with `from shmq.sync cimport ...`, still waits and
    wakes through it, and the cimport imports nothing at run time."""
    import pathlib

    from loader import _native

    here = pathlib.Path(shmq.__file__).parent
    assert (here / "sync.pxd").is_file() and (here / "sync.py").is_file()
    assert "from shmq.sync cimport" in (here.parent / "loader" / "_native.pyx").read_text()
    words = sync.shared_array(4, "i4")
    bell = _native.Bell(words, 0)
    assert bell.wait(lambda: False, 0.01) is False  # a futex wait of 10 ms, bounded
    woke = []
    sleeper = threading.Thread(
        target=lambda: woke.append(bell.wait(lambda: sync.atomic_load(words, 2) == 1, 60)))
    sleeper.start()
    sync.atomic_store(words, 2, 1)
    bell.ring()
    sleeper.join(30)
    assert not sleeper.is_alive() and woke == [True]


def test_dropped_ring_handle_closes_its_slot():
    """A handle garbage-collected without close() stops counting as a
    producer; otherwise the consumer would wait for it until this process
    exits."""
    import os

    from shmq import segment

    with shmq.Queue(1 << 16) as q:
        fd, size, head = segment.open_existing(q.name)
        ring = _core.Ring.attach(fd, size, head, q.name)
        os.close(fd)
        ring.put(np.ones(1), None)
        del ring
        gc.collect()
        assert q.get(timeout=0).tolist() == [1.0]
        with pytest.raises(shmq.Closed):
            q.get(timeout=1)


def test_closed_consumer_slot_is_not_reused_by_a_later_attach():
    """The consumer's slot is its tombstone: a handle attached after the
    consumer closed must not take it over and hide that close from
    producers."""
    with shmq.Queue(4096) as q:
        consumer = shmq.Queue.attach(q.name)
        q.put(np.zeros(10, np.uint8))
        consumer.get(timeout=0)
        consumer.close()
        late = shmq.Queue.attach(q.name)
        q.put(np.zeros(3000, np.uint8))
        with pytest.raises(shmq.Closed, match="consumer .* closed"):
            q.put(np.zeros(3000, np.uint8), timeout=5)
        late.close()


def test_prefault_keeps_contents_and_checks_its_argument():
    a = sync.shared_array(3 * 4096 + 5, np.uint8)
    a[::7] = 9
    before = a.copy()
    sync.prefault(a[1:])
    np.testing.assert_array_equal(a, before)
    with pytest.raises(ValueError, match="writable C-contiguous"):
        sync.prefault(a[::2])
