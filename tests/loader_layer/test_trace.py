"""ShmLoader(trace=PATH) and DataLoader(trace=PATH): the Chrome-trace /
Perfetto JSON of a run (issue 16; NOTE [ Trace records ] in loader/shared/trace.py).

Counts are asserted exactly against what the run did (the dataset records
which process loaded each sample) and against stats() of the same run.
Times: the trace and stats() read the same clock at the same moments, so
the loop's waits and an epoch's length agree within TIME_SLACK_S; the
workers' busy time (stats: the time they did not wait) and the trace's
load + write time differ by the bookkeeping between samples, bounded by
BUSY_SLACK."""

import errno as errno_module
import json
import importlib.util
import os
import re
import signal
import time
from collections import Counter

import numpy as np
import pytest

from shmq import sync
import loader
from loader import ShmLoader, WorkerError

pytestmark = pytest.mark.timeout(120)

TIME_SLACK_S = 0.005      # same clock, same moments: a few function calls apart
BUSY_SLACK = 0.25         # share of the workers' busy time not inside load/write events
EVENTS = {("load", "X"), ("write", "X"), ("batch", "b"), ("batch", "e"), ("run", "i"),
          ("slab pool", "C"), ("next()", "X"), ("epoch", "X"), ("process_name", "M"),
          ("thread_name", "M"), ("process_sort_index", "M")}


class Spin:
    """Sample i: 64 float64 holding i, after `work_s` of CPU; the pid of
    the process that loaded it is appended to a log in shared memory."""

    def __init__(self, n, work_s=0.0, kill_at=None):
        self.n, self.work_s, self.kill_at = n, work_s, kill_at
        self.log = sync.shared_array(1 + 16 * n, np.int64)  # count, then a pid per load

    def loads_by_pid(self) -> dict:
        pids, counts = np.unique(self.log[1:1 + self.log[0]], return_counts=True)
        return dict(zip(pids.tolist(), counts.tolist()))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:
            pass
        self.log[1 + sync.atomic_add(self.log, 0, 1)] = os.getpid()
        return np.full(64, i, np.float64)


def load_trace(path):
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in "XbeiCM", e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
    return doc, events


def named(events, name, ph="X"):
    return [e for e in events if e["name"] == name and e["ph"] == ph]


def run_epoch_map(events):
    return {e["args"]["run"]: e["args"]["epoch"] for e in named(events, "run", "i")}


def worker_pids(events):
    return {e["pid"] for e in events if e["name"] == "thread_name"
            and e["args"]["name"].startswith("worker")}


def clipped(events, lo, hi):
    """Microseconds of the events inside [lo, hi]."""
    return sum(max(0.0, min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) for e in events)


def test_trace_adds_up_to_stats(tmp_path):
    path = tmp_path / "run.json"
    n, epochs = 240, 3
    ds = Spin(n, work_s=0.002)
    all_stats = []
    with ShmLoader(ds, batch_size=16, num_workers=2, shuffle=True, trace=path) as ld:
        for epoch in range(1, epochs + 1):
            got = np.concatenate([b[:, 0] for b in ld]).astype(np.int64)
            assert np.array_equal(np.sort(got), np.arange(n))
            all_stats.append(ld.stats())
        assert not path.exists()  # written at close(), not in the hot path
    doc, events = load_trace(path)
    assert {(e["name"], e["ph"]) for e in events} - {(f"epoch {i}", "i") for i in (1, 2, 3)} \
        == EVENTS
    assert doc["otherData"]["dropped_records"] == 0
    runs = run_epoch_map(events)
    loads, writes = named(events, "load"), named(events, "write")
    ends = {e["args"]["epoch"]: e for e in named(events, "epoch")}
    assert sorted(ends) == [1, 2, 3] and all(e["args"]["complete"] for e in ends.values())
    assert len(worker_pids(events)) == 2
    # every load, the next epoch's early ones included, by the process the dataset saw
    assert Counter(e["pid"] for e in loads) \
        == ds.loads_by_pid()
    for s in all_stats:
        epoch = s["epoch"]
        mine = [e for e in loads if e["args"]["epoch"] == epoch]
        # every sample loaded once, by the process the dataset saw
        assert sorted(e["args"]["index"] for e in mine) == list(range(n))
        assert sum(e["args"]["samples"] for e in mine) == n == s["samples"]
        assert sum(runs.get(e["args"]["run"]) == epoch for e in writes) == n
        batches = [e for e in named(events, "batch", "b") if e["args"]["epoch"] == epoch]
        assert len(batches) == s["batches"] == n // 16
        assert sum(e["args"]["rows"] for e in batches) == n
        # times: the epoch's span, the loop's waits (stats leaves out the
        # next() that raised StopIteration: it ends after the epoch) ...
        end = ends[epoch]
        assert abs(end["dur"] / 1e6 - s["seconds"]) <= TIME_SLACK_S, (end, s)
        lo, hi = end["ts"], end["ts"] + end["dur"]
        waits = [e for e in named(events, "next()") if e["args"]["epoch"] == epoch]
        assert len(waits) == s["batches"] + 1
        inside = sum(e["dur"] for e in waits if e["ts"] + e["dur"] <= hi) / 1e6
        assert abs(inside - s["loop_wait_seconds"]) <= TIME_SLACK_S, (inside, s)
        # ... and the workers' busy time: loads and writes (any epoch's: the
        # next one starts early) inside the epoch's span
        work = clipped([e for e in loads + writes if e["pid"] in worker_pids(events)], lo, hi)
        busy = s["workers_busy_share"] * (hi - lo) * s["workers"]
        assert busy * (1 - BUSY_SLACK) <= work <= busy * 1.02 + TIME_SLACK_S * 1e6, (work, busy)


