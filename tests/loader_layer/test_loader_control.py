"""The loader's control plane at the sizes and timings where it used to hang
(R19, R21, R25): large datasets with a training step slower than loading,
more workers than prefetched samples, a batch over the memory cap, samples
over 32 MiB, a loader first iterated from a thread, and idle processes
that must sleep rather than poll.  Exact counts and contents everywhere."""

import gc
import os
import threading
import time
import warnings

import numpy as np
import pytest

from conftest import descendants, wait_until
from loader import ShmLoader, WorkerError
from loader.shared.layout import Layout, signature
from loader.order.indices import epoch_order
from loader.batcher.slabs import slab_bytes as pool_bytes
from shared_datasets import Filled

pytestmark = pytest.mark.timeout(120)


class Pairs:
    """Sample i is np.array([i, -i]) (shape (2,)), as in the report."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.array([i, -i], np.int64)


def check_epoch(batches, n, batch_size):
    """Every sample exactly once, in order, in batches of batch_size."""
    assert [len(b) for b in batches[:-1]] == [batch_size] * (len(batches) - 1)
    got = np.concatenate(batches)
    np.testing.assert_array_equal(got[:, 0], np.arange(n))
    np.testing.assert_array_equal(got[:, 1], -np.arange(n))


def test_a_dataset_over_131072_samples_with_a_slower_step_ends_every_epoch():
    """The report's case: 200,001 samples of shape (2,), batch 100, 2
    workers, a 1 ms step: the last batch is short by fewer positions than
    there are workers."""
    n, B = 200_001, 100
    with ShmLoader(Pairs(n), batch_size=B, num_workers=2, timeout=30) as loader:
        assert len(loader) == 2001
        for epoch in range(2):
            batches = []
            for b in loader:
                batches.append(b.copy())
                time.sleep(0.001)  # the training step is slower than loading
            check_epoch(batches, n, B)
            assert loader.stats()["batches"] == 2001


@pytest.mark.parametrize("in_order", [True, False])
def test_300k_samples_over_several_epochs_with_a_slow_step(in_order):
    n, B = 300_007, 1000
    with ShmLoader(Pairs(n), batch_size=B, num_workers=3, shuffle=True, seed=11,
                   in_order=in_order, timeout=30) as loader:
        orders = []
        for epoch in range(3):
            seen = []
            for k, b in enumerate(loader):
                seen.append(b[:, 0].copy())
                np.testing.assert_array_equal(b[:, 1], -b[:, 0])
                if k % 50 == 0:
                    time.sleep(0.02)
            got = np.concatenate(seen)
            assert len(got) == n and len(seen) == 301
            np.testing.assert_array_equal(np.sort(got), np.arange(n))
            orders.append(got)
        assert not np.array_equal(orders[0], orders[1])  # a new shuffle each epoch
        if in_order:
            ref = epoch_order(n, seed=11, epoch=1)  # NOTE [ The seeded order ]
            np.testing.assert_array_equal(orders[0], ref)


@pytest.mark.parametrize("num_workers,batch_size,prefetch,persistent", [
    (4, 1, None, True), (8, 1, 1, True), (4, 1, 3, False), (6, 2, 1, True), (5, 3, 1, False)])
def test_more_workers_than_prefetched_samples(num_workers, batch_size, prefetch, persistent):
    n = 10
    with ShmLoader(Pairs(n), batch_size=batch_size, num_workers=num_workers, prefetch=prefetch,
                   persistent_workers=persistent, timeout=20) as loader:
        for _ in range(3):
            check_epoch(list(loader), n, batch_size)


def test_persistent_workers_false_restarts_the_processes_every_epoch():
    with ShmLoader(Pairs(50), batch_size=8, num_workers=2, persistent_workers=False,
                   timeout=20) as loader:
        pids = []
        for _ in range(3):
            batches = []
            for b in loader:
                batches.append(b.copy())
                pids.append(tuple(p.pid for p in loader._session.procs))
            check_epoch(batches, 50, 8)
            assert loader._session is None  # stopped at the end of the epoch
        assert len(set(pids)) == 3


# 64 samples; sample i: 256 KiB of float32 filled with i
BIG = dict(n=64, shape=(256, 256), dtype=np.float32)


def slab_bytes(sample, rows: int) -> int:
    """The slab a batch of `rows` such samples takes (rows and tags, in
    whole pages)."""
    return pool_bytes(Layout(signature(sample), rows).nbytes)


def test_a_batch_larger_than_the_memory_cap_is_an_error_naming_both_sizes():
    with ShmLoader(Filled(**BIG), batch_size=16, num_workers=2,
                   memory_cap_bytes=1 << 20) as loader:
        t0 = time.monotonic()
        with pytest.raises(MemoryError) as info:
            list(loader)
        assert time.monotonic() - t0 < 5
        text = str(info.value)
        need = pool_bytes(16 * 256 * 256 * 4 + 16 * 8)  # the rows and a tag per row, in pages
        assert f"needs {need} bytes" in text
        assert "memory_cap_bytes is 1048576" in text and f"memory_cap_bytes >= {need}" in text
        with pytest.raises(MemoryError, match=f"needs {need} bytes"):
            list(loader)  # the same answer again: the loader is still usable


def test_batches_kept_past_the_cap_move_out_of_the_pool_without_a_wait():
    """The user holds every batch of an epoch five times the cap: main
    moves them out of the pool (NOTE [ Kept batch memory ]), with no wait
    and no warning, and every kept batch keeps its values."""
    B = 4
    cap = 3 * slab_bytes(Filled(**BIG)[0], B)  # three batches of BIG
    with ShmLoader(Filled(**BIG), batch_size=B, num_workers=2, memory_cap_bytes=cap, prefetch=1,
                   timeout=20) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            held = list(loader)
        assert loader._session.leases.evicted_slabs >= len(held) - 3
        assert len(held) == 64 // B
        for k, b in enumerate(held):
            np.testing.assert_array_equal(b[:, 0, 0], np.arange(4 * k, 4 * k + 4))
            np.testing.assert_array_equal(b[:, -1, -1], np.arange(4 * k, 4 * k + 4))
        del held
        gc.collect()
        for k, b in enumerate(loader):  # and the next epoch runs normally
            np.testing.assert_array_equal(b[:, 0, 0], np.arange(4 * k, 4 * k + 4))


def test_close_is_prompt_while_the_batcher_waits_for_memory():
    B = 4
    with ShmLoader(Filled(**BIG), batch_size=B, num_workers=2,
                   memory_cap_bytes=2 * slab_bytes(Filled(**BIG)[0], B), prefetch=1) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            it = iter(loader)
            held = [next(it), next(it)]
            time.sleep(0.3)  # the batcher waits for memory, or moves on once main moved them out
            t0 = time.monotonic()
            loader.close()
        assert time.monotonic() - t0 < 3
        np.testing.assert_array_equal(held[1][:, 0, 0], np.arange(4, 8))  # still ours


class Large:
    """Sample i is a 36 or 40 MiB array (the shape changes every batch)
    whose first and last elements encode i."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        a = np.zeros((36 + 4 * (i % 2)) << 18, np.float32)
        a[0], a[-1] = i, -i
        return {"a": a, "i": i}


