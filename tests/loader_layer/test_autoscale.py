"""num_workers="auto" (issue 9): the pool grows while the training loop
waits and workers wait on IO, stays at the CPU count for compute, shrinks
when the loop is the slower side; every sample exactly once whatever the
pool does mid-epoch."""

import time

import numpy as np
import pytest

from loader import ShmLoader
from loader._autoscale import cpu_count, default_max_workers

pytestmark = pytest.mark.timeout(120)


class Sleepy:
    """IO-bound: each sample waits 4 ms (a disk, a network)."""

    def __init__(self, n, delay=0.004):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return np.full(8, i, np.int64)


class Busy(Sleepy):
    """Compute-bound: each sample keeps a CPU busy for ~1 ms."""

    def __getitem__(self, i):
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        return np.full(8, i, np.int64)


def epoch(loader, step=0.0):
    ids = []
    for b in loader:
        ids += b[:, 0].tolist()
        if step:
            time.sleep(step)
    return ids


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_io_bound_grows_past_the_cpu_count_with_every_sample_once(mode):
    with ShmLoader(Sleepy(3000), batch_size=16, num_workers="auto", prefetch=8,
                   worker_mode=mode) as loader:
        for _ in range(2):
            assert epoch(loader) == list(range(3000))  # workers join mid-epoch
        stats = loader.stats()
    assert stats["workers"] > cpu_count(), stats
    assert stats["worker_counts"][0] == cpu_count()
    assert stats["workers"] <= default_max_workers()


def test_compute_bound_stays_near_the_cpu_count():
    with ShmLoader(Busy(2000), batch_size=16, num_workers="auto", prefetch=8) as loader:
        for _ in range(2):
            assert sorted(epoch(loader)) == list(range(2000))
        # more workers than CPUs only share them: a grow beyond does not pay
        assert loader.stats()["workers"] <= cpu_count() + 1, loader.stats()


def test_a_slow_training_step_shrinks_the_pool():
    with ShmLoader(Sleepy(600, delay=0.0005), batch_size=8, num_workers="auto", prefetch=4,
                   max_workers=4) as loader:
        assert epoch(loader, step=0.02) == list(range(600))  # the loop is the slower side
        assert loader.stats()["workers"] < cpu_count() or cpu_count() == 1, loader.stats()


def test_auto_needs_a_map_style_dataset_and_a_sane_cap():
    class Stream:
        def __iter__(self):
            yield np.zeros(1)

    with pytest.raises(ValueError, match="map-style"):
        ShmLoader(Stream(), num_workers="auto")
    with pytest.raises(ValueError, match="max_workers"):
        ShmLoader(Sleepy(4), num_workers="auto", max_workers=0)
    with pytest.raises(ValueError, match="max_workers caps"):
        ShmLoader(Sleepy(4), num_workers=2, max_workers=4)