def test_killed_worker_keeps_its_records_and_the_file_parses(tmp_path):
    path = tmp_path / "killed.json"
    ds = Spin(200, kill_at=120)
    ld = ShmLoader(ds, batch_size=10, num_workers=2, trace=str(path))
    seen = 0
    with pytest.raises(WorkerError, match="SIGKILL|signal 9|killed") as err:
        for batch in ld:
            seen += len(batch)
    ld.close()
    dead = int(re.search(r"pid (\d+)\) was killed", str(err.value)).group(1))
    _, events = load_trace(path)
    loads = named(events, "load")
    indices = [e["args"]["index"] for e in loads]
    assert 120 not in indices  # the sample it died in never completed
    assert len(indices) == len(set(indices)) >= seen
    # both workers wrote records up to the end; the dead one's included
    assert {e["pid"] for e in loads} == worker_pids(events)
    assert sum(e["pid"] == dead for e in loads) > 0  # the dead worker's records are kept
    assert Counter(e["pid"] for e in loads) \
        == ds.loads_by_pid()


def test_restarted_workers_each_epoch(tmp_path):
    """persistent_workers=False: new worker processes every epoch, one trace."""
    path = tmp_path / "restarts.json"
    n = 64
    ds = Spin(n)
    with ShmLoader(ds, batch_size=8, num_workers=2, persistent_workers=False,
                   trace=path) as ld:
        for epoch in (1, 2):
            assert sum(len(b) for b in ld) == n
    _, events = load_trace(path)
    pids = worker_pids(events)
    assert len(pids) == 4  # two per epoch
    loads = named(events, "load")
    for epoch in (1, 2):
        mine = [e for e in loads if e["args"]["epoch"] == epoch]
        assert sorted(e["args"]["index"] for e in mine) == list(range(n))
        assert len({e["pid"] for e in mine}) <= 2
    assert Counter(e["pid"] for e in loads) == ds.loads_by_pid()
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert sum(x.startswith("ShmLoader worker") for x in names) == 4


def test_thread_workers_and_no_workers(tmp_path):
    n = 48
    for mode, workers in (("thread", 2), ("process", 0)):
        path = tmp_path / f"{mode}{workers}.json"
        with ShmLoader(Spin(n), batch_size=8, num_workers=workers, worker_mode=mode,
                       trace=path) as ld:
            assert sum(len(b) for b in ld) == n
            s = ld.stats()
        _, events = load_trace(path)
        waits = named(events, "next()")
        assert len(waits) == s["batches"] + 1 == n // 8 + 1
        assert len(named(events, "epoch")) == 1
        if workers:
            loads = named(events, "load")  # (and epoch 2's first ones: loaded ahead)
            assert sorted(e["args"]["index"] for e in loads if e["args"]["epoch"] == 1) \
                == list(range(n))
            assert len({e["tid"] for e in loads}) <= 2 and {e["pid"] for e in loads} == \
                {os.getpid()}


