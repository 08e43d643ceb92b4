"""Thread-CPU timers around the steps of each process of a loader, for
cpu_profile.py (issue 30): microseconds of CPU per sample, step by step,
that a sampling profiler cannot give on a loaded machine (py-spy counts a
thread waiting in the run queue as busy).

While a Ledgers context is entered, the loaders made inside it have their
steps wrapped: in the benchmark, on the classes and functions, before the
loader forks (the loader's code is unchanged; nothing of this runs
otherwise).  Each wrapped call adds its thread CPU (CLOCK_THREAD_CPUTIME_ID,
so only time on a CPU counts) to its step; a wrapped step inside another is
subtracted from it in the report.  Each process writes DIR/ROLE-PID.json
when its loop ends, with what a timed call costs there (calibrated), so the
timers' own cost is reported apart.

ShmLoader worker: load (seeding, the rest is dataset[i]), claim a
position, the row write (RowWriter.place, less the messages it sends),
messages to the batcher (ring put + bell), waits; the rest of the loop is
the loop's own Python.  Batcher: taking a message (ring get + unpickle),
handling each kind, laying out ahead, BatchReady to main, sleeping.
Main (ShmLoader): receive (ring get + unpickle + waits), views over the
slab, the rest of next(), dropping the batch (leases released).
PyTorch worker: index queue get, dataset[i], collate, result queue put,
and its feeder thread (pickling the batch, sending the storage's fd);
main: getting the data (waits, unpickling, rebuilding the storage from
its fd), the rest of next().
"""

from __future__ import annotations

import collections
import gc
import glob
import json
import os
import threading
import time

clock = time.thread_time_ns


class Ledger:
    """One process's thread CPU per step (ns, each step's own: a timed
    step called inside another is taken out of the outer one) and calls."""

    def __init__(self):
        self.ns, self.calls = collections.Counter(), collections.Counter()
        self.start_ns = clock()
        self.nested = collections.Counter()  # step -> timed calls made inside it
        self.inner: list[list[int]] = []  # per open step: [CPU, calls] of the steps inside it
        self.extra: dict = {}

    def call(self, step: str, fn, *args, **kwargs):
        t0 = self.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.leave(step, t0)

    def enter(self) -> int:
        self.inner.append([0, 0])
        return clock()

    def leave(self, step: str, t0: int) -> None:
        elapsed = clock() - t0
        inner_ns, inner_calls = self.inner.pop()
        self.ns[step] += elapsed - inner_ns
        self.calls[step] += 1
        self.nested[step] += inner_calls
        if self.inner:
            self.inner[-1][0] += elapsed
            self.inner[-1][1] += 1 + inner_calls

    def watch_gc(self) -> None:
        """Python's garbage collections as steps of their own, taken out of
        the step that allocated when one ran."""
        started = []

        def callback(phase, info):
            if phase == "start":
                started.append(self.enter())
            elif started:
                self.leave(f"garbage collection, generation {info['generation']}", started.pop())
        gc.callbacks.append(callback)

    def timed(self, step: str, fn):
        def wrapper(*args, **kwargs):
            return self.call(step, fn, *args, **kwargs)
        return wrapper

    def reset(self) -> None:
        """From now on only (a run's start-up left out)."""
        self.ns.clear()
        self.calls.clear()
        self.nested.clear()
        self.start_ns = clock()

    def dump(self, out: str, role: str) -> None:
        self.ns["(thread total)"] = clock() - self.start_ns
        data = {**self.figures(), **self.extra}
        with open(os.path.join(out, f"{role}-{os.getpid()}.json"), "w") as f:
            json.dump(data, f)


    def figures(self) -> dict:
        timer_ns, inside_ns = timer_cost_ns()
        return {"ns": dict(self.ns), "calls": dict(self.calls), "nested": dict(self.nested),
                "timer_ns": timer_ns, "inside_ns": inside_ns}


def timer_cost_ns(n: int = 20000) -> tuple[float, float]:
    """A timed call of nothing, here: its whole CPU (the timers' cost), and
    the part of it its own step records (taken out of every step)."""
    scratch = Ledger()
    nothing = scratch.timed("x", lambda: None)
    t0 = clock()
    for _ in range(n):
        nothing()
    return (clock() - t0) / n, scratch.ns["x"] / n


