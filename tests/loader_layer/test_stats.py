"""stats(): where an epoch's time goes, and DataStallWarning (issue 8,
observability).  Counts are asserted exactly; time shares only on the side
of a wide margin that the scenario forces (a dataset that sleeps keeps the
workers busy and the loop waiting; a slow training step the other way)."""

import time
import warnings

import numpy as np
import pytest

import shmq
from loader import DataStallWarning, ShmLoader
from loader import _stats
from loader._slabs import slab_bytes
from shared_datasets import Filled

pytestmark = pytest.mark.timeout(90)


# Samples of 16 float32 holding i (64 bytes); delay=: a sleep per sample
ROW = dict(shape=16, dtype=np.float32)


def epochs(loader, count, step=0.0):
    """Run `count` epochs (checking every sample arrives once), return stats() of each."""
    out = []
    for _ in range(count):
        seen = []
        for batch in loader:
            seen.append(np.asarray(batch)[:, 0].astype(np.int64))
            if step:
                time.sleep(step)
        assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(len(loader.dataset)))
        out.append(loader.stats())
    return out


def test_counts_bytes_and_pool_per_epoch():
    with ShmLoader(Filled(20_000, **ROW), batch_size=100, num_workers=2, shuffle=True) as loader:
        assert loader.stats() is None
        all_stats = epochs(loader, 3)
    with ShmLoader(Filled(20_000, **ROW), batch_size=100, num_workers=0) as inline:
        inline_stats = epochs(inline, 1)[0]
    for epoch, s in enumerate(all_stats, 1):
        assert s["epoch"] == epoch and s["batches"] == 200 and s["samples"] == 20_000, s
        assert s["samples_written_by_workers"] == 20_000 and s["samples_written_by_batcher"] == 0
        # every batch's slab: 100 rows of 64 bytes and 100 int64 tags, aligned
        assert s["bytes"] % 200 == 0 and 7200 <= s["bytes"] // 200 <= 7200 + 128, s
        assert s["bytes"] == inline_stats["bytes"]  # the same batches, without workers
        assert 0 < s["peak_slab_bytes"] <= s["memory_cap_bytes"] == loader.memory_cap_bytes
        assert s["peak_slab_bytes"] % slab_bytes(s["bytes"] // 200) == 0  # whole slabs
        assert 0 < s["loop_wait_seconds"] <= s["seconds"]
        assert s["loop_wait_share"] == pytest.approx(s["loop_wait_seconds"] / s["seconds"])
        assert s["bytes_per_second"] == pytest.approx(s["bytes"] / s["seconds"])
        for share in ("workers_busy_share", "batcher_busy_share"):
            assert 0.0 <= s[share] <= 1.0, s
        # the batcher's figures under the process's former name, for code that reads them
        assert s["collator_busy_share"] == s["batcher_busy_share"]
        assert s["samples_written_by_collator"] == s["samples_written_by_batcher"] == 0
        assert s["workers"] == 2
        assert s["summary"].startswith(f"epoch {epoch}: 200 batches, 20000 samples in ")
        assert "2 workers busy" in s["summary"] and "slab pool peak" in s["summary"]
    assert inline_stats["batches"] == 200 and inline_stats["samples"] == 20_000
    assert inline_stats["workers"] == 0 and inline_stats["workers_busy_share"] is None
    assert inline_stats["summary"].startswith("epoch 1: 200 batches, 20000 samples in ")


@pytest.mark.parametrize("prefetch", [1, 3])
@pytest.mark.parametrize("step", [0.0, 0.005])
@pytest.mark.parametrize("in_order", [True, False])
def test_the_pool_holds_prefetch_batches_and_the_held_one_across_epochs(prefetch, step, in_order):
    """Slabs alive: `prefetch` loading ahead, one laid out ready for when the
    limit rises, and the two the loop holds as next() hands out a batch
    (the previous one is still bound to the loop's variable), also while
    the next epoch's run starts ahead (it shares `prefetch` with the
    epoch ending).  It was 2 x prefetch + 2 plus the next epoch's."""
    with ShmLoader(Filled(12_800, **ROW), batch_size=128, num_workers=2, prefetch=prefetch,
                   in_order=in_order, timeout=60) as loader:
        for s in epochs(loader, 4, step):
            slab = slab_bytes(s["bytes"] // s["batches"])
            assert s["peak_slab_bytes"] <= (prefetch + 3) * slab, (s["peak_slab_bytes"] / slab, s)


def test_slow_dataset_shows_busy_workers_and_a_waiting_loop():
    # 2 workers sleeping 5 ms per sample: ~0.5 s an epoch, all of it loading
    with ShmLoader(Filled(200, **ROW, delay=0.005), batch_size=10, num_workers=2) as loader:
        s = epochs(loader, 2)[1]
    assert s["loop_wait_share"] > 0.6, s["summary"]
    assert s["workers_busy_share"] > 0.6, s["summary"]


def test_slow_step_shows_idle_workers_and_a_loop_that_never_waits():
    # loading is ~1000x faster than the 20 ms step; epoch 2 has no start-up in it
    with ShmLoader(Filled(2_000, **ROW), batch_size=50, num_workers=2) as loader:
        s = epochs(loader, 2, step=0.02)[1]
    assert s["seconds"] >= 40 * 0.02
    assert s["loop_wait_share"] < 0.3, s["summary"]
    assert s["workers_busy_share"] < 0.3, s["summary"]
    assert s["batcher_busy_share"] < 0.3, s["summary"]


def test_stall_warning_once_with_the_bottleneck(monkeypatch):
    monkeypatch.setattr(_stats, "STALL_MIN_SECONDS", 0.1)
    with ShmLoader(Filled(100, **ROW, delay=0.01), batch_size=10, num_workers=2) as loader:
        with pytest.warns(DataStallWarning) as caught:
            epochs(loader, 3)
    assert len(caught) == 1  # once per loader, not once per epoch
    text = str(caught[0].message)
    assert "the training loop waited for batches" in text and "epoch 1" in text
    assert "2 workers were busy" in text and "num_workers='auto'" in text
    assert caught[0].filename == __file__  # points at the training loop's line


def test_no_stall_warning_when_the_loop_does_not_wait(monkeypatch):
    monkeypatch.setattr(_stats, "STALL_MIN_SECONDS", 0.1)
    with ShmLoader(Filled(2_000, **ROW), batch_size=50, num_workers=2) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DataStallWarning)
            epochs(loader, 2, step=0.01)


def test_no_stall_warning_from_the_torch_compatible_dataloader(monkeypatch):
    pytest.importorskip("torch")
    from loader import DataLoader
    monkeypatch.setattr(_stats, "STALL_MIN_SECONDS", 0.1)
    loader = DataLoader(Filled(200, **ROW, delay=0.005), batch_size=10, num_workers=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DataStallWarning)
            assert sum(len(b) for b in loader) == 200  # as torch's DataLoader: no warning
        assert loader.stats()["samples"] == 200 and loader.stats()["batches"] == 20
    finally:
        loader._shm_loader().close()


def _stalled(**over):
    s = {"epoch": 3, "batches": 10, "samples": 100, "seconds": 10.0, "loop_wait_seconds": 8.0,
         "loop_wait_share": 0.8, "workers": 4, "workers_busy_share": 0.5,
         "batcher_busy_share": 0.2, "samples_written_by_batcher": 0,
         "peak_slab_bytes": 1 << 20, "memory_cap_bytes": 1 << 30}
    s.update(over)
    return s


@pytest.mark.parametrize("over, says", [
    ({"workers_busy_share": 0.97}, "4 workers were busy 97%"),
    ({"batcher_busy_share": 0.95, "samples_written_by_batcher": 60},
     "60 of 100 samples were written by it"),
    # workers blocked sending to a saturated batcher look busy: the batcher is named
    ({"workers_busy_share": 0.97, "batcher_busy_share": 0.95, "samples_written_by_batcher": 60},
     "60 of 100 samples were written by it"),
    ({"batcher_busy_share": 0.95}, "fewer, larger batches"),
    ({"peak_slab_bytes": 1 << 30}, "raise memory_cap_bytes"),
    ({}, "raise prefetch, or use persistent_workers=True"),
    ({"workers": 0, "workers_busy_share": None}, "num_workers=0 loads in the training process"),
])
def test_stall_advice_names_the_bottleneck(over, says):
    advice = _stats.stall_advice(_stalled(**over))
    assert advice.startswith("ShmLoader: the training loop waited for batches 80% of epoch 3 "
                             "(8.0 of 10.0 s). ")
    assert says in advice, advice


@pytest.mark.parametrize("over", [{"seconds": 4.0, "loop_wait_seconds": 3.9},
                                  {"loop_wait_share": 0.5, "loop_wait_seconds": 5.0}])
def test_no_stall_advice_for_short_epochs_or_half_waits(over):
    assert _stats.stall_advice(_stalled(**over)) is None


def test_wait_clock_is_readable_mid_wait_and_never_goes_back():
    words = shmq.shared_array(2, np.int64)
    clock = _stats.WaitClock(words, 1)
    assert _stats.waited_ns(words, 1) == 0
    clock.begin()
    time.sleep(0.05)
    mid = _stats.waited_ns(words, 1)
    assert mid >= 50_000_000  # the wait counts while it goes on
    clock.end()
    total = _stats.waited_ns(words, 1)
    assert total == clock.total >= mid
    time.sleep(0.01)  # busy time does not count
    assert _stats.waited_ns(words, 1) == total
    again = _stats.WaitClock(words, 1)  # a clock starts from its word's total
    assert again.total == total
    assert _stats.waited_ns(words, 0) == 0  # its neighbour untouched


@pytest.mark.parametrize("num_workers, use_steps", [(0, False), (2, True)])
def test_stall_warning_points_at_the_training_loop(monkeypatch, num_workers, use_steps):
    monkeypatch.setattr(_stats, "STALL_MIN_SECONDS", 0.1)
    with ShmLoader(Filled(100, **ROW, delay=0.005), batch_size=10,
                   num_workers=num_workers) as loader:
        with pytest.warns(DataStallWarning) as caught:
            batches = loader.steps(25) if use_steps else iter(loader)
            assert sum(len(b) for b in batches) == (250 if use_steps else 100)
    assert len(caught) == 1 and caught[0].filename == __file__
    if num_workers == 0:
        assert "num_workers=0 loads in the training process" in str(caught[0].message)


def test_a_clock_not_started_yet_counts_as_waiting():
    """num_workers="auto": a worker forked late was idle, not busy, before."""
    words = shmq.shared_array(3, np.int64)
    _stats.start_idle(words)
    time.sleep(0.02)
    assert _stats.waited_ns(words, 2) >= 20_000_000
    clock = _stats.WaitClock(words, 2)  # the worker starts: busy from now
    before = _stats.waited_ns(words, 2)
    assert before == clock.total >= 20_000_000
    time.sleep(0.01)
    assert _stats.waited_ns(words, 2) == before