def test_samples_over_32_mib_with_shapes_that_change_are_loaded():
    with ShmLoader(Large(), batch_size=1, num_workers=2, prefetch=1, timeout=60) as loader:
        for epoch in range(2):
            for k, b in enumerate(loader):
                assert b["i"].tolist() == [k]
                assert b["a"].shape == (1, (36 + 4 * (k % 2)) << 18)
                assert b["a"][0, 0] == k and b["a"][0, -1] == -k
                assert not b["a"][0, 1:-1].any()
            stats = loader.stats()
            # Each batch is laid out at most twice: once from a guess (the
            # previous batch's shapes), again from its own sample.  How many
            # guesses come first depends on timing: whether the batcher lays
            # the batch out before or after its sample is read.
            assert stats["samples_written_by_workers"] == 6
            assert stats["relayouts"] <= stats["batches"] == 6


def test_a_loader_first_iterated_in_a_thread_that_ends_keeps_its_workers():
    """PR_SET_PDEATHSIG fires when the forking *thread* exits: the workers
    must survive it and die only with the process."""
    loader = ShmLoader(Pairs(256), batch_size=16, num_workers=2, timeout=20)
    out = []
    t = threading.Thread(target=lambda: out.append(next(iter(loader)).copy()))
    with pytest.warns(RuntimeWarning, match="threads"):
        t.start()
        t.join()
    np.testing.assert_array_equal(out[0][:, 0], np.arange(16))
    time.sleep(0.3)  # the kernel has sent the parent-death signal by now
    assert all(p.exitcode is None for p in loader._session.procs)
    for _ in range(2):
        check_epoch(list(loader), 256, 16)
    # and a background thread iterating every epoch (a prefetching wrapper)
    results = []
    for _ in range(2):
        t = threading.Thread(target=lambda: results.append([b.copy() for b in loader]))
        t.start()
        t.join()
    for batches in results:
        check_epoch(batches, 256, 16)
    loader.close()


