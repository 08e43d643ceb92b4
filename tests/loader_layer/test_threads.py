"""worker_mode="thread" (issue 9): the same API, slabs and guarantees with
the workers and the batcher as threads of the main process."""

import threading
import time

import numpy as np
import pytest

from loader import ShmLoader, WorkerError, get_worker_info

pytestmark = pytest.mark.timeout(60)


class Numbers:
    def __init__(self, n, fail_at=None, hang_at=None):
        self.n, self.fail_at, self.hang_at = n, fail_at, hang_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"no sample {i}")
        if i == self.hang_at:
            time.sleep(5)
        info = get_worker_info()
        assert info.worker_method == "thread" and threading.current_thread().name.startswith(
            "ShmLoader worker")
        return {"x": np.full((2, 3), i, np.float32), "i": i, "name": f"s{i}",
                "draw": info.rng.numpy.rand()}


def check(batches, n):
    ids = [k for b in batches for k in b["i"].tolist()]
    for b in batches:
        np.testing.assert_array_equal(b["x"][:, 0, 0], b["i"].astype(np.float32))
        assert b["name"] == [f"s{k}" for k in b["i"].tolist()]
    return ids


def test_epochs_in_order_shuffled_and_first_ready():
    with ShmLoader(Numbers(203), batch_size=8, num_workers=3, worker_mode="thread") as loader:
        for _ in range(2):
            assert check(list(loader), 203) == list(range(203))
    with ShmLoader(Numbers(203), batch_size=8, num_workers=3, worker_mode="thread",
                   shuffle=True, seed=1, in_order=False) as loader:
        epochs = [check(list(loader), 203) for _ in range(2)]
    assert all(sorted(e) == list(range(203)) for e in epochs) and epochs[0] != epochs[1]


def test_reproducible_draws_from_each_threads_generators_and_globals_are_left_alone():
    np.random.seed(0)
    before = np.random.get_state()[1].copy()

    def draws(workers):
        with ShmLoader(Numbers(100), batch_size=10, num_workers=workers, worker_mode="thread",
                       seed=4) as loader:
            return {i: d for b in loader for i, d in zip(b["i"].tolist(), b["draw"].tolist())}

    assert draws(1) == draws(3)
    assert np.array_equal(np.random.get_state()[1], before)  # main's generator untouched


def test_errors_keep_their_type_and_a_hung_thread_times_out_with_its_stack():
    with ShmLoader(Numbers(40, fail_at=13), batch_size=4, num_workers=2,
                   worker_mode="thread") as loader:
        with pytest.raises(KeyError, match="no sample 13"):
            list(loader)
    with ShmLoader(Numbers(40, hang_at=9), batch_size=4, num_workers=2, worker_mode="thread",
                   timeout=1) as loader:
        with pytest.raises(WorkerError, match=r"(?s)no batch within timeout=1s.*__getitem__"):
            list(loader)


def test_a_crash_outside_the_sample_reaches_main():
    class Exits(Numbers):
        def __getitem__(self, i):
            if i == 5:
                raise SystemExit("the dataset called sys.exit")
            return super().__getitem__(i)

    with ShmLoader(Exits(40), batch_size=4, num_workers=2, worker_mode="thread",
                   timeout=20) as loader:
        with pytest.raises(WorkerError, match="(?s)raised an exception.*SystemExit"):
            list(loader)


def test_threads_stop_at_close_and_streams_work():
    class Stream:
        def __iter__(self):
            w = get_worker_info().id
            for k in range(30):
                yield np.array([w, k])

    before = threading.active_count()
    with ShmLoader(Stream(), batch_size=4, num_workers=3, worker_mode="thread",
                   shuffle_buffer=16, seed=2) as loader:
        rows = np.concatenate(list(loader)).tolist()
        assert sorted(map(tuple, rows)) == [(w, k) for w in range(3) for k in range(30)]
        # 3 workers, the batcher and its arena warm-up (NOTE [ Warming the arena ])
        assert threading.active_count() == before + 5
    assert threading.active_count() == before


def test_bad_worker_mode():
    with pytest.raises(ValueError, match="worker_mode"):
        ShmLoader(Numbers(4), worker_mode="fiber")


_TORCH_HALF_IMPORTED = """
import importlib.machinery, json, sys, threading, types
import numpy as np
from loader import ShmLoader

class Rows:
    def __len__(self): return 2000
    def __getitem__(self, i): return np.full(3, i, np.int64), i

# What another thread's `import torch` looks like half-way: the module is in
# sys.modules with its spec still initializing, and torch.Tensor not made yet.
half = types.ModuleType("torch")
half.__spec__ = importlib.machinery.ModuleSpec("torch", None)
half.__spec__._initializing = True
out = {}
for mode, kw in (("threads", dict(num_workers=2, worker_mode="thread")),
                 ("processes", dict(num_workers=2)), ("inline", dict(num_workers=0))):
    with ShmLoader(Rows(), batch_size=64, seed=3, **kw) as ld:
        first = [b[1].tolist() for b in ld]       # an epoch; the next one starts loading ahead
        sys.modules["torch"] = half               # ... while "torch" is being imported
        try:
            second = [b[1].tolist() for b in ld]
        finally:
            del sys.modules["torch"]
    out[mode] = [sorted(sum(first, [])) == list(range(2000)),
                 sorted(sum(second, [])) == list(range(2000)), len(second)]
print(json.dumps(out))
"""


def test_a_half_imported_torch_is_no_torch(tmp_path):
    """The program imports torch in its main thread while thread workers
    load the next epoch ahead (a bench did: torch's DataLoader made after a
    thread-mode ShmLoader): the workers saw a half-made torch module in
    sys.modules and failed on torch.Tensor.  Thread workers, forked workers
    (a process forked mid-import keeps the half-made module) and
    num_workers=0 each load whole epochs while it is there."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TORCH_HALF_IMPORTED], capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "threads": [True, True, 32], "processes": [True, True, 32], "inline": [True, True, 32]}
