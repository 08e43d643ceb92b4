"""__getitems__ (issue 18): a dataset that defines it gets one call per batch
with the batch's indices, as torch's _MapDatasetFetcher does, in ShmLoader
(in order and first-ready, with and without workers) and loader.DataLoader;
its samples land in their rows.  Errors name the batch's indices and the
epoch goes on; a wrong return is a typed error naming the class;
reproducible=True seeds once per call; state_dict() resumes exactly.  See
NOTE [ Batched fetch ] in loader/worker/fetch.py."""

import pickle
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.data import StackDataset, Subset  # noqa: E402

from loader import DataLoader, ShmLoader  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N = 203


class Batched:
    """Only __getitems__ works: dataset[i] raises, so a per-sample load
    anywhere fails the test.  Each sample says how many indices its call
    had ("rows"); with draws, every sample of a call carries the call's
    draws from numpy, random and torch."""

    def __init__(self, n=N, fail_on=None, draws=False, returns=None):
        self.n, self.fail_on, self.draws, self.returns = n, fail_on, draws, returns

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        raise AssertionError(f"dataset[{i}] called: __getitems__ should have been")

    def __getitems__(self, indices):
        # torch's contract: a list of plain ints (as BatchSampler makes it)
        assert type(indices) is list and all(type(i) is int for i in indices), indices
        if self.fail_on in indices:
            raise KeyError(f"no sample {self.fail_on}")
        d = (np.random.rand(), random.random(), torch.rand(1).item()) if self.draws else (0, 0, 0)
        out = [{"i": i, "x": np.arange(4, dtype=np.int64) + i, "rows": len(indices),
                "d": np.array(d)} for i in indices]
        return self.returns(out) if self.returns else out


