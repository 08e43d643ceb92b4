"""Where W12's CPU goes, per sample, in each process of ShmLoader and of
PyTorch's DataLoader (issue 30); run by `python bench/cpu_breakdown.py
--profile [--seconds 8] [--out DIR]`.

Five views of the same loaders, W12 (token windows, batch 32, 2 workers), as
bench/cpu_breakdown.md reports them:

0. The worker's steps alone, in one process (thread CPU per call).
1. Thread CPU per step in every process (cpu_ledger.py: timers wrapped
   around the steps, in the benchmark): the breakdown that holds on a
   loaded machine.
2. py-spy samples of every process over whole epochs (--nonblocking, so
   the processes are never stopped), put in categories by the frames they
   hold (worker_category, torch_worker_category; by_function for the
   rest); a share times the process's CPU per sample (/proc) is its us per
   sample.  py-spy counts a thread that is ready to run but waiting for a
   CPU as active: on a loaded machine, steps after which a thread is
   preempted (a wake-up of another process) look bigger than they are.
3. System calls per sample of each process: `strace -c` attached for one
   epoch.  strace slows every call, so the futex counts (how often a
   process waits or wakes another) grow with it; the others do not.
4. Python calls per sample: cProfile in every worker and the batcher
   (their run() wrapped here, before the loader forks them: the loader's
   code is unchanged) and around main's loop, written at exit.

Needs py-spy (pip install py-spy) and strace (apt-get install strace);
a view whose tool is missing is skipped and says so.
"""

from __future__ import annotations

import collections
import cProfile
import glob
import linecache
import os
import pstats
import shutil
import signal
import subprocess
import tempfile
import time

from cpu_breakdown import (OURS, TORCH, UNSEEDED, MachineWindow, Tasks, close, make_loaders,
                           tasks_of, timed_epoch, workload)
from report import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- categories ------------------------------------------------------------------------------

def _frame(text: str) -> tuple[str, str, int]:
    """py-spy's "function (file:line)" -> (function, file, line)."""
    name, _, where = text.rpartition(" (")
    file, _, line = where.rstrip(")").rpartition(":")
    return name, file, int(line) if line.isdigit() else 0


def _source(file: str, line: int) -> str:
    for base in (REPO, os.path.join(REPO, "bench")):
        path = os.path.join(base, file)
        if os.path.exists(path):
            return linecache.getline(path, line)
    return ""


def _is_loader(file: str) -> bool:
    return file.startswith("loader/") or file.startswith("shmq/")


def _short(name: str) -> str:
    return name.rpartition(".")[2]  # py-spy names methods Class.method


def _in_dataset(frames) -> bool:
    return any(f[1].endswith("realistic.py") and _short(f[0]) in ("__getitem__", "_tokens")
               for f in frames)


def worker_category(frames) -> str:
    """A ShmLoader worker's stack (root first) -> what it was doing."""
    if _in_dataset(frames):
        return "dataset.__getitem__ (the user's code, numpy)"
    names = {_short(f[0]) for f in frames}
    if "__call__" in names and any(f[1].endswith("seeding.py") for f in frames):
        return "per-sample seeding (reproducible=True)"
    if names & {"send", "filled", "row_values", "request_layout", "done"}:
        return "signal the batcher (ring put + bell)"
    if names & {"until", "wait_for_entry", "_wait_for_run"}:
        return "wait (bell), busy part"
    inner = [f for f in frames if _is_loader(f[1])]
    if not inner:
        return "other"
    name, file, line = inner[-1]
    text = _source(file, line)
    if "place(" in text:
        return "row write (RowWriter.place, compiled)"
    if any(k in text for k in ("claim(", "below_limit", "_may_claim", "_wait_to_load",
                               "index_of(")) or _short(name) in ("_may_claim", "_wait_to_load"):
        return "claim a position (CURSOR, LIMIT, order)"
    return "worker loop (Python between the calls)"