class _Proxy:
    """An object whose named methods are timed (a compiled class's
    methods cannot be replaced on the class)."""

    def __init__(self, target, ledger: Ledger, steps: dict):
        self._target = target
        for name, step in steps.items():
            setattr(self, name, ledger.timed(step, getattr(target, name)))

    def __getattr__(self, name):
        return getattr(self._target, name)


_ledger: Ledger | None = None   # this process's, once its loop started


def _current() -> Ledger:
    return _ledger


def _patch(owner, name, make):
    saved = getattr(owner, name)
    setattr(owner, name, make(saved))
    return owner, name, saved


class Ledgers:
    """Timers in every process of the loaders made while entered; each
    writes OUT/ROLE-PID.json at the end of its loop."""

    def __init__(self, out: str):
        self.out = out

    def __enter__(self):
        import multiprocessing.queues as mpq

        import torch.utils.data._utils.collate as torch_collate
        import torch.utils.data._utils.fetch as torch_fetch
        import torch.utils.data._utils.worker as torch_worker

        from loader.batcher.batcher import Batcher
        from loader.main.session import Session
        from loader.worker.fetch import Fetcher
        from loader.worker.worker import Channel, Sleeper, Worker

        out = self.out

        def in_ledger(step):
            """A function timed in the process's ledger, if it has one."""
            def make(fn):
                def wrapper(*args, **kwargs):
                    ledger = _current()
                    if ledger is None:
                        return fn(*args, **kwargs)
                    return ledger.call(step, fn, *args, **kwargs)
                return wrapper
            return make

        def worker_run(run):
            def wrapper(self):
                global _ledger
                _ledger = ledger = Ledger()
                ledger.watch_gc()
                self.writer = _Proxy(self.writer, ledger, {"place": "row write (place)"})
                self.counters = _Proxy(self.counters, ledger, {"claim": "claim (CURSOR)",
                                                               "below_limit": "claim (LIMIT)"})
                try:
                    return run(self)
                finally:
                    ledger.dump(out, "worker")
            return wrapper

        def worker_start(start):
            def wrapper(self, run):
                start(self, run)
                if self.seeder is not None:
                    self.seeder = _ledger.timed("load: per-sample seeding", self.seeder)
                    self.fetcher.seeder = self.seeder
            return wrapper

        def position_loads(positions):
            """Each load(pos) a run's Fetcher.positions makes, timed."""
            def wrapper(self, epoch, index_of):
                return in_ledger("load (seeding + dataset[i])")(positions(self, epoch, index_of))
            return wrapper

        def worker_one_run(one_run):
            def wrapper(self, run):
                if run == 2:
                    _ledger.reset()  # the first run (start-up, first touches) left out
                return one_run(self, run)
            return wrapper

        def batcher_runs(look):
            def wrapper(self):
                before = self.known_run
                look(self)
                if before < 2 <= self.known_run:
                    _ledger.reset()
            return wrapper

        def batcher_run(run):
            def wrapper(self):
                global _ledger
                _ledger = ledger = Ledger()
                ledger.watch_gc()
                try:
                    return run(self)
                finally:
                    ledger.dump(out, "batcher")
            return wrapper

        def batcher_handle(handle):
            def wrapper(self, msg):
                return _current().call(f"handle {type(msg).__name__}", handle, self, msg)
            return wrapper

        def torch_loop(loop):
            def wrapper(*args, **kwargs):
                global _ledger
                _ledger = ledger = Ledger()
                ledger.watch_gc()
                try:
                    return loop(*args, **kwargs)
                finally:
                    feeders = [t for t in threading.enumerate() if t.name == "QueueFeederThread"]
                    ledger.extra["feeder_ns"] = sum(_thread_cpu_ns(t.native_id) for t in feeders)
                    ledger.dump(out, "torchworker")
            return wrapper

        self.saved = [
            _patch(Worker, "run", worker_run),
            _patch(Worker, "_start", worker_start),
            _patch(Worker, "_one_run", worker_one_run),
            _patch(Batcher, "_look_at_runs", batcher_runs),
            _patch(Fetcher, "positions", position_loads),
            _patch(Channel, "send", in_ledger("message to the batcher (ring put + bell)")),
            _patch(Sleeper, "until", in_ledger("waits (bell)")),
            _patch(Batcher, "run", batcher_run),
            _patch(Batcher, "_take", in_ledger("take a message (ring get + unpickle)")),
            _patch(Batcher, "_handle", batcher_handle),
            _patch(Batcher, "_sleep", in_ledger("sleep (bell wait, ready checks)")),
            _patch(Batcher, "_send", in_ledger("send to main (BatchReady...)")),
            _patch(Batcher, "_publish_ahead", in_ledger("lay out ahead (slab, table)")),
            _patch(Session, "receive", in_ledger("receive (ring get + unpickle + waits)")),
            _patch(Session, "batch", in_ledger("views over the slab (Session.batch)")),
            _patch(torch_worker, "_worker_loop", torch_loop),
            _patch(torch_fetch._MapDatasetFetcher, "fetch", in_ledger("fetch (dataset + collate)")),
            _patch(torch_collate, "default_collate", in_ledger("collate (torch.stack)")),
            _patch(mpq.Queue, "get", in_ledger("queue get (index queue; main: data)")),
            _patch(mpq.Queue, "put", in_ledger("queue put (result queue)")),
        ]
        return self

    def __exit__(self, *exc):
        for owner, name, saved in reversed(self.saved):
            setattr(owner, name, saved)