class PerSample:
    """The same samples one call each (the reference a batched load must equal)."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i, "x": np.arange(4, dtype=np.int64) + i}


def indices(loader) -> list:
    return [np.asarray(b["i"]).tolist() for b in loader]


def plain(batch) -> list:
    """A batch as plain values, to compare runs exactly."""
    return [(int(batch["i"][k]), np.asarray(batch["x"][k]).tolist(), int(batch["rows"][k]),
             tuple(np.asarray(batch["d"][k]).tolist())) for k in range(len(batch["i"]))]


@pytest.mark.parametrize("workers,in_order", [(0, True), (2, True), (2, False)])
def test_shmloader_fetches_each_batch_with_one_call(workers, in_order):
    kw = dict(batch_size=8, shuffle=True, seed=5, num_workers=workers, in_order=in_order)
    with ShmLoader(PerSample(), **dict(kw, in_order=True)) as ref:  # the sampler's batches
        expected = indices(ref)
    with ShmLoader(Batched(), **kw) as loader:
        for _ in range(2):  # the second epoch too (persistent workers)
            batches = list(loader)
            got = [np.asarray(b["i"]).tolist() for b in batches]
            assert len(got) == 26 and sum(len(b) for b in got) == N
            for b in batches:  # one call per batch, each sample in its row
                rows = len(b["i"])
                assert np.asarray(b["rows"]).tolist() == [rows] * rows
                assert np.asarray(b["x"]).tolist() == [[i + k for k in range(4)]
                                                       for i in np.asarray(b["i"]).tolist()]
    with ShmLoader(Batched(), **kw) as loader:
        first = indices(loader)
    if in_order:
        assert first == expected
    else:  # first-ready: the sampler's batches, in arrival order
        assert sorted(first) == sorted(expected)


@pytest.mark.parametrize("kw", [dict(num_workers="auto"), dict(worker_mode="thread"),
                                dict(num_workers=3, batch_sampler=[[5, 1], [9, 9, 0], [7]])])
def test_auto_workers_threads_and_batch_samplers_fetch_by_batch(kw):
    expected = [[5, 1], [9, 9, 0], [7]] if "batch_sampler" in kw else [
        list(range(s, min(s + 8, N))) for s in range(0, N, 8)]
    with ShmLoader(Batched(), batch_size=1 if "batch_sampler" in kw else 8, **kw) as ld:
        for _ in range(2):
            batches = list(ld)
            assert [np.asarray(b["i"]).tolist() for b in batches] == expected
            assert [np.asarray(b["rows"]).tolist() for b in batches] == [
                [len(e)] * len(e) for e in expected]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_batches_equal_torchs(workers):
    def make(cls, **kw):
        return cls(Batched(), batch_size=7, shuffle=True, num_workers=workers,
                   generator=torch.Generator().manual_seed(3), **kw)

    want = [plain(b) for b in make(TorchDataLoader)]
    got = [plain(b) for b in make(DataLoader)]
    assert len(want) == 29 and got == want
    # a collate_fn gets the list __getitems__ returned
    want = list(make(TorchDataLoader, collate_fn=lambda s: [d["i"] for d in s]))
    got = list(make(DataLoader, collate_fn=lambda s: [d["i"] for d in s]))
    assert got == want and sum(map(len, got)) == N


@pytest.mark.parametrize("workers", [0, 2])
def test_shmloader_collate_fn_gets_the_returned_list(workers):
    with ShmLoader(Batched(n=50), batch_size=8, num_workers=workers,
                   collate_fn=lambda s: np.array([d["i"] * 10 + d["rows"] for d in s])) as ld:
        got = [b.tolist() for b in ld]
    assert got == [[i * 10 + (8 if i < 48 else 2) for i in range(s, min(s + 8, 50))]
                   for s in range(0, 50, 8)]


class Disabled(PerSample):
    __getitems__ = None  # torch's rule: a falsy __getitems__ is not used


@pytest.mark.parametrize("workers", [0, 2])
def test_falsy_getitems_and_unbatched_loads_use_getitem(workers):
    with ShmLoader(Disabled(n=20), batch_size=4, num_workers=workers) as ld:
        assert indices(ld) == [list(range(s, s + 4)) for s in range(0, 20, 4)]

    class Both(PerSample):
        def __getitems__(self, indices):
            raise AssertionError("batch_size=None loads one sample at a time")

    with ShmLoader(Both(n=6), batch_size=None, num_workers=workers) as ld:
        assert [int(b["i"]) for b in ld] == list(range(6))


@pytest.mark.parametrize("workers", [0, 2])
def test_subset_and_stackdataset_match_torch(workers):
    sub = Subset(Batched(), list(range(N - 1, -1, -3)))
    stack = StackDataset(a=Batched(), b=PerSample())
    for ds in (sub, stack):
        want = list(TorchDataLoader(ds, batch_size=6, num_workers=workers))
        got = list(DataLoader(ds, batch_size=6, num_workers=workers))
        assert len(got) == len(want) == -(-len(ds) // 6)
        for g, w in zip(got, want):
            flat_g, flat_w = tree_flatten(g), tree_flatten(w)
            assert flat_g[1] == flat_w[1]
            assert all(torch.equal(a, b) for a, b in zip(flat_g[0], flat_w[0]))
    with ShmLoader(sub, batch_size=6, num_workers=workers) as ld:
        got = indices(ld)
    assert sum(got, []) == list(range(N - 1, -1, -3))
    assert [len(b) for b in got] == [6] * 11 + [2]


def drain(it) -> tuple[list, list]:
    """(batches, errors) of an epoch that goes on after errors."""
    batches, errors = [], []
    while True:
        try:
            batches.append(np.asarray(next(it)["i"]).tolist())
        except StopIteration:
            return batches, errors
        except KeyError as e:  # (num_workers=0: raised as it is, the indices in a note)
            errors.append("\n".join([str(e), *getattr(e, "__notes__", [])]))


@pytest.mark.parametrize("workers,in_order", [(0, True), (2, True), (2, False)])
def test_an_error_in_a_call_names_the_batch_and_the_epoch_goes_on(workers, in_order):
    with ShmLoader(Batched(n=40, fail_on=13), batch_size=8, num_workers=workers,
                   in_order=in_order) as ld:
        batches, errors = drain(iter(ld))
        assert len(errors) == 1
        assert "no sample 13" in errors[0]
        assert "Batched.__getitems__ on indices [8, 9, 10, 11, 12, 13, 14, 15]" in errors[0]
        expected = [list(range(s, s + 8)) for s in (0, 16, 24, 32)]
        assert (batches if in_order else sorted(batches)) == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_error_in_a_call_is_raised_with_its_type(workers):
    it = iter(DataLoader(Batched(n=24, fail_on=20), batch_size=8, num_workers=workers))
    assert np.asarray(next(it)["i"]).tolist() == list(range(8))
    assert np.asarray(next(it)["i"]).tolist() == list(range(8, 16))
    with pytest.raises(KeyError, match=r"indices \[16, 17, 18, 19, 20, 21, 22, 23\]"):
        next(it)
    del it


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("returns,error,text", [
    (tuple, TypeError, r"Batched.__getitems__\(\[0, 1, 2, 3\]\) returned tuple, not a list"),
    (lambda s: s[:3], ValueError,
     r"Batched.__getitems__\(\[0, 1, 2, 3\]\) returned a list of 3 samples for 4 indices"),
    (lambda s: {"i": 1}, TypeError, r"returned dict, not a list"),
])
def test_a_wrong_return_is_a_typed_error_naming_the_class(workers, returns, error, text):
    with ShmLoader(Batched(n=8, returns=returns), batch_size=4, num_workers=workers) as ld:
        it = iter(ld)
        with pytest.raises(error, match=text):
            next(it)
        del it


def by_first_index(loader) -> dict:
    """An epoch as {a batch's first index: its rows}, whatever the arrival order."""
    return {plain(b)[0][0]: plain(b) for b in loader}


def test_reproducible_seeds_once_per_call_whatever_the_workers():
    def run(workers, in_order=True):
        with ShmLoader(Batched(draws=True), batch_size=8, shuffle=True, seed=9,
                       num_workers=workers, in_order=in_order) as ld:
            assert ld.reproducible
            return [by_first_index(ld) for _ in range(2)]

    main_state = np.random.get_state()[1].copy()
    reference = run(0)
    assert (np.random.get_state()[1] == main_state).all()  # main's generators put back
    assert len(reference[0]) == 26 and reference[0] != reference[1]  # epochs differ
    for rows in reference[0].values():  # one draw per call, the same for its rows
        assert len({r[3] for r in rows}) == 1
    assert len({rows[0][3] for rows in reference[0].values()}) == 26  # calls differ
    assert run(1) == reference
    assert run(3) == reference
    assert run(2, in_order=False) == reference


@pytest.mark.parametrize("before,after,in_order", [(2, 2, True), (2, 0, True), (0, 2, True),
                                                  (2, 2, False)])
def test_resume_mid_epoch_is_exact(before, after, in_order):
    def make(workers):
        return ShmLoader(Batched(draws=True), batch_size=8, shuffle=True, seed=7,
                         num_workers=workers, in_order=in_order)

    with make(before) as ld:
        full = [[plain(b) for b in ld] for _ in range(2)]
    with make(before) as ld:
        it = iter(ld)
        head = [plain(next(it)) for _ in range(9)]
        state = pickle.loads(pickle.dumps(ld.state_dict()))
        del it
    with make(after) as ld:
        ld.load_state_dict(state)
        rest = [[plain(b) for b in ld] for _ in range(2)]
    if in_order:
        assert head + rest[0] == full[0]
        assert rest[1] == full[1]
    else:  # first-ready: the remaining batches once each, with the same draws
        def keyed(batches):
            return sorted(batches)
        assert keyed(head + rest[0]) == keyed(full[0])
        assert len(head + rest[0]) == 26
        assert keyed(rest[1]) == keyed(full[1])


def test_dataloader_resume_mid_epoch_is_exact():
    def make():
        return DataLoader(Batched(), batch_size=8, shuffle=True, num_workers=2,
                          generator=torch.Generator().manual_seed(1))

    full = [plain(b) for b in make()]
    ld = make()
    it = iter(ld)
    head = [plain(next(it)) for _ in range(5)]
    state = ld.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [plain(b) for b in resumed] == full
