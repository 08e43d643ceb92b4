"""A batch that is None is a batch: a sample of None with batch_size=None,
a collate_fn that returns None, an iterable dataset that yields None.
With workers the epoch took None for "the next batch is not here yet"
and dropped it (batch_size=None over [0, 1, None, 3] gave [0, 1, 3]);
inline it was delivered, so the count depended on num_workers."""

from __future__ import annotations

import pytest

from loader import ShmLoader

pytestmark = pytest.mark.timeout(180)

N = 5_000
MODES = {"inline": dict(num_workers=0), "processes": dict(num_workers=2),
         "threads": dict(num_workers=2, worker_mode="thread"),
         "first-ready": dict(num_workers=2, in_order=False),
         "first-ready threads": dict(num_workers=2, worker_mode="thread", in_order=False)}


def value(i: int):
    return None if i % 7 == 3 else i


class Values:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return value(i)


class StreamOfValues:
    """Each worker its own share (i % workers), as a user splits a stream."""

    def __iter__(self):
        from loader import get_worker_info
        info = get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        return (value(i) for i in range(w, N, n))


def expected(order_matters: bool):
    want = [value(i) for i in range(N)]
    return want if order_matters else sorted(want, key=repr)


@pytest.mark.parametrize("mode", list(MODES))
def test_none_samples_with_batch_size_none_are_delivered(mode):
    kw = MODES[mode]
    in_order = kw.get("in_order", True)
    loader = ShmLoader(Values(), batch_size=None, timeout=60, **kw)
    try:
        for _ in range(2):
            got = list(loader)
            assert len(got) == N
            assert (got if in_order else sorted(got, key=repr)) == expected(in_order)
    finally:
        loader.close()


def collate_or_none(samples):
    # a batch whose first sample is odd is None (half of them)
    return None if samples[0] % 2 else list(samples)


@pytest.mark.parametrize("mode", ["inline", "processes", "threads", "first-ready"])
def test_a_collate_fn_that_returns_none_gives_none_batches(mode):
    kw = MODES[mode]

    class Ids:
        def __len__(self):
            return N

        def __getitem__(self, i):
            return i

    want = [collate_or_none(list(range(s, min(s + 5, N)))) for s in range(0, N, 5)]
    loader = ShmLoader(Ids(), batch_size=5, collate_fn=collate_or_none, timeout=60, **kw)
    try:
        got = list(loader)
    finally:
        loader.close()
    assert len(got) == len(want)
    assert sum(b is None for b in got) == sum(b is None for b in want) == N // 10
    if kw.get("in_order", True):
        assert got == want
    else:
        assert sorted(got, key=repr) == sorted(want, key=repr)


@pytest.mark.parametrize("mode", ["inline", "processes", "threads"])
def test_an_iterable_dataset_that_yields_none(mode):
    kw = MODES[mode]
    loader = ShmLoader(StreamOfValues(), batch_size=None, timeout=60, **kw)
    try:
        got = list(loader)
    finally:
        loader.close()
    assert len(got) == N
    assert sorted(got, key=repr) == expected(False)


def test_dataloader_batch_size_none_matches_torch():
    torch = pytest.importorskip("torch")
    from loader import DataLoader

    ours = list(DataLoader(Values(), batch_size=None, num_workers=2, timeout=60))
    theirs = list(torch.utils.data.DataLoader(Values(), batch_size=None, num_workers=2))
    assert len(ours) == len(theirs) == N
    assert [None if b is None else int(b) for b in ours] == \
        [None if b is None else int(b) for b in theirs]