def _thread_cpu_ns(tid) -> int:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, TypeError):
        return 0


def _drop(box: list) -> None:
    box.pop()  # the loop's last reference, gone inside the timer


class MainLedger:
    """Main's steps over an epoch loop: next() and dropping the batch."""

    def __init__(self):
        global _ledger
        self.ledger = _ledger = Ledger()
        self.ledger.watch_gc()
        self.callback = gc.callbacks[-1]

    def epoch(self, loader) -> int:
        ledger, it, n = self.ledger, iter(loader), 0
        while True:
            try:
                box = [ledger.call("next()", next, it)]
            except StopIteration:
                break
            ledger.call("drop the batch (leases released)", _drop, box)
            n += 1
        return n

    def close(self) -> dict:
        global _ledger
        _ledger = None
        gc.callbacks.remove(self.callback)
        return self.ledger.figures()


def read(out: str, role: str) -> list[dict]:
    found = []
    for path in glob.glob(os.path.join(out, f"{role}-*.json")):
        with open(path) as f:
            found.append(json.load(f))
        os.remove(path)
    return found


RENAME = {"load (seeding + dataset[i])": "dataset[i] (the dataset's own code)",
          "row write (place)": "row write (RowWriter.place, compiled, less its messages)",
          "claim (CURSOR)": "claim a position (CURSOR compare-and-swap)",
          "claim (LIMIT)": "claim: check main's LIMIT",
          "fetch (dataset + collate)": "dataset[i] (the dataset's own code)",
          "next()": "the rest of next()"}


def breakdown(ledgers: list[dict], units: int) -> list[tuple[str, float, float]]:
    """(step, us per unit, calls per unit), each step's own CPU less what
    the timers add to it (what a timed call records of itself, and the
    rest of the cost of the timed calls inside it), the timers' whole cost
    apart, and the untimed rest of the thread's CPU as the loop's own
    Python."""
    own, calls = collections.Counter(), collections.Counter()
    timers, total, feeder = 0.0, 0, 0
    for d in ledgers:
        timer, inside = d["timer_ns"], d["inside_ns"]
        for step, ns in d["ns"].items():
            if step == "(thread total)":
                total += ns
                continue
            n = d["calls"][step]
            own[step] += ns - n * inside - d["nested"].get(step, 0) * (timer - inside)
            calls[step] += n
            timers += n * timer
        feeder += d.get("feeder_ns", 0)
    rows = [(RENAME.get(k, k), v / units / 1e3, calls[k] / units) for k, v in own.items()]
    if total:
        rows.append(("the loop's own Python (untimed rest)",
                     (total - sum(own.values()) - timers) / units / 1e3, 0.0))
    rows.append(("(the timers' own cost, left out)", timers / units / 1e3, 0.0))
    if feeder:
        rows.append(("feeder thread: pickle the batch, send its storage's fd", feeder / units / 1e3,
                     0.0))
    rows.sort(key=lambda r: -r[1])
    return rows
