"""`from loader import DataLoader` against torch.utils.data.DataLoader: the
same arguments and seeds give the same batches, value for value, dtype for
dtype, container type for container type, over several epochs (issue 8:
a PyTorch user who switches must not get different batches).  Random
augmentation inside dataset[i] is part of what must match: workers are
seeded by torch's rules.  The ported upstream conformance suite is
test_torch_conformance.py."""

import collections
import errno
import gc
import os
import random
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.utils.data as tud  # noqa: E402
from torch.utils.data import IterableDataset, TensorDataset, get_worker_info  # noqa: E402

from loader import DataLoader, ShmLoader  # noqa: E402

pytestmark = [pytest.mark.timeout(120),
              # torch warns when workers outnumber this machine's 2 cores: both loaders do
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]


@pytest.fixture(autouse=True)
def torch_feeder_threads_may_lose_their_pipes():
    """Torch's own DataLoader, its iterator abandoned by an exception, can
    leave multiprocessing.Queue feeder threads that write to, or close, a
    pipe end that the queue's garbage collection closed already: OSError
    EBADF in a thread named QueueFeederThread (or, from its error path, a
    ValueError raised while handling that EBADF).  It happens with torch's
    DataLoader alone (no ShmLoader in the process), on Python 3.10 and
    3.11 alike.  Exactly that is let through; any other exception in a
    thread still fails the test.  The feeder threads are joined before the
    filter goes, so none fails after it."""
    previous = threading.excepthook

    def lost_pipe(exc):  # EBADF, or what the feeder's error path raised while handling it
        while exc is not None:
            if isinstance(exc, OSError) and exc.errno == errno.EBADF:
                return True
            exc = exc.__context__
        return False

    def hook(args):
        if not (args.thread is not None and args.thread.name == "QueueFeederThread"
                and lost_pipe(args.exc_value)):
            previous(args)

    threading.excepthook = hook
    try:
        yield
        # The abandoned iterators (kept alive by the tracebacks pytest.raises
        # held) shut their queues down when collected: do it now, under the
        # filter, and let their feeder threads finish.
        gc.collect()
        for t in threading.enumerate():
            if t.name == "QueueFeederThread":
                t.join(10)
    finally:
        threading.excepthook = previous