def torch_worker_category(frames) -> str:
    """A PyTorch worker's stack (any of its threads) -> what it was doing."""
    if _in_dataset(frames):
        return "dataset.__getitem__ (the user's code, numpy)"
    files = [f[1] for f in frames]
    names = [_short(f[0]) for f in frames]
    if any("collate" in f for f in files):
        return "default_collate (torch.stack into shared memory)"
    if any(n in ("_feed", "dumps", "reduce_storage", "reduce_tensor") for n in names) or \
            any("multiprocessing/reductions" in f for f in files):
        return "send the batch (pickle, share the storage, pipe write)"
    if any(n == "get" for n in names) and any(f.endswith("/queues" + ".py") for f in files):
        return "index queue get (pipe read, unpickle)"
    if any(n == "put" for n in names):
        return "result queue put"
    if any("fetch.py" in f for f in files):
        return "fetcher (Python between the calls)"
    return "worker loop (Python between the calls)"


def by_function(frames) -> str:
    """The innermost frame of the loader, torch or the dataset: file:function."""
    for name, file, _ in reversed(frames):
        if _is_loader(file) or "torch/" in file or file.endswith("realistic.py"):
            return f"{file}:{name}"
    name, file, _ = frames[-1] if frames else ("?", "?", 0)
    return f"{file}:{name}"


# --- py-spy -------------------------------------------------------------------------------------