def voluntary_switches(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def test_idle_processes_sleep_instead_of_polling():
    """R25, as counts rather than CPU time (the CPU figure is a benchmark):
    with prefetch full and the training loop busy elsewhere, each of the
    loader's 9 processes wakes up at most a few times a second (its bounded
    sleeps re-check the parent), where polling every 0.2-2 ms woke it
    hundreds of times."""
    with ShmLoader(Pairs(10 ** 6), batch_size=32, num_workers=8) as loader:
        it = iter(loader)
        next(it)
        time.sleep(1.0)  # everything loaded that may be: all sleep now
        pids = [p.pid for p in loader._session.procs]
        before = [voluntary_switches(pid) for pid in pids]
        time.sleep(2.0)
        woke = [voluntary_switches(pid) - b for pid, b in zip(pids, before)]
        assert max(woke) <= 12, woke  # 2 s at one wake-up per 0.5 s slice, with slack
        np.testing.assert_array_equal(next(it)[:, 0], np.arange(32, 64))  # and still serving


def test_a_crash_outside_the_per_sample_path_reaches_main_with_its_traceback():
    class Exits(Pairs):
        def __getitem__(self, i):
            if i == 5:
                raise SystemExit("the dataset called sys.exit")
            return super().__getitem__(i)

    with ShmLoader(Exits(40), batch_size=4, num_workers=2, timeout=20) as loader:
        with pytest.raises(WorkerError) as info:
            list(loader)
    text = str(info.value)
    assert "exited unexpectedly with exit code 1" in text
    assert "SystemExit: the dataset called sys.exit" in text and "Traceback" in text


class Unpicklable:
    """Pickles, but cannot be unpickled: it crashes the batcher when it
    arrives among a row's values."""

    def __reduce__(self):
        return (_refuse_to_load, ())


def _refuse_to_load():
    raise RuntimeError("this object cannot be rebuilt")


def test_a_batcher_crash_reaches_main_with_its_traceback():
    class Odd(Pairs):
        def __getitem__(self, i):
            return {"x": super().__getitem__(i), "o": Unpicklable()}

    with ShmLoader(Odd(40), batch_size=4, num_workers=2, timeout=20) as loader:
        with pytest.raises(WorkerError) as info:
            list(loader)
    text = str(info.value)
    assert "the batcher" in text and "exit code 1" in text
    assert "this object cannot be rebuilt" in text


def test_workers_and_batcher_are_reaped_at_close():
    loader = ShmLoader(Pairs(100), batch_size=10, num_workers=3)
    check_epoch(list(loader), 100, 10)
    pids = {p.pid for p in loader._session.procs}
    assert pids <= set(descendants())
    loader.close()
    assert not pids & set(descendants())  # not even zombies
    assert wait_until(lambda: all(not os.path.exists(f"/proc/{p}") for p in pids), 2)
