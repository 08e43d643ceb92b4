"""First-ready epochs (in_order=False) whose samples fail: every good
sample still arrives exactly once, each failure is raised once, and the
epoch ends.  A failed sample takes no row (rows fill in arrival order), so
the positions the workers may load reach one further for each failure
(Runs.limit()); before, once as many samples had failed as the next
`prefetch` batches have rows, no batch could fill and the epoch waited
for its timeout (a LoaderTimeout naming workers asleep in _wait_to_load)."""

from __future__ import annotations

import numpy as np
import pytest

from loader import ShmLoader

pytestmark = pytest.mark.timeout(240)

N = 60_000


class SampleFailed(ValueError):
    pass


class Failing:
    """Sample i is [i, i]; dataset[i] raises SampleFailed where bad(i)."""

    def __init__(self, n: int, bad):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.bad(i):
            raise SampleFailed(f"sample {i} is bad")
        return np.array([i, i], np.int64)


def every_third(i: int) -> bool:
    return i % 3 == 0


def a_long_stretch(i: int) -> bool:
    # 2,000 in a row: far more than prefetch x batch_size positions
    return 10_000 <= i < 12_000


def all_but_a_few(i: int) -> bool:
    return i % 1000 != 7


def epoch(loader, batch_type=None) -> tuple[list[int], int, int]:
    """(every sample id delivered, the batches, the failures raised);
    batch_type: the class every batch must be."""
    got, batches, failures = [], 0, 0
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return got, batches, failures
        except SampleFailed:
            failures += 1
            continue
        assert batch_type is None or isinstance(batch, batch_type)
        batch = np.asarray(batch)
        assert (batch[:, 0] == batch[:, 1]).all()
        got.extend(batch[:, 0].tolist())
        batches += 1


# (a failure costs main a raised exception, ~1 ms: the sizes keep each case's failures
# in the thousands, far over the prefetch x batch_size = 128 positions that hung)
@pytest.mark.parametrize("bad, n", [(every_third, 12_000), (a_long_stretch, N),
                                    (all_but_a_few, 6_000)], ids=["third", "stretch", "most"])
@pytest.mark.parametrize("mode", ["processes", "threads"])
def test_every_good_sample_once_and_every_failure_raised_once(mode, bad, n):
    good = [i for i in range(n) if not bad(i)]
    workers = dict(num_workers=2) if mode == "processes" else \
        dict(num_workers=2, worker_mode="thread")
    loader = ShmLoader(Failing(n, bad), batch_size=64, in_order=False, shuffle=True, seed=3,
                       prefetch=2, timeout=60, **workers)
    try:
        # the second epoch's run starts ahead, in the first: it must get its
        # full prefetch when the first ends with fewer batches than planned
        for _ in range(2):
            got, batches, failures = epoch(loader)
            assert sorted(got) == good
            assert failures == n - len(good)
            # rows fill in arrival order: full batches, one short one at most
            assert batches == -(-len(good) // 64)
    finally:
        loader.close()


def test_a_failure_in_every_batch_with_drop_last():
    bad, n = every_third, 12_000
    good = [i for i in range(n) if not bad(i)]
    loader = ShmLoader(Failing(n, bad), batch_size=100, in_order=False, drop_last=True,
                       num_workers=2, prefetch=1, timeout=60)
    try:
        got, batches, failures = epoch(loader)
        # drop_last drops what does not fill a batch: of the good ones, the last few
        assert batches == len(good) // 100 and len(got) == batches * 100
        assert len(set(got)) == len(got) and set(got) <= set(good)
        assert failures == n - len(good)
    finally:
        loader.close()


def test_in_order_failures_still_cost_their_batch():
    """In order a failure spoils its batch (its error is raised in the
    batch's turn), as before: the count differs from first-ready's."""
    bad = a_long_stretch
    loader = ShmLoader(Failing(N, bad), batch_size=64, num_workers=2, prefetch=2, timeout=60)
    try:
        got, batches, failures = epoch(loader)
        spoiled = {i // 64 for i in range(N) if bad(i)}
        assert failures == len(spoiled)
        assert sorted(got) == [i for i in range(N) if i // 64 not in spoiled]
    finally:
        loader.close()


def test_torch_dataloader_first_ready_with_failing_samples():
    torch = pytest.importorskip("torch")
    from loader import DataLoader

    bad = a_long_stretch
    good = [i for i in range(N) if not bad(i)]
    dl = DataLoader(Failing(N, bad), batch_size=64, num_workers=2, in_order=False,
                    prefetch_factor=1, timeout=60)
    got, batches, failures = epoch(dl, torch.Tensor)
    # torch's DataLoader loads a batch at once: a failure spoils its batch
    spoiled = {i // 64 for i in range(N) if bad(i)}
    assert failures == len(spoiled)
    assert sorted(got) == [i for i in good if i // 64 not in spoiled]
