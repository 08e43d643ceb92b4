"""Attacks at the machine's limits (issue 15): a worker SIGKILLed while
main re-matches FileDataset's pattern or is inside load_state_dict(), more
workers than the pids limit lets fork, one sample of 3 GiB."""

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
from loader.main.runs import Runs

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


def _dead(pid: int, within: float = 5.0) -> bool:
    """Wait until `pid` (a child of the loader, not ours to reap) is a zombie."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                return True
        time.sleep(0.01)
    return False


def _indices(batches) -> list:
    return np.concatenate(batches)[:, 0].tolist() if batches else []


@pytest.mark.parametrize("seed", [7, None], ids=["same-seed-workers-kept", "seed-from-state-restart"])
def test_worker_sigkilled_inside_load_state_dict(seed, monkeypatch):
    """A worker dies while main is inside load_state_dict() (in its first
    call into the running pool, Runs.end of the current run).  With the
    loader's own seed the workers are kept: load_state_dict returns at
    once and the next epoch reports the death (WorkerError naming the
    worker, its pid and SIGKILL).  A loader without a seed takes the
    state's, so load_state_dict shuts the pool down (the dead worker is
    reaped there) and the next iter() starts new workers and resumes
    exactly.  Either way a new loader given the same state yields exactly
    the rest of the epoch."""
    n, k = 203, 10

    def make(s):
        return ShmLoader(np.arange(n).reshape(-1, 1), batch_size=4, shuffle=True, seed=s,
                         num_workers=2, persistent_workers=True, timeout=30)
    with make(7) as ref:
        whole = _indices(list(ref))  # the uninterrupted epoch 1
    with make(7) as src:
        it = iter(src)
        head = _indices([next(it) for _ in range(k)])
        state = src.state_dict()
        del it
    assert head == whole[:4 * k]

    real_end = Runs.end
    killed = []

    def end_and_kill(self, run):
        if not killed:
            victim = self.session.worker_children()[0]
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(victim.pid)
            assert _dead(victim.pid)  # dead before load_state_dict goes on
        return real_end(self, run)

    loader = make(seed)
    try:
        it = iter(loader)
        next(it)  # the pool runs, part-way through an epoch
        monkeypatch.setattr(Runs, "end", end_and_kill)
        t0 = time.monotonic()
        loader.load_state_dict(state)
        assert time.monotonic() - t0 < 5.0
        monkeypatch.setattr(Runs, "end", real_end)
        assert killed
        t0 = time.monotonic()
        if seed is None:  # the state's seed: new workers
            assert loader._session is None
            rest = _indices(list(loader))
            assert killed[0] not in [c.pid for c in loader._session.worker_children()]
            assert head + rest == whole
        else:  # the same workers: the death is reported, and again, never a hang
            for _ in range(2):
                with pytest.raises(WorkerError, match=rf"worker 0 \(pid {killed[0]}\) was killed "
                                                      rf"by signal SIGKILL"):
                    list(loader)
                assert time.monotonic() - t0 < 5.0
                loader.load_state_dict(state)
    finally:
        loader.close()
    with make(seed) as fresh:
        fresh.load_state_dict(state)
        rest = _indices(list(fresh))
    assert head + rest == whole
    assert sorted(head + rest) == list(range(n))


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


@pytest.mark.alone  # its 12 GiB of headroom, not shared with the other xdist worker's test
def test_a_3_gib_single_sample_arrives_whole():
    """One sample of 3 GiB: it arrives whole (never SIGBUS, never the
    training process OOM-killed); the batch is a view of shared memory, so
    the training process holds only what it touches."""
    need = 12 << 30  # the worker's array, the slab, the batcher's touch, headroom
    if _available_bytes() < need:
        pytest.skip(f"needs {need >> 30} GiB of available memory, "
                    f"{_available_bytes() >> 30} GiB here")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", BIG_CHILD], capture_output=True,
                         text=True, timeout=220)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["seen"] == [[[1, 3 << 30], 1, True], [[1, 3 << 30], 2, True]]


# --- address space (issue 28, item 10) -----------------------------------------------------

RAM = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

UNDER_RLIMIT_AS = textwrap.dedent("""
    import json, os, resource, sys
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import numpy as np
    import loader.shared.spill
    from loader import ShmLoader
    if len(sys.argv) > 3:  # os.sysconf on a machine of that much RAM
        loader.shared.spill.ram_bytes = lambda: int(sys.argv[3])

    class Mixed:  # 20 MB of bytes a sample: its values travel in the spill heap
        def __len__(self): return 64
        def __getitem__(self, i):
            return {"x": np.full(1000, i, np.int64), "raw": bytes([i]) * (20 << 20)}

    def vm_kib(pid):
        with open(f"/proc/{pid}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmSize"))

    workers = {"auto": "auto"}.get(sys.argv[2], None) or int(sys.argv[2])
    kw = dict(max_workers=256) if workers == "auto" else {}
    cap = int(os.environ.get("CAP_BYTES", 256 << 20))
    try:
        with ShmLoader(Mixed(), batch_size=8, num_workers=workers, timeout=60,
                       memory_cap_bytes=cap, **kw) as ld:
            got = []
            for b in ld:
                assert all(r == bytes([i]) * (20 << 20) for i, r in zip(b["x"][:, 0], b["raw"]))
                got += b["x"][:, 0].tolist()
            sizes = [vm_kib(os.getpid())] + [vm_kib(p.pid) for p in ld._session.procs]
        print(json.dumps({"samples": got, "vm_kib": sizes}))
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
""")


def under_rlimit_as(limit: int, workers, ram: int | None = None, cap: int = 256 << 20) -> dict:
    args = [sys.executable, "-c", UNDER_RLIMIT_AS, str(limit), str(workers)]
    out = subprocess.run(args + ([str(ram)] if ram else []), capture_output=True, text=True,
                         timeout=100, env=dict(os.environ, CAP_BYTES=str(cap)))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("workers", [2, 8])
def test_the_loader_starts_and_spills_under_ulimit_v_of_twice_ram(workers):
    """repro_spill_address_space.py (a): the spill heap reserved a region as
    large as RAM per worker and one for the batcher, so ShmLoader could not
    start under `ulimit -v` = 2 x RAM, where torch's DataLoader runs.  Now
    each process maps what it uses: every process of the loader stays far
    under the limit while 1.3 GB of bytes go through the heap."""
    out = under_rlimit_as(2 * RAM, workers)
    assert out.get("samples") == list(range(64)), out
    # each process: the arena (256 MiB, mapped twice in main) and what it used of the
    # heap (a sample's 20 MB, doubled as mappings grow, a few times): not regions x RAM
    assert max(out["vm_kib"]) * 1024 < RAM // 2, out["vm_kib"]


def test_auto_workers_up_to_256_start_on_a_machine_of_512_gib():
    """repro_spill_address_space.py (b): with num_workers="auto" and 256
    workers at most, 257 regions as large as RAM passed the 128 TiB of user
    address space on machines of 480 GiB and more.  ram_bytes() reports
    512 GiB here."""
    out = under_rlimit_as(-1, "auto", ram=512 << 30)
    assert out.get("samples") == list(range(64)), out


def test_too_little_address_space_names_ulimit_v_and_memory_cap_bytes():
    """Under an address-space limit the batch memory cannot be mapped in:
    LoaderStartError names `ulimit -v` and memory_cap_bytes, not `ulimit -n`
    or `-u` (which it named before)."""
    out = under_rlimit_as(4 << 30, 2, cap=8 << 30)
    error = out.get("error", "")
    assert error.startswith("LoaderStartError") and "`ulimit -v` (RLIMIT_AS) is 4294967296 bytes" \
        in error and "memory_cap_bytes" in error and "ulimit -n" not in error, out


def test_a_message_past_the_address_space_names_ulimit_v():
    """Enough address space to start, not enough to map a batch's 20 MB
    values a few times over: the error (the worker's, or main's as it opens
    the batch's values) names the spill heap and the limit."""
    out = under_rlimit_as(int(1.05 * (1 << 30)), 2)
    error = out.get("error", "")
    assert "MemoryError" in error and "spill heap" in error and "`ulimit -v`" in error, out
