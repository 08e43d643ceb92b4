"""Attacks at the machine's limits (issue 15): a worker SIGKILLed while
main re-matches FileDataset's pattern, more workers than the pids limit
lets fork, one sample of 3 GiB."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from loader import FileDataset, ShmLoader, WorkerError

pytestmark = pytest.mark.timeout(240)


class KillAtSecondMatch(FileDataset):
    """Kills `victim` as main starts matching the pattern for epoch 2
    (while epoch 1 still runs, if main prefetches epoch 2), so the walk runs
    while a worker is dead."""
    victim = None
    killed_at = None
    matches = 0

    def epoch_snapshot(self, info=None):
        type(self).matches += 1
        if type(self).matches == 2:
            os.kill(self.victim, signal.SIGKILL)
            type(self).killed_at = time.monotonic()
        return super().epoch_snapshot(info)


def test_worker_sigkilled_during_the_between_epoch_match(tmp_path):
    for i in range(40):
        np.save(tmp_path / f"s{i:03d}.npy", np.full(4, i, np.float32))
    ds = KillAtSecondMatch(str(tmp_path / "**" / "*.npy"))

    def init(worker_id):
        # renamed into place: the test never reads a file half-written
        (tmp_path / f"tmp{worker_id}").write_text(str(os.getpid()))
        os.replace(tmp_path / f"tmp{worker_id}", tmp_path / f"pid{worker_id}")
    got = []
    with ShmLoader(ds, batch_size=4, num_workers=2, worker_init_fn=init, timeout=30) as loader:
        it = iter(loader)
        got.append(next(it))
        # a worker that has loaded (the other one may not have started yet)
        wid = min(w for w in (0, 1) if (tmp_path / f"pid{w}").exists())
        KillAtSecondMatch.victim = int((tmp_path / f"pid{wid}").read_text())
        with pytest.raises(WorkerError, match=rf"worker {wid} \(pid {KillAtSecondMatch.victim}\) was "
                                              rf"killed by signal SIGKILL"):
            got += list(it)
            for _ in range(3):  # the error comes in epoch 1's rest or in epoch 2
                got += list(loader)
        detected = time.monotonic() - KillAtSecondMatch.killed_at
    assert detected < 2.0, detected
    rows = np.concatenate(got)[:, 0].tolist()
    assert rows == list(range(40)) * (len(rows) // 40) + list(range(len(rows) % 40))


PIDS_CHILD = textwrap.dedent("""
    import json, os, numpy as np
    from loader import ShmLoader
    def children():
        return open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    out = {}
    loader = ShmLoader(np.arange(1000).reshape(-1, 1), batch_size=10, num_workers=64)
    try:
        list(loader)
        out["outcome"] = ["ok", ""]
    except Exception as e:
        out["outcome"] = [type(e).__name__, str(e)]
    out["children_after_error"] = children()
    loader.close()
    with ShmLoader(np.arange(100).reshape(-1, 1), batch_size=10, num_workers=2) as small:
        out["small"] = np.concatenate(list(small))[:, 0].tolist() == list(range(100))
    out["children_at_end"] = children()
    print(json.dumps(out))
""")


def test_more_workers_than_the_pids_limit_allows_names_the_limit(tmp_path):
    """64 workers under a pids cgroup of 12 (made here; RLIMIT_NPROC is not
    enforced for root): LoaderStartError naming the cgroup and its
    pids.max, no child left, and a 2-worker loader then works."""
    base = "/sys/fs/cgroup/pids"
    if not os.access(base, os.W_OK) and not os.path.isdir(base):
        pytest.skip(f"no pids cgroup (v1) at {base} to set a limit in")
    cgroup = f"{base}/shmq-test-{os.getpid()}"
    try:
        os.mkdir(cgroup)
    except OSError as e:
        pytest.skip(f"cannot make a pids cgroup at {cgroup}: {e}")
    try:
        with open(f"{cgroup}/pids.max", "w") as f:
            f.write("12")

        def enter():
            with open(f"{cgroup}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        out = subprocess.run([sys.executable, "-c", PIDS_CHILD], capture_output=True, text=True,
                             timeout=120, preexec_fn=enter)
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        os.rmdir(cgroup)  # empty: the child and everything it forked are gone
    got = json.loads(out.stdout.splitlines()[-1])
    kind, text = got["outcome"]
    assert kind == "LoaderStartError", got
    assert "could not start its processes (" in text and " of 65 started)" in text, text
    assert f"the pids cgroup {cgroup} allows 12 (pids.max)" in text, text
    assert "Resource temporarily unavailable" in text and "fewer workers" in text
    assert got["children_after_error"] == [] and got["children_at_end"] == []
    assert got["small"] is True


BIG_CHILD = textwrap.dedent("""
    import json, resource, time, numpy as np
    from loader import ShmLoader
    N = 3 << 30
    class Big:
        def __len__(self): return 2
        def __getitem__(self, i):
            a = np.empty(N, np.uint8); a.fill(i + 1); return a
    seen = []
    with ShmLoader(Big(), batch_size=1, num_workers=1, timeout=200) as loader:
        for b in loader:
            v = int(b[0, 0])
            seen.append([list(b.shape), v, bool((b == v).all())])
            del b
    print(json.dumps({"seen": seen,
                      "main_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
""")


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def test_a_3_gib_single_sample_arrives_whole():
    """One sample of 3 GiB: it arrives whole (never SIGBUS, never the
    training process OOM-killed); the batch is a view of shared memory, so
    the training process holds only what it touches."""
    need = 12 << 30  # the worker's array, the slab, the collator's touch, headroom
    if _available_bytes() < need:
        pytest.skip(f"needs {need >> 30} GiB of available memory, "
                    f"{_available_bytes() >> 30} GiB here")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", BIG_CHILD], capture_output=True,
                         text=True, timeout=220)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["seen"] == [[[1, 3 << 30], 1, True], [[1, 3 << 30], 2, True]]
