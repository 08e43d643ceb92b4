"""ShmLoader(trace=PATH) and DataLoader(trace=PATH): the Chrome-trace /
Perfetto JSON of a run (issue 16; NOTE [ Trace records ] in loader/_trace.py).

Counts are asserted exactly against what the run did (the dataset records
which process loaded each sample) and against stats() of the same run.
Times: the trace and stats() read the same clock at the same moments, so
the loop's waits and an epoch's length agree within TIME_SLACK_S; the
workers' busy time (stats: the time they did not wait) and the trace's
load + write time differ by the bookkeeping between samples, bounded by
BUSY_SLACK."""

import json
import importlib.util
import os
import re
import signal
import time
from collections import Counter

import numpy as np
import pytest

import shmq
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
        self.log = shmq.shared_array(1 + 16 * n, np.int64)  # count, then a pid per load

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
        self.log[1 + shmq.atomic_add(self.log, 0, 1)] = os.getpid()
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
