"""ShmLoader: exact contents, ordering, lifetimes and failures (R2-R7, R14).
Every test is time-limited; the autouse guards (conftest.py) check that
nothing is left in /dev/shm and that no process outlives its test."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import resource

import numpy as np
import pytest

from shmq import sync
from conftest import descendants, segment_pid, wait_until
from loader import CollateError, LoaderTimeout, ShmLoader, WorkerError, get_worker_info
from measure import record

pytestmark = pytest.mark.timeout(60)


class Numbers:
    """Sample i is a dict whose every leaf encodes i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full((2, 3), i, np.float32), "i": i, "name": f"s{i}",
                "pair": (np.int16(i % 100), np.arange(4) + i)}


def indices(batch):
    i = batch["i"]
    np.testing.assert_array_equal(batch["x"], np.broadcast_to(i[:, None, None], (len(i), 2, 3)))
    assert batch["name"] == [f"s{k}" for k in i.tolist()]
    np.testing.assert_array_equal(batch["pair"][1], np.arange(4)[None, :] + i[:, None])
    return i.tolist()


@pytest.mark.parametrize("n,batch_size,drop_last", [(100, 7, False), (100, 7, True), (64, 16, False)])
def test_in_order_exact_batches_over_epochs(n, batch_size, drop_last):
    with ShmLoader(Numbers(n), batch_size=batch_size, num_workers=2, drop_last=drop_last) as loader:
        expected = n // batch_size * batch_size if drop_last else n
        assert len(loader) == -(-expected // batch_size)
        for _ in range(3):
            batches = [indices(b) for b in loader]
            assert [k for b in batches for k in b] == list(range(expected))
            assert all(len(b) == batch_size for b in batches[:-1])


def test_default_collate_types():
    with ShmLoader(Numbers(10), batch_size=4, num_workers=2) as loader:
        b = next(iter(loader))
        assert b["x"].dtype == np.float32 and b["x"].shape == (4, 2, 3)
        assert b["i"].dtype == np.int64 and b["i"].tolist() == [0, 1, 2, 3]
        assert b["pair"][0].dtype == np.int16 and isinstance(b["pair"], tuple)
        assert b["name"] == ["s0", "s1", "s2", "s3"]


def test_shuffle_is_exactly_once_deterministic_and_differs_between_epochs():
    def epochs(seed):
        with ShmLoader(Numbers(50), batch_size=8, shuffle=True, seed=seed, num_workers=2) as loader:
            return [[k for b in loader for k in indices(b)] for _ in range(2)]

    first, again = epochs(7), epochs(7)
    assert first == again
    assert sorted(first[0]) == sorted(first[1]) == list(range(50))
    assert first[0] != first[1] and first[0] != list(range(50))
    assert epochs(8)[0] != first[0]


def test_first_ready_is_exactly_once():
    class Slow(Numbers):
        def __getitem__(self, i):
            if i == 3:
                time.sleep(0.3)  # in order, this would hold batch 0 back
            return super().__getitem__(i)

    with ShmLoader(Slow(40), batch_size=4, num_workers=2, in_order=False) as loader:
        got = [indices(b) for b in loader]
    flat = [k for b in got for k in b]
    assert sorted(flat) == list(range(40))
    assert 3 not in got[0]


def test_every_sample_is_written_by_its_worker_from_the_first_batch_on():
    # NOTE [ Direct row writes ]: the first sample's signature is enough to
    # lay a batch out; no sample ever travels through a ring.
    for in_order in (True, False):
        with ShmLoader(Numbers(100), batch_size=7, num_workers=2, in_order=in_order) as loader:
            assert loader.stats() is None
            for epoch in range(3):
                assert sorted(k for b in loader for k in indices(b)) == list(range(100))
                stats = loader.stats()
                assert stats["batches"] == 15 and stats["samples"] == 100
                assert stats["samples_written_by_workers"] == 100, stats
                assert stats["samples_written_by_batcher"] == 0 and stats["relayouts"] == 0


class Buckets:
    """Sample i is (i // 4 % 3 + 1, 2) int32 full of i: the shape changes
    every batch of 4, as with a bucketing sampler."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return np.full((i // 4 % 3 + 1, 2), i, np.int32)


def test_shapes_that_change_between_batches_are_collated():
    with ShmLoader(Buckets(), batch_size=4, num_workers=2) as loader:
        for _ in range(2):
            batches = list(loader)
            assert len(batches) == 10
            for k, b in enumerate(batches):
                ids = np.arange(4 * k, 4 * k + 4, dtype=np.int32)
                np.testing.assert_array_equal(b, np.broadcast_to(ids[:, None, None], (4, k % 3 + 1, 2)))
            stats = loader.stats()
            assert stats["relayouts"] > 0  # the layout guess was wrong, and replaced
            assert stats["samples_written_by_workers"] == 40  # still written directly


def test_shapes_that_differ_within_a_batch_are_refused_with_the_remedy():
    class Ragged(Numbers):
        def __getitem__(self, i):
            return np.zeros(i % 2 + 1)

    with ShmLoader(Ragged(8), batch_size=4, num_workers=2) as loader:
        with pytest.raises(CollateError, match="pass collate_fn"):
            list(loader)


def test_epochs_abandoned_mid_write_never_corrupt_later_batches():
    # Workers may be writing rows of an abandoned epoch's batches; those
    # slabs are held back until every worker has left that epoch.
    class Slowish(Numbers):
        def __getitem__(self, i):
            time.sleep(0.002)
            return super().__getitem__(i)

    with ShmLoader(Slowish(120), batch_size=6, num_workers=2) as loader:
        for _ in range(8):
            for _ in zip(range(2), loader):
                pass
        kept = list(loader)
        assert [k for b in kept for k in indices(b)] == list(range(120))


def test_sampler_and_len():
    with ShmLoader(Numbers(30), batch_size=4, sampler=[5, 3, 29, 0, 7], num_workers=2) as loader:
        assert len(loader) == 2
        assert [indices(b) for b in loader] == [[5, 3, 29, 0], [7]]


def test_custom_collate_fn_output_is_zero_copy():
    def collate(samples):
        return {"sum": np.stack([s["x"] for s in samples]).sum(axis=0), "n": len(samples),
                "ids": np.array([s["i"] for s in samples])}

    with ShmLoader(Numbers(9), batch_size=4, collate_fn=collate, num_workers=2) as loader:
        out = list(loader)
    assert [b["n"] for b in out] == [4, 4, 1]
    assert [b["ids"].tolist() for b in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    np.testing.assert_array_equal(out[1]["sum"], np.full((2, 3), 4 + 5 + 6 + 7, np.float32))


class Shards:
    """Iterable dataset; each worker yields its share (as in PyTorch)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        for i in range(info.id, self.n, info.num_workers):
            yield np.array([i, info.id])


def test_iterable_dataset_sharded_by_worker_info():
    """Each worker fills batches from its own stream; in order, they come
    round-robin over the workers, each worker's short last batch last (as
    PyTorch's DataLoader delivers them)."""
    with ShmLoader(Shards(23), batch_size=5, num_workers=3) as loader:
        for _ in range(2):
            batches = list(loader)
            assert [b[:, 0].tolist() for b in batches] == [
                [0, 3, 6, 9, 12], [1, 4, 7, 10, 13], [2, 5, 8, 11, 14],
                [15, 18, 21], [16, 19, 22], [17, 20]]
            assert [set(b[:, 1].tolist()) for b in batches] == [{0}, {1}, {2}] * 2
        with pytest.raises(TypeError, match="no length"):
            len(loader)


class Uneven:
    """Worker w yields lengths[w] samples (w, k)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __iter__(self):
        w = get_worker_info().id
        for k in range(self.lengths[w]):
            yield np.array([w, k])


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_streams_of_different_lengths_in_order(drop_last):
    """Workers whose streams end early are skipped in the round-robin, as
    PyTorch does; drop_last drops each worker's short last batch."""
    with ShmLoader(Uneven([7, 2, 0, 5]), batch_size=2, num_workers=4, drop_last=drop_last,
                   prefetch=1) as loader:
        for _ in range(3):
            got = [b.tolist() for b in loader]
            expected = [[[0, 0], [0, 1]], [[1, 0], [1, 1]], [[3, 0], [3, 1]],
                        [[0, 2], [0, 3]], [[3, 2], [3, 3]], [[0, 4], [0, 5]]]
            expected += [] if drop_last else [[[3, 4]], [[0, 6]]]
            assert got == expected


def test_iterable_first_ready_delivers_every_sample_once():
    with ShmLoader(Uneven([50, 3, 20]), batch_size=4, num_workers=3, in_order=False) as loader:
        for _ in range(2):
            rows = [tuple(r) for b in loader for r in b.tolist()]
            assert sorted(rows) == sorted((w, k) for w, n in enumerate([50, 3, 20])
                                          for k in range(n))


def test_dataset_growth_between_epochs_is_seen():
    ds = Numbers(10)
    with ShmLoader(ds, batch_size=4, num_workers=2) as loader:
        assert [k for b in loader for k in indices(b)] == list(range(10))
        ds.n = 15
        assert [k for b in loader for k in indices(b)] == list(range(15))


class Counted(Numbers):
    """Counts every dataset[i] in shared memory; with fail_after, the
    loads after that many raise."""

    def __init__(self, n, fail_after=None):
        super().__init__(n)
        self.loads = sync.shared_array(1, np.int64)
        self.fail_after = fail_after

    def __getitem__(self, i):
        if sync.atomic_add(self.loads, 0, 1) + 1 > (self.fail_after or float("inf")):
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


def test_next_epochs_first_batches_are_loaded_before_it_starts():
    ds = Counted(50)
    with ShmLoader(ds, batch_size=4, num_workers=2, prefetch=3) as loader:
        assert [k for b in loader for k in indices(b)] == list(range(50))
        # the next epoch runs ahead by exactly the prefetch window (3 batches)
        assert wait_until(lambda: ds.loads[0] == 50 + 12, 5), ds.loads[0]
        time.sleep(0.2)
        assert ds.loads[0] == 50 + 12
        assert [k for b in loader for k in indices(b)] == list(range(50))
        assert wait_until(lambda: ds.loads[0] == 100 + 12, 5), ds.loads[0]


def test_no_run_ahead_with_a_sampler_whose_next_order_is_unknown():
    ds = Counted(20)
    with ShmLoader(ds, batch_size=4, num_workers=2, sampler=range(20)) as loader:
        assert [k for b in loader for k in indices(b)] == list(range(20))
        time.sleep(0.3)
        assert ds.loads[0] == 20


class FailsOnSecondLoad(Numbers):
    """Sample `bad` fails when it is loaded the second time (its next epoch)."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad, self.seen = bad, sync.shared_array(1, np.int64)

    def __getitem__(self, i):
        if i == self.bad and sync.atomic_add(self.seen, 0, 1) >= 1:
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


def test_an_error_in_the_epoch_run_ahead_is_raised_in_that_epoch():
    ds = FailsOnSecondLoad(20, 12)
    with ShmLoader(ds, batch_size=4, num_workers=2) as loader:
        assert [k for b in loader for k in indices(b)] == list(range(20))
        it = iter(loader)  # the epoch that ran ahead: batches 0-2, then sample 12's error
        assert [indices(next(it)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                         [8, 9, 10, 11]]
        with pytest.raises(ValueError, match="bad sample 12"):
            next(it)
        assert indices(next(it)) == [16, 17, 18, 19]  # and the epoch goes on
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.parametrize("shuffle", [False, True])
def test_growth_between_epochs_restarts_the_epoch_run_ahead(shuffle):
    ds = Numbers(30)
    with ShmLoader(ds, batch_size=4, num_workers=2, shuffle=shuffle, seed=3) as loader:
        assert sorted(k for b in loader for k in indices(b)) == list(range(30))
        ds.n = 45
        second = [k for b in loader for k in indices(b)]
        assert sorted(second) == list(range(45))
        assert second == list(range(45)) or shuffle


class Seeds:
    """Every worker yields one sample: its id, its seed and a numpy draw."""

    def __iter__(self):
        info = get_worker_info()
        yield np.array([info.id, info.seed % 1000, np.random.randint(1 << 30)])


def test_worker_seeding_differs_per_worker_and_repeats_across_runs():
    def run(seed):
        with ShmLoader(Seeds(), batch_size=2, num_workers=2, seed=seed) as loader:
            epochs = [{int(r[0]): (int(r[1]), int(r[2])) for b in loader for r in b}
                      for _ in range(2)]
        return epochs

    a, b = run(3), run(3)
    assert a == b and sorted(a[0]) == [0, 1]
    assert a[0][0] != a[0][1]  # workers differ
    assert a[0] != a[1]        # epochs differ
    assert run(4) != a         # seeds matter
    assert get_worker_info() is None


class FreshBuffers:
    """Each sample makes 8 buffers of 1 MiB at once and frees them (as
    decoding an image and building a sample's arrays do) and reports the
    page faults its process took meanwhile."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        bufs = [np.ones(1 << 17, np.float64) for _ in range(8)]  # 1 MiB each, written through
        del bufs
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_worker_processes_reuse_a_samples_freed_buffers():
    """glibc maps every allocation over 128 KiB anew and faults its pages
    in (256 a MiB), then unmaps it, unless told to keep freed memory: a
    worker process keeps it (keep_freed_memory in worker/worker.py), so after its
    first samples a sample's buffers cost no faults.  Measured: 1.9 ms a
    JPEG decode without, 1.4 ms with."""
    with ShmLoader(FreshBuffers(), batch_size=8, num_workers=2) as loader:
        faults = np.concatenate([b for b in loader])
    assert len(faults) == 64
    # each worker's first sample may take its 2048 faults; the others take none
    # of their buffers' pages (a few from elsewhere in the process: < 64)
    assert np.sum(faults >= 8 * 256) <= 2 and np.median(faults) < 64, faults.tolist()


def test_kept_batches_stay_intact_after_more_batches_close_and_del():
    """R14: data the user holds is never overwritten."""
    loader = ShmLoader(Numbers(200), batch_size=10, num_workers=2, memory_cap_bytes=1 << 20)
    kept = []
    for epoch in range(2):
        for k, b in enumerate(loader):
            if k % 3 == 0:
                kept.append((b, indices(b)))
    loader.close()
    del loader
    gc.collect()
    for b, ids in kept:
        assert indices(b) == ids


def test_torch_output_shares_slab_memory():
    torch = pytest.importorskip("torch")
    with ShmLoader(Numbers(6), batch_size=3, num_workers=2, output="torch") as loader:
        b = next(iter(loader))
    assert isinstance(b["x"], torch.Tensor) and b["x"].shape == (3, 2, 3)
    assert b["i"].tolist() == [0, 1, 2]
    assert not b["x"].numpy().flags.owndata


# --- failures --------------------------------------------------------------------

class Failing(Numbers):
    def __init__(self, n, bad, how):
        super().__init__(n)
        self.bad, self.how = bad, how

    def __getitem__(self, i):
        if i == self.bad:
            if self.how == "raise":
                raise KeyError(f"no sample {i}")
            if self.how == "exit":
                os._exit(3)
            if self.how == "segfault":
                import faulthandler

                faulthandler.disable()  # pytest's dump would only be noise here
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.how == "hang":
                time.sleep(600)
        return super().__getitem__(i)


def test_worker_exception_is_reraised_with_its_type_traceback_and_index():
    """As PyTorch does: the exception's own type (here KeyError, whose
    message stays readable), the worker's traceback and where."""
    with ShmLoader(Failing(50, 17, "raise"), batch_size=4, num_workers=2) as loader:
        with pytest.raises(KeyError) as info:
            list(loader)
        text = str(info.value)
        assert text.startswith("Caught KeyError in worker ") and "sample index 17" in text
        assert "KeyError: 'no sample 17'" in text
        assert "Traceback" in text and "__getitem__" in text and "(pid " in text
        it = iter(loader)  # still usable
        assert [indices(next(it)) for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("how,expect", [("exit", "exit code 3"), ("segfault", "signal SIGSEGV")])
def test_worker_death_is_reported_within_two_seconds(how, expect):
    with ShmLoader(Failing(50, 9, how), batch_size=4, num_workers=2) as loader:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=expect) as info:
            list(loader)
        assert time.monotonic() - t0 < 2.0
        assert "pid" in str(info.value)


def test_batcher_killed_is_reported():
    with ShmLoader(Numbers(10_000), batch_size=4, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        os.kill(loader._session.procs[-1].pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="batcher .* signal SIGKILL"):
            for _ in it:
                pass


def test_timeout_on_a_hung_worker():
    with ShmLoader(Failing(50, 0, "hang"), batch_size=4, num_workers=1, timeout=0.5) as loader:
        t0 = time.monotonic()
        with pytest.raises(LoaderTimeout, match="timeout=0.5") as info:
            list(loader)
        assert time.monotonic() - t0 < 2.0
    text = str(info.value)
    assert "--- worker 0 (pid" in text and "in __getitem__" in text and "time.sleep" not in text


def test_break_then_next_epoch_is_clean():
    with ShmLoader(Numbers(1000), batch_size=10, num_workers=2) as loader:
        for k, b in enumerate(loader):
            if k == 2:
                break
        assert [k for b in loader for k in indices(b)] == list(range(1000))


def test_del_and_garbage_collection_stop_the_children():
    loader = ShmLoader(Numbers(1000), batch_size=10, num_workers=2)
    next(iter(loader))
    pids = [p.pid for p in loader._session.procs]
    assert set(pids) <= set(descendants())
    del loader
    gc.collect()
    assert not set(pids) & set(descendants())  # gone and reaped: not even zombies
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_nothing_is_created_in_dev_shm_so_its_size_does_not_matter(monkeypatch):
    """Docker's default /dev/shm is 64 MiB: the loader keeps nothing there
    (its rings and slabs are unnamed shared memory)."""
    from shmq import segment

    monkeypatch.setattr(segment, "free_bytes", lambda: 0)

    def ours():  # other shmq programs may be running: judge only this process tree
        tree = {os.getpid(), *descendants()}
        return {e for e in os.listdir("/dev/shm") if segment_pid(e) in tree}

    before = ours()
    with ShmLoader(Numbers(64), batch_size=4, num_workers=2) as loader:
        it = iter(loader)
        first = indices(next(it))
        assert ours() == before
        assert first + [k for b in it for k in indices(b)] == list(range(64))


def test_bad_arguments():
    for kwargs, match in [({"batch_size": 0}, "batch_size"), ({"num_workers": -1}, "num_workers"),
                          ({"output": "jax"}, "output"), ({"timeout": -1}, "timeout"),
                          ({"shuffle": True, "sampler": [1]}, "exclusive")]:
        with pytest.raises(ValueError, match=match):
            ShmLoader(Numbers(4), **kwargs)


CHILD = textwrap.dedent("""
    import os, signal, sys, time, numpy as np
    from loader import ShmLoader
    # A test suite started in the background inherits SIGINT ignored: restore it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    class Forever:
        def __len__(self): return 10**6
        def __getitem__(self, i): return np.zeros(1000)
    loader = ShmLoader(Forever(), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    print(" ".join(str(p.pid) for p in loader._session.procs), flush=True)
    try:
        time.sleep(600) if sys.argv[1] == "sleep" else [None for _ in it]
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def _gone(pids):
    def check():
        for pid in pids:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] != "Z":
                        return False
            except (ProcessLookupError, FileNotFoundError):
                pass
        return True
    return check


def test_main_killed_children_exit_within_two_seconds():
    """R4: SIGKILL to main; workers and batcher die with it."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, "sleep"], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) == 3
    p.kill()
    p.wait()
    p.stdout.close()
    assert wait_until(_gone(pids), 2.0)


def test_ctrl_c_while_iterating():
    """R7: SIGINT to the process group; main gets KeyboardInterrupt, the
    children print nothing and are gone."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, "iterate"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    time.sleep(0.3)
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=10)
    assert "interrupted" in out, err
    assert time.monotonic() - t0 < 5.0
    assert "Traceback" not in err, err
    assert wait_until(_gone(pids), 5.0)


def _resources():
    return (len(os.listdir("/proc/self/fd")), len(__import__("threading").enumerate()),
            len(descendants()),
            len([e for e in os.listdir("/dev/shm") if e.startswith(f"shmq-{os.getpid()}-")]))


@pytest.mark.parametrize("loops", [
    pytest.param(30, id="quick"),
    pytest.param(1000, marks=[pytest.mark.stress, pytest.mark.timeout(3600)], id="full"),
])
def test_create_iterate_drop_loop_does_not_grow(loops):
    """R6: break, del, an exception mid-loop, and plain exhaustion, many
    times over; fds, threads, processes and /dev/shm stay flat."""
    def once(k):
        loader = ShmLoader(Numbers(40), batch_size=8, num_workers=2)
        if k % 4 == 0:
            for b in loader:
                break
        elif k % 4 == 1:
            with pytest.raises(ZeroDivisionError):
                for b in loader:
                    1 / 0
        elif k % 4 == 2:
            assert sum(len(indices(b)) for b in loader) == 40
        else:
            next(iter(loader))  # generator left suspended, loader dropped
        del loader

    once(0)
    gc.collect()
    before = _resources()
    for k in range(loops):
        once(k)
    gc.collect()
    assert wait_until(lambda: _resources() == before, 5), (before, _resources())
    record("R6", "create, iterate (break / exception / to the end / left suspended), drop: "
           "fds, threads, processes, /dev/shm back to where they were", count=loops,
           what="loaders")


def test_sigterm_to_main_leaves_nothing():
    """R8: SIGTERM kills main by default; the children die with it (PDEATHSIG)
    and nothing was ever named in /dev/shm beyond the unlinked rings."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, "sleep"], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]
    p.terminate()
    p.wait()
    p.stdout.close()
    assert wait_until(_gone(pids), 2.0)


def test_fork_after_threads_warns_with_the_remedy_once_per_process(monkeypatch):
    """R16: a process with threads gets a warning before the workers fork,
    once per process (issue 14 item 4: tqdm's monitor thread is alive at
    every epoch)."""
    import threading

    from loader.main import procs as _procs

    monkeypatch.setattr(_procs, "_advised_threads", False)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        loader = ShmLoader(Numbers(8), batch_size=4, num_workers=2)
        with pytest.warns(RuntimeWarning, match="before starting threads"):
            it = iter(loader)
        assert [k for b in it for k in indices(b)] == list(range(8))
        loader.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = ShmLoader(Numbers(8), batch_size=4, num_workers=2)
            assert [k for b in again for k in indices(b)] == list(range(8))
            again.close()
    finally:
        stop.set()
        t.join()


def _warn_here():
    warnings.warn("the program's own warning, shown once", UserWarning)


def test_forking_leaves_the_show_once_registry_alone():
    """Issue 14 item 4: catch_warnings() around os.fork emptied every
    module's show-once registry, so a warning the program had shown was
    shown again after the loader started its workers."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        _warn_here()
        loader = ShmLoader(Numbers(8), batch_size=4, num_workers=2, persistent_workers=False)
        for _ in range(2):  # forks at each epoch
            assert [k for b in loader for k in indices(b)] == list(range(8))
        loader.close()
        _warn_here()
    assert [str(w.message) for w in caught] == ["the program's own warning, shown once"]


def test_an_older_iterator_cannot_steal_a_newer_epochs_batches():
    with ShmLoader(Numbers(40), batch_size=4, num_workers=2) as loader:
        old = iter(loader)
        next(old)
        new = iter(loader)
        first = indices(next(new))  # the new epoch is running...
        with pytest.raises(RuntimeError, match="superseded"):
            next(old)               # ...and the old iterator must not cancel it
        assert first + [k for b in new for k in indices(b)] == list(range(40))


@pytest.mark.parametrize("cap", [4096, 8192])
def test_abandoned_iterators_release_the_batches_they_buffered(cap):
    """Out-of-order batches an iterator held back, and batches of an epoch
    it abandoned, go back to the pool: a tight memory cap keeps working (an
    abandoned run's batch waiting for memory gave it up only once the run
    ended: a pool of two batches waited until the timeout, one run in two;
    a pool of one batch (a slab is whole pages: NOTE [ Kept batch memory ])
    one run in six, its slab laid out for the batch after the one that
    waited: NOTE [ Memory goes to batches in order ] in batcher/runs.py)."""
    class SlowFirst(Numbers):
        def __getitem__(self, i):
            if i == 0:
                time.sleep(0.2)  # batches 1.. arrive first and wait in `pending`
            return super().__getitem__(i)

    with ShmLoader(SlowFirst(400), batch_size=4, num_workers=2, memory_cap_bytes=cap,
                   timeout=10) as loader:
        for _ in range(5):
            old = iter(loader)
            next(old)
            new = iter(loader)
            with pytest.raises(RuntimeError, match="superseded"):
                next(old)
            del old, new
        assert [k for b in loader for k in indices(b)] == list(range(400))


def failing_init(worker_id):
    raise OSError(f"cannot open the shard of worker {worker_id}")


def test_worker_init_fn_error_is_reraised_with_its_traceback():
    with ShmLoader(Numbers(8), batch_size=4, num_workers=2, worker_init_fn=failing_init) as loader:
        with pytest.raises(OSError, match=r"OSError: cannot open the shard of worker \d") as info:
            list(loader)
    assert "failing_init" in str(info.value)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_ctrl_c_between_a_runs_start_and_its_clock_then_del(monkeypatch, mode):
    """A Ctrl-C that lands in the first next() after the run started and
    before its clock was made (test_suite_conditions' start-up loop hit it):
    the KeyboardInterrupt reaches the caller, dropping the iterator ends
    its run with nothing raised in __del__ (warnings are errors: an
    exception ignored there fails the test), and the loader's next epoch
    yields all 64 samples exactly."""
    from loader.main import epochs as _epochs

    real = _epochs.EpochClock
    calls = []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(_epochs, "EpochClock", interrupted)
    with ShmLoader(np.arange(64), batch_size=8, num_workers=2, worker_mode=mode) as ld:
        it = iter(ld)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        del it
        gc.collect()
        assert [b.tolist() for b in ld] == [list(range(k, k + 8)) for k in range(0, 64, 8)]
    assert len(calls) == 2


def _path_to(start, target):
    """The attributes by which `start` holds `target` (strong references
    only: no weakref is followed, nor a function's module globals), else None."""
    import types
    seen, stack = set(), [(start, "epoch")]
    while stack:
        obj, path = stack.pop()
        if obj is target:
            return path
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, np.ndarray, str, bytes,
                                               int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            refs = [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None]
        else:
            refs = gc.get_referents(obj)
        stack.extend((r, f"{path} > {type(r).__name__}") for r in refs)
    return None


@pytest.mark.parametrize("workers,iterable", [(2, False), (2, True), (0, False), (0, True)],
                         ids=["map", "stream", "inline", "inline-stream"])
def test_a_loader_iterated_without_a_name_lives_until_its_epoch_ends(workers, iterable):
    """`for batch in ShmLoader(...)`: nothing but the iterator holds the
    loader; a collection in the middle of the epoch does not close it under
    the loop, every sample comes once, and once the iterator is gone so are
    the loader's processes."""
    data = Stream(960) if iterable else np.arange(960)
    got = []
    for k, b in enumerate(ShmLoader(data, batch_size=8, num_workers=workers)):
        if k in (1, 60):
            gc.collect()
        got += b.tolist()
    assert sorted(got) == list(range(960))
    gc.collect()   # the iterator, and with it the loader: closed, its processes stopped


class Stream:
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(np.arange(self.n)[w::k])


@pytest.mark.parametrize("workers,iterable,persistent", [
    (2, False, True), (2, False, False), (2, True, True), (0, False, True), (0, True, False)],
    ids=["map", "map-not-persistent", "stream", "inline", "inline-stream"])
def test_an_epoch_holds_nothing_that_leads_back_to_its_loader(workers, iterable, persistent):
    """No callback climbs from an epoch to its loader (NOTE [ Who decides on
    main's batch path ]): nothing an iterator holds, however deep, is the
    ShmLoader or one of its bound methods; yet the iterator works as it
    did: all 96 samples in order, the loader's state_dict() in the middle
    counts the 4 batches handed out, stats() after the end counts all 12,
    a superseded iterator raises, and without persistent workers the
    processes stop when the epoch ends."""
    data = Stream(96) if iterable else np.arange(96)
    with ShmLoader(data, batch_size=8, num_workers=workers,
                   persistent_workers=persistent) as ld:
        it = iter(ld)
        got = [next(it) for _ in range(4)]
        # its one reference to the loader keeps it alive (for b in ShmLoader(...)),
        # and is never called: without it, nothing leads back
        assert it.keep_alive is ld
        it.keep_alive = None
        assert _path_to(it, ld) is None
        it.keep_alive = ld
        state = ld.state_dict()
        if iterable:
            assert sum(s["prefix"] for s in state["stream"]) == 32
        else:
            assert state["map"]["done_prefix"] == 32
        got += list(it)
        assert sorted(np.concatenate(got).tolist()) == list(range(96))
        if not iterable:
            assert np.concatenate(got).tolist() == list(range(96))
        assert ld.stats()["batches"] == 12 and ld.stats()["samples"] == 96
        assert (ld._session is None) == (not persistent or workers == 0)
        old = iter(ld)
        new = iter(ld)
        next(new)
        if workers:  # (num_workers=0 has never checked: nothing runs between its batches)
            with pytest.raises(RuntimeError, match="superseded"):
                next(old)