def assert_same(a, b, path="batch"):
    """Exactly equal, including types: tensors (dtype, shape, values),
    arrays, containers (their exact type) and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), (path, type(b))
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (path, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (path, a, b)
    elif isinstance(a, np.ndarray):
        assert type(b) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), (path, type(a), type(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (path, type(a), type(b))
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def run_both(make_dataset, epochs=3, generator_seed=None, global_seed=5, **kwargs):
    """Each loader's epochs, from the same global seed and generator seed.
    A kwargs value that is a function is called for each loader (a sampler
    with a generator of its own must start from the same state for both)."""
    results = {}
    # ours first: torch's workers leave queue feeder threads behind for a while,
    # and forking beside a thread makes ShmLoader warn (R16)
    for cls in (DataLoader, tud.DataLoader):
        kw = {k: v() if callable(v) and k in ("sampler", "batch_sampler") else v
              for k, v in kwargs.items()}
        if generator_seed is not None:
            kw["generator"] = torch.Generator().manual_seed(generator_seed)
        torch.manual_seed(global_seed)
        np.random.seed(global_seed)   # num_workers=0: the dataset draws from main's generators
        random.seed(global_seed)
        loader = cls(make_dataset(), **kw)
        results[cls] = ([list(loader) for _ in range(epochs)], len(loader)
                        if not isinstance(loader.dataset, IterableDataset) else None)
        if cls is DataLoader:
            loader.close()
    (theirs, their_len), (ours, our_len) = results[tud.DataLoader], results[DataLoader]
    assert our_len == their_len
    assert [len(e) for e in ours] == [len(e) for e in theirs]
    for e, (t, o) in enumerate(zip(theirs, ours)):
        for i, (a, b) in enumerate(zip(t, o)):
            assert_same(a, b, f"epoch {e} batch {i}")
    return ours


class Augmented(tud.Dataset):
    """Random augmentation in dataset[i], from torch, numpy and random."""

    def __init__(self, n=45):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import random
        return (torch.full((3,), float(i)) + torch.rand(3),
                np.float64(np.random.rand()) + i,
                random.random() + i,
                i)


Point = collections.namedtuple("Point", "x y")


class Mixed(tud.Dataset):
    def __len__(self):
        return 22

    def __getitem__(self, i):
        return {"arr": np.full((2, 2), i, np.float32), "int": i, "float": i / 4, "bool": i % 2 == 0,
                "str": f"s{i}", "bytes": b"b", "tuple": (i, np.int16(i)), "list": [i, i + 1],
                "nt": Point(torch.tensor(i), np.uint8(i)), "od": collections.OrderedDict(z=i),
                "scalar": np.float32(i), "zero_d": np.array(i), "bf16": torch.tensor([i], dtype=torch.bfloat16)}


CASES = {
    "sequential": dict(batch_size=8),
    "drop_last": dict(batch_size=8, drop_last=True),
    "shuffle, generator": dict(batch_size=8, shuffle=True, generator_seed=3),
    "shuffle, global seed": dict(batch_size=8, shuffle=True),
    "unbatched": dict(batch_size=None),
    "unbatched, shuffled": dict(batch_size=None, shuffle=True, generator_seed=1),
    "sampler": dict(batch_size=4, sampler=[5, 3, 3, 44, 0, 9, 12]),
    "batch sampler": dict(batch_sampler=[[1, 2], [0], [7, 8, 9, 40]]),
    "random sampler with replacement": dict(
        batch_size=5, sampler=lambda: tud.RandomSampler(
            range(45), replacement=True, num_samples=17, generator=torch.Generator().manual_seed(8))),
    "weighted sampler": dict(
        batch_size=3, sampler=lambda: tud.WeightedRandomSampler(
            [0.1] * 40 + [5.0] * 5, 20, generator=torch.Generator().manual_seed(2))),
    "user batch sampler": dict(
        batch_sampler=lambda: tud.BatchSampler(tud.RandomSampler(range(45)), 7, False)),
}


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_random_augmentation_gives_torchs_batches(case, num_workers):
    ours = run_both(Augmented, num_workers=num_workers, **CASES[case])
    assert len(ours[0]) > 0


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_workers_and_prefetch_factor_give_torchs_batches(persistent):
    run_both(Augmented, num_workers=2, persistent_workers=persistent, prefetch_factor=3,
             batch_size=6, shuffle=True, generator_seed=11, epochs=4)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_collate_structure_dtypes_and_container_types(num_workers):
    ours = run_both(Mixed, num_workers=num_workers, batch_size=5, epochs=1)
    b = ours[0][0]
    assert type(b["tuple"]) is list and type(b["nt"]) is Point and type(b["od"]) is \
        collections.OrderedDict
    assert b["bf16"].dtype == torch.bfloat16 and b["zero_d"].shape == (5,)


def test_tensor_dataset_labels_are_zero_d_per_sample():
    """repro_torch_0d.py: TensorDataset(x, y) gives labels of shape (B,)."""
    x, y = torch.randn(40, 3), torch.arange(40) % 4
    ours = run_both(lambda: TensorDataset(x, y), num_workers=2, batch_size=8, epochs=1)
    assert ours[0][0][1].shape == (8,)
    assert torch.nn.functional.cross_entropy(torch.randn(8, 4), ours[0][0][1]).ndim == 0


def numpy_collate(samples):
    return {"x": np.stack([s[0].numpy() for s in samples]), "i": [s[3] for s in samples],
            "t": torch.stack([s[0] for s in samples])}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_fn_output_comes_back_as_it_returned_it(num_workers):
    ours = run_both(Augmented, num_workers=num_workers, batch_size=4, collate_fn=numpy_collate,
                    epochs=1)
    assert type(ours[0][0]["x"]) is np.ndarray and isinstance(ours[0][0]["t"], torch.Tensor)


class Shards(IterableDataset):
    def __init__(self, n=29):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(w, self.n, k):
            yield {"i": i, "noise": torch.rand(2), "w": w}


class ShardsWithLen(Shards):
    def __len__(self):
        return self.n


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_datasets_give_torchs_batches(num_workers, drop_last, in_order):
    if in_order:
        run_both(Shards, num_workers=num_workers, batch_size=4, drop_last=drop_last)
        return
    # first-ready: the order depends on timing, in torch too; the batches do not
    for cls in (tud.DataLoader, DataLoader):
        torch.manual_seed(5)
        got = [sorted((b["i"].tolist() for b in cls(Shards(), num_workers=num_workers,
                                                     batch_size=4, drop_last=drop_last,
                                                     in_order=False)))]
        if cls is tud.DataLoader:
            theirs = got
    assert got == theirs


class Unsharded(IterableDataset):
    """Every worker yields every sample (the mistake torch warns about)."""

    def __len__(self):
        return 10

    def __iter__(self):
        return iter(range(10))


def test_an_iterable_dataset_with_len_is_iterable_and_warns_when_it_yields_more():
    loader = DataLoader(Unsharded(), batch_size=None, num_workers=2)
    assert len(loader) == 10
    with pytest.warns(UserWarning, match="was reported to be 10"):
        got = [int(x) for x in loader]
    assert sorted(got) == sorted(list(range(10)) * 2)
    loader.close()


def test_is_a_torch_dataloader_and_keeps_torchs_checks():
    ds = TensorDataset(torch.arange(10))
    loader = DataLoader(ds, batch_size=3)
    assert isinstance(loader, tud.DataLoader)
    assert isinstance(loader.sampler, tud.SequentialSampler)
    assert isinstance(loader.batch_sampler, tud.BatchSampler) and len(loader) == 4
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        DataLoader(ds, sampler=[0], shuffle=True)
    with pytest.raises(ValueError, match="prefetch_factor option could only be specified"):
        DataLoader(ds, prefetch_factor=2)
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 4


class Failing(tud.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"no sample {i}")
        if i == 17:
            raise ValueError("bad value")
        return i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_errors_keep_their_type_as_in_torch(num_workers):
    for cls in (DataLoader, tud.DataLoader):
        for kwargs, error, match in (({}, KeyError, "no sample 13"),
                                     ({"sampler": [17, 1]}, ValueError, "bad value")):
            it = iter(cls(Failing(), batch_size=2, num_workers=num_workers, **kwargs))
            with pytest.raises(error, match=match):
                list(it)
            # an iterator abandoned after an error keeps its workers until
            # torch's watchdog notices (seconds): stop them, as a loop's end would
            getattr(it, "_shutdown_workers", lambda: None)()


def test_worker_info_and_seeds_match_torchs_rules():
    class Info(tud.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            info = get_worker_info()
            return torch.tensor([info.id, info.num_workers, info.seed % (1 << 40),
                                 torch.initial_seed() % (1 << 40)])

    # the same seeds in each worker as torch's: base_seed + worker id
    for persistent in (False, True):
        run_both(Info, num_workers=2, batch_size=2, persistent_workers=persistent,
                 generator_seed=4, epochs=2)


def test_workers_run_torch_with_one_thread():
    """repro_loader_conv_after_fork.py: a conv in dataset[i] after the parent
    used torch's thread pool; workers must have 1 intra-op thread."""
    class Conv(tud.Dataset):
        def __init__(self):
            self.x = torch.ones(1, 1, 24000)
            self[0]  # the parent runs a conv before the fork

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.nn.functional.conv1d(self.x, torch.ones(1, 1, 2)).sum() + \
                torch.get_num_threads() * 1000

    batches = list(DataLoader(Conv(), batch_size=2, num_workers=2, timeout=60))
    assert [b.tolist() for b in batches] == [[2.0 * 23999 + 1000] * 2] * 2  # 1 thread each