def test_dataloader_trace_with_getitems(tmp_path):
    pytest.importorskip("torch")

    class Batched(Spin):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    path = tmp_path / "dl.json"
    n = 96
    dl = loader.DataLoader(Batched(n), batch_size=12, num_workers=2, trace=path)
    assert sum(len(b) for b in dl) == n
    dl.close()
    _, events = load_trace(path)
    loads = named(events, "load")
    assert len(loads) == n // 12  # one __getitems__ call per batch
    assert all("index" not in e["args"] for e in loads)
    assert sorted(e["args"]["position"] for e in loads) == list(range(0, n, 12))
    assert sum(e["args"]["samples"] for e in loads) == n
    assert len(named(events, "write")) == n
    assert len(named(events, "batch", "b")) == n // 12


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("in_order", [True, False])
def test_values_that_do_not_apply_are_left_out_never_minus_one(tmp_path, mode, in_order):
    """A collate_fn's batch in first-ready mode (known only once placed)
    and an epoch left early's sample count do not apply: the records say
    None, the JSON leaves the key out; no arg is ever -1."""
    n, rows = 96, 8
    path = tmp_path / "t.json"
    with ShmLoader(Spin(n), batch_size=rows, num_workers=2, worker_mode=mode,
                   collate_fn=np.stack, in_order=in_order, trace=path) as ld:
        for k, _ in enumerate(ld):
            if k == 2:
                break  # epoch 1 left early, after 3 batches
        assert sum(len(b) for b in ld) == n  # epoch 2 whole
        s = ld.stats()
    _, events = load_trace(path)
    assert all(v != -1 for e in events for v in e.get("args", {}).values()), events
    collates = [e for e in named(events, "collate") if e["args"]["run"] == 2]
    assert sum(e["args"]["samples"] for e in collates) == n and len(collates) == n // rows
    if in_order:
        assert sorted(e["args"]["batch"] for e in collates) == list(range(n // rows))
    else:
        assert all("batch" not in e["args"] for e in collates)
    epochs = {e["args"]["epoch"]: e["args"] for e in named(events, "epoch")}
    assert epochs[1] == {"epoch": 1, "batches": 3, "complete": False}
    assert epochs[2] == {"epoch": 2, "batches": n // rows, "samples": s["samples"],
                         "complete": True}


def test_bad_trace_paths_fail_at_construction(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "t.json"
    with pytest.raises(FileNotFoundError, match=str(missing.parent)):
        ShmLoader(Spin(8), trace=missing)
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        ShmLoader(Spin(8), trace=tmp_path)
    with pytest.raises(PermissionError, match="/sys"):  # read-only even for root
        ShmLoader(Spin(8), trace="/sys/trace.json")
    with pytest.raises(TypeError, match="trace must be a path"):
        ShmLoader(Spin(8), trace=3)
    if importlib.util.find_spec("torch") is not None:  # (loader.DataLoader needs torch)
        with pytest.raises(FileNotFoundError, match=str(missing.parent)):
            loader.DataLoader(Spin(8), trace=missing)
    assert os.listdir(tmp_path) == []  # the probe left nothing


def test_iterable_dataset_streams_are_traced(tmp_path):
    class Stream:
        def __iter__(self):
            w = loader.get_worker_info().id
            for k in range(60):
                yield np.array([w, k])

    path = tmp_path / "stream.json"
    with ShmLoader(Stream(), batch_size=8, num_workers=2, trace=path) as ld:
        for _ in range(2):
            assert sum(len(b) for b in ld) == 120
            s = ld.stats()
    _, events = load_trace(path)
    runs = run_epoch_map(events)
    for epoch in (1, 2):
        loads = [e for e in named(events, "load") if e["args"]["epoch"] == epoch]
        assert len(loads) == 120 and all("index" not in e["args"] for e in loads)
        for pid in worker_pids(events):  # each worker's stream, numbered from 0
            assert sorted(e["args"]["position"] for e in loads if e["pid"] == pid) \
                == list(range(60))
        assert sum(runs.get(e["args"]["run"]) == epoch for e in named(events, "write")) == 120
        assert sum(e["args"]["epoch"] == epoch for e in named(events, "batch", "b")) \
            == s["batches"] == 16


# --- where the file is written (issue 28, items 8 and 12) ----------------------------------

MODES = [("process", 2), ("thread", 2), ("process", 0), ("dataloader", 2)]


def traced_loader(ds, mode, workers, path, batch_size=8):
    """(loader, close): ShmLoader in a worker mode, or loader.DataLoader."""
    if mode == "dataloader":
        pytest.importorskip("torch")
        dl = loader.DataLoader(ds, batch_size=batch_size, num_workers=workers, trace=path)
        return dl, dl.close
    ld = ShmLoader(ds, batch_size=batch_size, num_workers=workers, worker_mode=mode, trace=path)
    return ld, ld.close


def epoch_loads(path, epoch=1) -> list:
    _, events = load_trace(path)
    return sorted(e["args"]["index"] for e in named(events, "load") if e["args"]["epoch"] == epoch)


def assert_whole_trace(path, n, workers, batch_size=8):
    """The trace of one epoch of n samples, whole."""
    if workers:
        assert epoch_loads(path) == list(range(n))
    else:  # (no workers: the per-sample paths are not traced; the loop's waits are)
        waits = named(load_trace(path)[1], "next()")
        assert len([e for e in waits if e["args"]["epoch"] == 1]) == n // batch_size + 1


def _symlink_child(uid, target, link, conn):
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    os.symlink(target, link)
    conn.send(os.lstat(link).st_uid)


def plant_symlink(procs, target, link):
    """What another local user does in a directory it may write: a symlink
    at a name main will write (as uid 65534 when we are root; the test's
    own uid otherwise: O_NOFOLLOW does not care whose link it is)."""
    import multiprocessing as mp

    uid = 65534 if os.geteuid() == 0 else None
    recv, send = mp.Pipe(False)
    child = procs.fork(_symlink_child, uid, str(target), str(link), send)
    assert recv.poll(20), "the child planting the link sent nothing"
    owner = recv.recv()
    child.join(20)
    assert child.exitcode == 0 and owner == (os.geteuid() if uid is None else uid)


@pytest.fixture
def shared_dir():
    """A directory every local user may write, without the sticky bit (a
    project directory a group writes), where another uid can reach it."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="shmq-trace-shared-", dir="/tmp")
    os.chmod(path, 0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.parametrize("mode,workers", MODES)
def test_the_trace_never_writes_through_a_planted_symlink(procs, shared_dir, tmp_path, mode,
                                                            workers):
    """repro_trace_symlink_tmp.py: close() wrote the JSON to PATH.<pid>.tmp
    with a plain open(): a symlink another user planted there (or at PATH)
    made main overwrite the file it pointed to.  Now the file is created
    exclusively (O_EXCL | O_NOFOLLOW) under a random name, then renamed over
    PATH: the victims stay intact, PATH is a regular file with the whole
    trace, the planted links are left as they were, nothing else is left."""
    victim = tmp_path / "victim.cfg"
    victim.write_text("precious\n")
    os.chmod(victim, 0o600)
    path = os.path.join(shared_dir, "run.json")
    old_tmp = f"{path}.{os.getpid()}.tmp"  # the name close() used to write
    plant_symlink(procs, victim, old_tmp)  # before construction: its probe used the name too
    n = 96
    ld, close = traced_loader(Spin(n), mode, workers, path)
    assert sum(len(b) for b in ld) == n
    plant_symlink(procs, victim, path)  # and PATH itself
    close()
    assert victim.read_text() == "precious\n"
    assert os.path.isfile(path) and not os.path.islink(path)
    assert_whole_trace(path, n, workers)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # as a plain open() makes it
    assert sorted(os.listdir(shared_dir)) == sorted(["run.json", os.path.basename(old_tmp)])
    assert os.readlink(old_tmp) == str(victim)


def test_the_new_file_beside_the_trace_has_a_new_random_name(tmp_path):
    from loader.shared.trace import create_beside

    path = str(tmp_path / "run.json")
    made = set()
    for _ in range(20):
        fd, name = create_beside(path)
        os.close(fd)
        assert os.path.dirname(name) == str(tmp_path) and name.startswith(path + ".")
        assert re.fullmatch(re.escape(path) + r"\.[0-9a-f]{16}\.tmp", name)
        made.add(name)
    assert len(made) == 20 and f"{path}.{os.getpid()}.tmp" not in made
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(m) for m in made)


def check_trace_write_error(info, path, errno_name: str, cause: str):
    err = info.value
    assert isinstance(err, loader.TraceWriteError) and isinstance(err, OSError)
    assert err.errno == getattr(errno_module, errno_name)
    text = str(err)
    assert f"ShmLoader: could not write the trace to {str(path)!r} ({cause}; " in text
    assert re.search(r"; \d+ bytes of JSON, \d+ records\): nothing was left at that path\. "
                     r"The workers are stopped and the records are kept: make room in ", text)
    assert text.endswith("(or fix the cause) and call close() again to write the trace")
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == err.errno


def running():
    """(child processes, threads) of this process now."""
    import threading

    from conftest import descendants

    return set(descendants()), threading.active_count()


def assert_stopped(before):
    """close() stopped every process and thread it started, even though it
    raised: what runs is what ran before the loader."""
    assert running() == before


@pytest.mark.parametrize("mode,workers", MODES)
def test_a_trace_directory_gone_at_close_is_a_trace_write_error_and_close_again_writes_it(
        tmp_path, mode, workers):
    """The same failure path as a full disk, for any uid: the directory is
    removed before close()."""
    import shutil

    folder = tmp_path / "traces"
    folder.mkdir()
    path = folder / "run.json"
    n = 80
    before = running()
    ld, close = traced_loader(Spin(n), mode, workers, path)
    assert sum(len(b) for b in ld) == n
    shutil.rmtree(folder)
    with pytest.raises(loader.TraceWriteError) as info:
        close()
    check_trace_write_error(info, path, "ENOENT", "No such file or directory")
    assert_stopped(before)
    folder.mkdir()
    close()
    assert_whole_trace(path, n, workers)
    assert os.listdir(folder) == ["run.json"]
    before = path.read_bytes()
    close()  # written: a third close() leaves it alone
    assert path.read_bytes() == before


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 KiB file system, to fill up; unmounted at teardown."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs to fill up needs root and mount(8)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k,mode=0755", "tmpfs", str(mnt)],
                   check=True, timeout=30)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def grow(mnt):
    import subprocess

    subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True, timeout=30)


@pytest.mark.parametrize("mode,workers", MODES)
def test_a_full_disk_at_close_keeps_the_trace_for_a_second_close(small_tmpfs, mode, workers):
    """repro_trace_disk_full.py: the trace did not fit (an 8 KiB file
    system; 31 KB to 0.77 MB of JSON), close() raised a bare "[Errno 28] No
    space left on device" and a second close() wrote nothing.  Now:
    TraceWriteError naming the trace, PATH and the cause; every process
    stopped; nothing at PATH, no partial file anywhere; after room is
    made, close() again writes the whole trace."""
    path = small_tmpfs / "run.json"
    n = 2000
    before = running()
    ld, close = traced_loader(Spin(n), mode, workers, path)
    assert sum(len(b) for b in ld) == n
    with pytest.raises(loader.TraceWriteError) as info:
        close()
    check_trace_write_error(info, path, "ENOSPC", "No space left on device")
    assert_stopped(before)
    assert os.listdir(small_tmpfs) == []
    with pytest.raises(loader.TraceWriteError):
        close()  # still full: the same error, still nothing left
    assert os.listdir(small_tmpfs) == []
    grow(small_tmpfs)
    close()
    assert_whole_trace(path, n, workers)
    assert os.listdir(small_tmpfs) == ["run.json"]


def test_a_trace_that_failed_is_not_written_again_by_garbage_collection(small_tmpfs):
    """After close() raised, dropping the loader raises nothing more (the
    suite turns an exception in __del__ into a failure) and writes nothing;
    a loader never closed still writes its trace when collected."""
    import gc

    path = small_tmpfs / "run.json"
    ld = ShmLoader(Spin(2000), batch_size=8, num_workers=2, trace=path)
    assert sum(len(b) for b in ld) == 2000
    with pytest.raises(loader.TraceWriteError):
        ld.close()
    grow(small_tmpfs)
    del ld
    gc.collect()
    assert os.listdir(small_tmpfs) == []
    ld = ShmLoader(Spin(64), batch_size=8, num_workers=2, trace=path)
    assert sum(len(b) for b in ld) == 64
    del ld
    gc.collect()
    assert epoch_loads(path) == list(range(64))