def read_raw(path: str) -> list[tuple[list, int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            frames_text, _, count = line.rpartition(" ")
            frames = [_frame(t) for t in frames_text.split(";")]
            stacks.append((frames, int(count)))
    return stacks


def shares(stacks, categorize) -> dict[str, float]:
    counts, total = collections.Counter(), 0
    for frames, n in stacks:
        cat = categorize(frames)
        if cat is None:
            continue
        counts[cat] += n
        total += n
    return {k: v / total for k, v in counts.most_common()} if total else {}


def _roles(tasks: Tasks) -> dict[str, list[int]]:
    roles = {"worker": tasks.workers, "main": [os.getpid()]}
    if tasks.batcher:
        roles["batcher"] = tasks.batcher
    return roles


def pyspy_window(loader, tasks: Tasks, roles, seconds: float, out: str):
    """py-spy on every process of roles while the loader runs whole epochs
    for about `seconds`; the raw files and the epochs timed meanwhile."""
    procs, files = [], {}
    for role, pids in roles.items():
        for pid in pids:
            path = os.path.join(out, f"{role}-{pid}.txt")
            cmd = ["py-spy", "record", "-p", str(pid), "-r", "250", "-f",
                   "raw", "-o", path, "-d", str(max(1, int(seconds)))]
            cmd.append("--nonblocking")
            with open(path + ".log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            files.setdefault(role, []).append(path)
    epochs, end = [], time.monotonic() + seconds
    time.sleep(0.3)  # py-spy attached
    while time.monotonic() < end:
        epochs.append(timed_epoch(loader, tasks))
    for p in procs:
        try:
            p.wait(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return files, epochs


# --- strace -------------------------------------------------------------------------------------

def strace_counts(loader, roles, out: str) -> tuple[dict, int]:
    """role -> {syscall: calls}, over one epoch of `samples` samples."""
    procs, paths = [], {}
    for role, pids in roles.items():
        path = os.path.join(out, f"strace-{role}.txt")
        # main: its training thread only; a child: all its threads
        cmd = ["strace", "-c", "-o", path] + ([] if role == "main" else ["-f"])
        for pid in pids:
            cmd += ["-p", str(pid)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        paths[role] = path
    time.sleep(1.0)  # attached
    batches = 0
    for b in loader:  # nothing else in main's thread meanwhile (no /proc reads)
        batches += 1
        del b
    time.sleep(0.5)  # the children's work ahead for the next epoch, as an epoch's worth
    for p in procs:
        p.send_signal(signal.SIGINT)  # detach and write the summary
    for p in procs:
        p.wait(timeout=30)
    counts = {}
    for role, path in paths.items():
        calls = {}
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                    # % time, seconds, usecs/call, calls, [errors,] syscall
                    calls[parts[-1]] = int(parts[3])
        counts[role] = calls
    return counts, batches


# --- cProfile in the children -------------------------------------------------------------------

def _profiled(run, out: str, role: str):
    def wrapper(self, *args, **kwargs):
        profile = cProfile.Profile()
        profile.enable()
        try:
            return run(self, *args, **kwargs)
        finally:
            profile.disable()
            profile.dump_stats(os.path.join(out, f"{role}-{os.getpid()}.prof"))
    return wrapper


class ProfiledChildren:
    """While it is entered, workers and batchers forked (ShmLoader's) or
    started (PyTorch's) run under cProfile and write OUT/ROLE-PID.prof at
    their end: a wrapper set here, in the benchmark, before the fork."""

    def __init__(self, out: str):
        self.out = out

    def __enter__(self):
        import torch.utils.data._utils.worker as torch_worker

        from loader.batcher.batcher import Batcher
        from loader.worker.worker import Worker

        self.saved = [(Worker, "run", Worker.run), (Batcher, "run", Batcher.run),
                      (torch_worker, "_worker_loop", torch_worker._worker_loop)]
        Worker.run = _profiled(Worker.run, self.out, "worker")
        Batcher.run = _profiled(Batcher.run, self.out, "batcher")
        loop = torch_worker._worker_loop

        def torch_loop(*args, **kwargs):
            return _profiled(lambda _self, *a, **k: loop(*a, **k), self.out, "torchworker")(
                None, *args, **kwargs)

        torch_worker._worker_loop = torch_loop
        return self

    def __exit__(self, *exc):
        for owner, name, value in self.saved:
            setattr(owner, name, value)


def top_calls(paths, samples: int, n: int = 12) -> list[tuple[str, float, float]]:
    """(function, calls per sample, own us per sample) of the dumps, by own time."""
    stats = pstats.Stats(*paths)
    rows = []
    for (file, line, name), (cc, ncalls, tt, ct, callers) in stats.stats.items():
        where = file.replace(REPO + "/", "")
        rows.append((f"{where}:{line}:{name}", ncalls / samples, tt / samples * 1e6))
    rows.sort(key=lambda r: -r[2])
    return rows[:n]


# --- the report ---------------------------------------------------------------------------------

def _cpu_us(epochs, role_usage_key, samples_per_epoch) -> float:
    cpu = sum(e.usage[role_usage_key].cpu_s for e in epochs)
    return cpu / (samples_per_epoch * len(epochs)) * 1e6


def _print_shares(title: str, share: dict, us_per_sample: float, per: str = "sample") -> None:
    print(f"  {title}: {us_per_sample:.1f} us per {per} in all")
    for cat, s in share.items():
        print(f"    {cat:<58} {s:>6.1%} {s * us_per_sample:>8.2f} us")


def profile_loader(kind: str, w, seconds: float, out: str) -> None:
    make = make_loaders(w)[kind]
    samples = w.batches * w.batch_size
    loader = make()
    try:
        timed_epoch(loader, Tasks(known_threads=lambda: ()))  # warm-up
        tasks = tasks_of(kind, loader, lambda: ())
        roles = _roles(tasks)
        if shutil.which("py-spy"):
            with MachineWindow() as window:
                files, epochs = pyspy_window(loader, tasks, roles, seconds, out)
            print(f"\n{kind}, W12, py-spy (stacks of threads running or ready to run), {len(epochs)} epochs of {samples} "
                  f"samples; {window.describe()}")
            cats = {"worker": torch_worker_category if kind == TORCH else worker_category,
                    "batcher": by_function, "main": by_function}
            per_batch = {"batcher", "main"}
            for role, paths in files.items():
                stacks = [s for p in paths if os.path.exists(p) for s in read_raw(p)]
                key = "main thread" if role == "main" else role
                us = _cpu_us(epochs, key, samples)
                if role in per_batch:
                    _print_shares(f"{role} ({len(paths)} process), by function", shares(
                        stacks, cats[role]), us * w.batch_size, per="batch")
                else:
                    _print_shares(f"{role}s ({len(paths)} processes)", shares(stacks, cats[role]),
                                  us)
                    _print_shares(f"{role}s, by function", dict(list(shares(
                        stacks, by_function).items())[:10]), us)
        else:
            print(f"\n{kind}: py-spy not found (pip install py-spy): no stacks")
        if shutil.which("strace"):
            counts, batches = strace_counts(loader, roles, out)
            n = batches * w.batch_size
            print(f"  system calls per sample, one epoch under strace -c ({n} samples):")
            for role, calls in counts.items():
                top = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
                total = sum(calls.values())
                print(f"    {role:<8} {total / n:>7.3f} in all: " + ", ".join(
                    f"{name} {c / n:.3f}" for name, c in top))
        else:
            print("  strace not found (apt-get install strace): no system call counts")
    finally:
        close(loader)


def cprofile_loader(kind: str, w, out: str, epochs: int = 3) -> None:
    samples = w.batches * w.batch_size
    with ProfiledChildren(out):
        loader = make_loaders(w)[kind]()
        try:
            timed_epoch(loader, Tasks(known_threads=lambda: ()))
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(epochs):
                for b in loader:
                    del b
            profile.disable()
        finally:
            close(loader)
    main_path = os.path.join(out, f"main-{kind.split()[0]}.prof")
    profile.dump_stats(main_path)
    n = samples * (epochs + 1)  # the children's dumps hold the warm-up epoch too
    prefixes = ("torchworker",) if kind == TORCH else ("worker", "batcher")
    print(f"\n{kind}, W12, cProfile (its overhead inflates every figure; the calls per sample "
          f"are exact): top functions by own time")
    for prefix in prefixes:
        paths = glob.glob(os.path.join(out, f"{prefix}-*.prof"))
        if not paths:
            print(f"  {prefix}: no profile written")
            continue
        print(f"  {prefix}s ({len(paths)}): function, calls per sample, own us per sample")
        for name, calls, us in top_calls(paths, n):
            print(f"    {name[-70:]:<70} {calls:>7.3f} {us:>8.2f}")
        for p in paths:
            os.remove(p)
    print("  main: function, calls per sample, own us per sample")
    for name, calls, us in top_calls([main_path], samples * epochs):
        print(f"    {name[-70:]:<70} {calls:>7.3f} {us:>8.2f}")


def _us_per_call(fn, n: int = 20000) -> float:
    """Thread CPU per call (a loaded machine's run-queue waits left out)."""
    fn(0)
    t0 = time.thread_time()
    for i in range(n):
        fn(i)
    return (time.thread_time() - t0) / n * 1e6


def components(w) -> None:
    """The worker's per-sample steps one at a time, in this process, warm:
    what each costs without the others around it."""
    import numpy as np

    import shmq
    from loader._native import Bell, RunCounters
    from loader.order import indices as _order
    from loader.shared import control as _control

    ds, n = w.dataset, len(w.dataset)
    ctl = np.zeros(_control.CTL_WORDS, np.int64)
    run = 1
    ctl[_control.word(run, _control.CURSOR)] = run << _control.RUN_SHIFT
    ctl[_control.word(run, _control.LIMIT)] = 1 << 30
    counters = RunCounters(ctl, _control.RUN_LAYOUT)
    batches = _order.Batches(n, w.batch_size)
    order = _order.index_getter(None)
    bell = Bell(np.zeros(4, np.int32), 0)
    ring_words = shmq.shared_array(16, np.int64)
    x, y = ds[0]
    row = np.empty((2, x.size), np.int64)
    rng = np.random.default_rng(0).integers(0, n, 1 << 16)
    steps = {
        "dataset[i] (TokenWindows.__getitem__)": lambda i: ds[int(rng[i & 0xFFFF])],
        "claim: counters.claim + below_limit": lambda i: counters.below_limit(run,
                                                                          counters.claim(run)),
        "order and batch: index_of(pos) + batches.locate": lambda i: (order(i),
                                                                     batches.locate(i)),
        "two 8 KB row copies (np.copyto, for scale)": lambda i: (np.copyto(row[0], x),
                                                                 np.copyto(row[1], y)),
        "bell.ring() with no sleeper": lambda i: bell.ring(),
        "shmq.atomic_load of a shared word": lambda i: shmq.atomic_load(ring_words, 0),
    }
    from loader.shared import messages as _protocol
    from loader.shared.spill import SpillHeap, SpillWriter

    ring = shmq.Queue(1 << 20, multi_producer=True, anonymous=True)
    heap = SpillHeap(2)
    spill = SpillWriter(heap, 0)
    filled = _protocol.Filled(run=1, batch=3)

    def put_get(i):
        spill.put(ring, filled)
        ring.get(timeout=0)

    def empty_get(i):
        try:
            ring.get(timeout=0)
        except shmq.Empty:
            pass

    steps["a Filled message: SpillWriter.put + ring.get (MPSC ring)"] = put_get
    steps["ring.get(timeout=0) of an empty ring (raises Empty)"] = empty_get
    print(f"\nW12 worker steps alone, in one process (thread CPU us per call, warm; load average "
          f"{os.getloadavg()[0]:.1f}):")
    for name, fn in steps.items():
        ctl[_control.word(run, _control.CURSOR)] = run << _control.RUN_SHIFT
        print(f"    {name:<58} {min(_us_per_call(fn) for _ in range(3)):>8.2f}")
    ring.close()
    heap.close()


def ledger_loader(kind: str, w, out: str, epochs: int = 3) -> None:
    """CPU per step in each process (cpu_ledger.py) over `epochs` epochs
    after a warm-up one: ShmLoader's children count from the second run
    on (their timers restart then), PyTorch's from their start."""
    import cpu_ledger

    samples = w.batches * w.batch_size
    with cpu_ledger.Ledgers(out):
        loader = make_loaders(w)[kind]()
        try:
            timed_epoch(loader, Tasks(known_threads=lambda: ()))
            main_ledger = cpu_ledger.MainLedger()
            with MachineWindow() as window:
                batches = sum(main_ledger.epoch(loader) for _ in range(epochs))
            main_data = main_ledger.close()
        finally:
            close(loader)
    child_epochs = epochs if kind != TORCH else epochs + 1
    print(f"\n{kind}, W12, thread CPU per step ({epochs} epochs of {samples} samples; "
          f"{window.describe()}): us, calls")
    roles = [("torchworker", "workers, per sample", samples * child_epochs)] if kind == TORCH \
        else [("worker", "workers, per sample", samples * child_epochs),
              ("batcher", "batcher, per batch", batches)]
    for role, title, units in roles:
        ledgers = cpu_ledger.read(out, role)
        if not ledgers:
            print(f"  {title}: no ledger written")
            continue
        _print_steps(f"{title} ({len(ledgers)} process{'es' if len(ledgers) > 1 else ''})",
                     cpu_ledger.breakdown(ledgers, units))
    _print_steps("main, per batch", cpu_ledger.breakdown([main_data], batches))


def _print_steps(title: str, rows) -> None:
    total = sum(us for name, us, _ in rows if not name.startswith("(the timers"))
    print(f"  {title}: {total:.2f} us in all")
    for name, us, calls in rows:
        print(f"    {name:<64} {us:>8.2f} {calls:>7.3f}")


def main(args) -> None:
    out = args.out or tempfile.mkdtemp(prefix="shmq-cpu-profile-")
    os.makedirs(out, exist_ok=True)
    w = workload("W12", args.scale)
    print(f"{machine()}; {time.strftime('%Y-%m-%d %H:%M')}; W12: {w.title}; raw profiles in {out}")
    components(w)
    for kind in (OURS, UNSEEDED, TORCH):
        ledger_loader(kind, w, out)
    for kind in (OURS, UNSEEDED, TORCH):
        profile_loader(kind, w, args.seconds, out)
    for kind in (OURS, UNSEEDED, TORCH):
        cprofile_loader(kind, w, out)