def test_shmloader_generator_gives_torchs_shuffle():
    n = 37
    for seed in (0, 1):
        theirs = list(tud.DataLoader(range(n), batch_size=None, shuffle=True,
                                     generator=torch.Generator().manual_seed(seed)))
        with ShmLoader(np.arange(n), batch_size=None, shuffle=True, num_workers=2,
                       generator=torch.Generator().manual_seed(seed)) as loader:
            ours = [int(x) for x in loader]
        assert ours == [int(x) for x in theirs]


def test_pin_memory_without_an_accelerator_warns_like_torch():
    ds = TensorDataset(torch.arange(4.0))
    with pytest.warns(UserWarning, match="no accelerator is found"):
        assert [b[0].tolist() for b in DataLoader(ds, batch_size=2, pin_memory=True)] == \
            [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pin_memory_with_cuda_gives_pinned_batches_without_a_copy():
    ds = TensorDataset(torch.arange(64.0).reshape(16, 4))
    loader = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
    batches = [b[0] for b in loader]
    assert all(b.is_pinned() for b in batches)
    assert torch.equal(torch.cat(batches), torch.arange(64.0).reshape(16, 4))
    arena = loader._shm._session.shared.arena
    assert arena.ctypes.data <= batches[0].data_ptr() < arena.ctypes.data + arena.nbytes
    loader.close()


def test_dataloader_workers_leave_with_the_loader():
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=2,
                        persistent_workers=True)
    assert len(list(loader)) == 4
    pids = [c.pid for c in loader._shm._session.procs]
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    loader.close()
    assert loader._shm._session is None
