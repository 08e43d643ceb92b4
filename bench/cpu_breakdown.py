"""CPU per sample, per process, of each loader (issue 30): what a sample
costs in the workers, the batcher and main, beside PyTorch's DataLoader
and an in-process loop, on the machine as found and beside a fixed
background load that this script starts itself.

    python bench/cpu_breakdown.py [--workloads W1,W11,W12,W13] [--repeats 3]
                                  [--conditions found,loaded] [--json PATH]
    python bench/cpu_breakdown.py --profile [--seconds 8]   # where W12's CPU goes (cpu_profile.py)

Loaders per workload: ShmLoader (process workers), ShmLoader with thread
workers, PyTorch's DataLoader (same workers, persistent, prefetch 2) and an
in-process loop (W12: nanoGPT's get_batch; the others: dataset[i] in a
loop and np.stack, the batch's str/bytes leaves as lists).  All of a
workload's loaders are alive at once; after a warm-up epoch each, every
condition runs `repeats` rounds of one epoch per loader in turn, so each
sees the same load; the median epoch of each is reported.

What is counted, per task (Linux /proc; a process is all its threads):
user and system CPU (/proc/PID/stat utime, stime: their sum is exact, the
split is the kernel's tick sampling), minor and major page faults (stat
minflt, majflt), voluntary and involuntary context switches (status,
summed over the threads).  Thread workers and main's thread are read
per thread (/proc/self/task/TID/...).  A child's counters are read from
the start of its epoch until it went idle after the end (its work for the
next epoch's first batches, done ahead, is an epoch's worth too).  Main:
the training thread over the epoch (its CPU per batch as time.thread_time
sees it), and main's other threads apart.

"loaded": BUSY_PER_CORE busy-looping processes per CPU, started by this
script for that condition and killed after it (each also dies with this
process: PR_SET_PDEATHSIG).  Every table names the CPU model, the load
average before and after, and the share of the machine's CPUs that were
busy meanwhile (/proc/stat).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from loader import ShmLoader  # noqa: E402
from report import machine  # noqa: E402

BUSY_PER_CORE = 2
OURS, THREADS, TORCH, INPROC = ("ShmLoader", "ShmLoader, thread workers", "PyTorch DataLoader",
                                "in-process loop")
UNSEEDED = "ShmLoader, reproducible=False"  # W12: seed= alone seeds 3 generators per sample


# --- counters -----------------------------------------------------------------------------

class Usage(NamedTuple):
    """What a task (a process with all its threads, or one thread) used.
    cpu_ns is exact (schedstat); user and system come from the kernel's
    tick sampling (stat utime, stime), so only their split is used."""
    cpu_ns: int = 0
    user_ticks: int = 0
    sys_ticks: int = 0
    minflt: int = 0
    majflt: int = 0
    vcsw: int = 0
    ivcsw: int = 0

    def plus(self, other: Usage) -> Usage:
        return Usage(*(a + b for a, b in zip(self, other)))

    def minus(self, other: Usage) -> Usage:
        return Usage(*(a - b for a, b in zip(self, other)))

    @property
    def cpu_s(self) -> float:
        return self.cpu_ns / 1e9

    @property
    def user_s(self) -> float:
        """The CPU time split as the ticks split it (all of it user time
        when no tick fell in the window)."""
        ticks = self.user_ticks + self.sys_ticks
        return self.cpu_s * (self.user_ticks / ticks if ticks > 0 else 1.0)

    @property
    def sys_s(self) -> float:
        return self.cpu_s - self.user_s


def _stat_fields(path: str) -> list[str]:
    with open(path) as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()  # [0] is field 3 (state) of proc(5)


def _thread_usage(base: str) -> Usage:
    """One thread, from its /proc/.../task/TID directory."""
    f = _stat_fields(f"{base}/stat")
    with open(f"{base}/schedstat") as s:
        cpu_ns = int(s.read().split()[0])
    v = iv = 0
    with open(f"{base}/status") as s:
        for line in s:
            if line.startswith("voluntary_ctxt_switches"):
                v = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                iv = int(line.split()[1])
    return Usage(cpu_ns, int(f[11]), int(f[12]), int(f[7]), int(f[9]), v, iv)


def _threads_usage(pid: int | str, tids) -> Usage:
    total = Usage()
    for tid in tids:
        try:
            total = total.plus(_thread_usage(f"/proc/{pid}/task/{tid}"))
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total


def process_usage(pid: int) -> Usage:
    """All of a process's live threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return Usage()
    return _threads_usage(pid, tids)


def thread_usage(tid: int) -> Usage:
    """One thread of this process."""
    return _threads_usage("self", [tid])


class Tasks:
    """A loader's tasks by role: "worker", "batcher" (processes or this
    process's threads), "main thread" (the training thread), "main, other
    threads" (this process's other threads, less every loader thread
    known: the thread workers of other loaders too)."""

    def __init__(self, workers=(), batcher=(), threads=False, known_threads=()):
        self.workers, self.batcher, self.threads = list(workers), list(batcher), threads
        self.known_threads = known_threads  # a callable: every loader thread alive
        self.main_tid = threading.get_native_id()

    def loading_cpu_ns(self) -> int:
        """CPU so far of the workers and the batcher."""
        return self._read(self.workers + self.batcher).cpu_ns

    def _read(self, ids) -> Usage:
        total = Usage()
        for i in ids:
            total = total.plus(thread_usage(i) if self.threads else process_usage(i))
        return total

    def main_snapshot(self) -> dict[str, Usage]:
        skip = {self.main_tid, *self.known_threads()}
        others = [t for t in os.listdir("/proc/self/task") if int(t) not in skip]
        return {"main thread": thread_usage(self.main_tid),
                "main, other threads": _threads_usage("self", others)}

    def loading_snapshot(self) -> dict[str, Usage]:
        return {"worker": self._read(self.workers), "batcher": self._read(self.batcher)}


def wait_idle(tasks: Tasks, quiet_ns=1_000_000, poll_s=0.03, most_s=2.0) -> None:
    """Until the loader's workers and batcher used under quiet_ns of CPU in
    one poll: the work they do ahead for the next epoch is counted with
    this one."""
    end, last = time.monotonic() + most_s, tasks.loading_cpu_ns()
    while time.monotonic() < end:
        time.sleep(poll_s)
        now = tasks.loading_cpu_ns()
        if now - last < quiet_ns:
            return
        last = now


# --- the machine ----------------------------------------------------------------------------

def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) ticks of all CPUs since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


class MachineWindow:
    """The load average before and after, and the share of the machine's
    CPUs busy (all programs) in between."""

    def __enter__(self):
        self.load_before, self.ticks0 = loadavg(), _cpu_ticks()
        return self

    def __exit__(self, *exc):
        self.load_after, t1 = loadavg(), _cpu_ticks()
        busy, total = t1[0] - self.ticks0[0], t1[1] - self.ticks0[1]
        self.busy_share = busy / total if total else float("nan")

    def describe(self) -> str:
        return (f"load average {self.load_before:.1f} -> {self.load_after:.1f}, CPUs "
                f"{self.busy_share:.0%} busy")


_BUSY_LOOP = ("import ctypes, os, signal\n"
              "ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never an orphan\n"
              "if os.getppid() != {parent}:\n"
              "    os._exit(0)  # the parent ended before prctl\n"
              "while True:\n"
              "    pass\n")


class BackgroundLoad:
    """per_core busy-looping processes per CPU while the block runs; killed
    and reaped at its end (and dead with this process if it is killed)."""

    def __init__(self, per_core: int):
        self.count = per_core * os.cpu_count()
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        code = _BUSY_LOOP.format(parent=os.getpid())
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen([sys.executable, "-c", code]))
        except BaseException:
            self.__exit__()
            raise
        time.sleep(1.0)  # every one of them running
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        self.procs = []


# --- workloads --------------------------------------------------------------------------------

class Workload(NamedTuple):
    name: str
    title: str
    dataset: object
    batch_size: int
    batches: int
    in_process: object      # an iterable of batches, the in-process peer
    output: str = "numpy"   # ShmLoader's


class PlainLoop:
    """The in-process peer of the map-style workloads: dataset[i] in a loop,
    arrays stacked with np.stack, other leaves (str, bytes, ints) listed."""

    def __init__(self, dataset, batch_size):
        self.dataset, self.batch_size = dataset, batch_size

    def __iter__(self):
        n = len(self.dataset)
        for start in range(0, n, self.batch_size):
            samples = [self.dataset[i] for i in range(start, min(start + self.batch_size, n))]
            yield stack(samples)


def stack(samples):
    first = samples[0]
    if isinstance(first, tuple):
        return tuple(stack(list(leaf)) for leaf in zip(*samples))
    if isinstance(first, np.ndarray):
        return np.stack(samples)
    if isinstance(first, (int, np.integer)):
        return np.array(samples)
    return samples


def workload(name: str, scale: float = 1.0) -> Workload:
    import loaders
    import realistic

    if name == "W1":
        batches = max(2, int(12 * scale))
        ds = loaders.W1(batches)
        return Workload("W1", f"np.full((1000, 150), i, float64), batch 128, {batches} batches",
                        ds, 128, batches, PlainLoop(ds, 128))
    if name == "W11":
        files = realistic.make_jpegs(512)
        batches = max(2, int(8 * scale))
        ds = realistic.Jpegs(files[:batches * 64])
        return Workload("W11", f"JPEG 500x375 q90, Pillow decode + RandomResizedCrop(224) + flip, "
                               f"batch 64, {batches} batches", ds, 64, batches, PlainLoop(ds, 64))
    if name == "W12":
        path = realistic.make_tokens()
        batches = max(2, int(300 * scale))
        ds = realistic.TokenWindows(path, batches * 32)
        return Workload("W12", f"1 GB uint16 memmap, windows of 1,025 -> (x, y) int64 (1024,), "
                               f"batch 32, {batches} batches", ds, 32, batches,
                        realistic.GetBatch(path, batches), output="torch")
    if name == "W13B":
        batches = max(2, int(16 * scale))
        ds = realistic.RawJpegs(batches * 256)
        return Workload("W13 bytes", f"(bytes of 100-200 KB, label), batch 256, {batches} batches",
                        ds, 256, batches, PlainLoop(ds, 256))
    if name == "W13T":
        batches = max(2, int(12 * scale))
        ds = realistic.Documents(batches * 64)
        return Workload("W13 text", f"(str of 1 MB, label), batch 64, {batches} batches", ds, 64,
                        batches, PlainLoop(ds, 64))
    raise ValueError(f"unknown workload {name!r}: W1, W11, W12, W13B, W13T (W13: both)")


def make_loaders(w: Workload, workers: int = 2) -> dict:
    import torch.utils.data as tud

    extra = {}
    if w.name == "W12":
        extra[UNSEEDED] = lambda: ShmLoader(w.dataset, batch_size=w.batch_size,
                                            num_workers=workers, seed=0, output=w.output,
                                            reproducible=False)
    return {
        OURS: lambda: ShmLoader(w.dataset, batch_size=w.batch_size, num_workers=workers, seed=0,
                                output=w.output),
        THREADS: lambda: ShmLoader(w.dataset, batch_size=w.batch_size, num_workers=workers, seed=0,
                                   output=w.output, worker_mode="thread"),
        TORCH: lambda: tud.DataLoader(w.dataset, batch_size=w.batch_size, num_workers=workers,
                                      persistent_workers=True, prefetch_factor=2),
        INPROC: lambda: w.in_process,
        **extra,
    }


def tasks_of(kind: str, loader, known_threads) -> Tasks:
    """The loader's tasks by role; call after its first epoch (PyTorch's
    workers exist from then on)."""
    if kind in (OURS, THREADS, UNSEEDED):
        procs = loader._procs  # the documented name scripts read (main/loader.py)
        workers = [c.pid for c in procs if c.role.worker is not None]
        batcher = [c.pid for c in procs if c.role.worker is None]
        return Tasks(workers, batcher, threads=kind == THREADS, known_threads=known_threads)
    if kind == TORCH:
        return Tasks([p.pid for p in loader._iterator._workers], known_threads=known_threads)
    return Tasks(known_threads=known_threads)


def close(loader) -> None:
    if hasattr(loader, "close"):
        loader.close()
    elif getattr(loader, "_iterator", None) is not None:
        loader._iterator._shutdown_workers()


# --- one epoch ----------------------------------------------------------------------------------

class Epoch(NamedTuple):
    wall_s: float
    batches: int
    main_cpu_s: float            # the training thread, time.thread_time()
    usage: dict                  # role -> Usage over the epoch


def timed_epoch(loader, tasks: Tasks) -> Epoch:
    """One epoch; main's counters over the loop, the workers' and the
    batcher's until they went idle after it."""
    loading, main = tasks.loading_snapshot(), tasks.main_snapshot()
    t0, c0, n = time.perf_counter(), time.thread_time(), 0
    for b in loader:
        n += 1
        del b
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    main_after = tasks.main_snapshot()
    wait_idle(tasks)
    after = {**tasks.loading_snapshot(), **main_after}
    before = {**loading, **main}
    return Epoch(wall, n, cpu, {role: after[role].minus(before[role]) for role in ROLES})


def median_epoch(epochs: list[Epoch]) -> Epoch:
    """Each figure's median over the epochs (per role, per counter)."""
    roles = epochs[0].usage
    usage = {r: Usage(*(statistics.median(e.usage[r][i] for e in epochs)
                        for i in range(len(Usage._fields)))) for r in roles}
    return Epoch(statistics.median(e.wall_s for e in epochs), epochs[0].batches,
                 statistics.median(e.main_cpu_s for e in epochs), usage)


# --- a workload, side by side ---------------------------------------------------------------------

def run_workload(w: Workload, conditions, repeats: int) -> dict:
    """condition -> {"machine": str, "loaders": kind -> median Epoch}."""
    makers = make_loaders(w)
    loaders, tasks, result = {}, {}, {}
    thread_ids: list[int] = []
    try:
        for kind, make in makers.items():
            loaders[kind] = make()
            timed_epoch(loaders[kind], Tasks(known_threads=lambda: ()))  # warm-up
        for kind, loader in loaders.items():
            tasks[kind] = tasks_of(kind, loader, lambda: thread_ids)
            if tasks[kind].threads:
                thread_ids += tasks[kind].workers + tasks[kind].batcher
        for condition in conditions:
            epochs = {kind: [] for kind in loaders}
            load = BackgroundLoad(BUSY_PER_CORE) if condition == "loaded" else None
            with MachineWindow() as window:
                if load is not None:
                    load.__enter__()
                try:
                    for _ in range(repeats):
                        for kind, loader in loaders.items():
                            epochs[kind].append(timed_epoch(loader, tasks[kind]))
                finally:
                    if load is not None:
                        load.__exit__()
            result[condition] = {"machine": window.describe(),
                                 "loaders": {k: median_epoch(v) for k, v in epochs.items()}}
    finally:
        for loader in loaders.values():
            close(loader)
    return result


ROLES = ("worker", "batcher", "main thread", "main, other threads")


def _cell(e: Epoch, samples: int, role: str) -> str:
    u = e.usage[role]
    per = 1e6 / samples
    return (f"{u.cpu_s * per:>8.1f} {u.user_s * per:>7.1f} {u.sys_s * per:>7.1f} "
            f"{u.minflt / samples:>7.2f} {u.majflt / samples:>6.3f} {u.vcsw / samples:>6.3f} "
            f"{u.ivcsw / samples:>6.3f}")


def print_workload(w: Workload, result: dict, repeats: int) -> None:
    samples = w.batches * w.batch_size
    conds = list(result)
    print(f"\n{w.name}: {w.title}; 2 workers; median of {repeats} epochs per loader")
    print(f"  {machine()}")
    for c in conds:
        extra = f" (+{BUSY_PER_CORE * os.cpu_count()} busy processes)" if c == "loaded" else ""
        print(f"  {c}{extra}: {result[c]['machine']}")
    head = " | ".join(f"{c + ': samples/s':>18} {'vs PyTorch':>10} {'main ms/batch':>13} "
                      f"{'all us/sample':>13}" for c in conds)
    print(f"{'loader':<28} {head}")
    for kind in result[conds[0]]["loaders"]:
        cells = []
        for c in conds:
            rows = result[c]["loaders"]
            e, t = rows[kind], rows[TORCH]
            total = sum(e.usage[r].cpu_s for r in ROLES) / samples * 1e6
            cells.append(f"{samples / e.wall_s:>18.1f} {t.wall_s / e.wall_s:>9.2f}x "
                         f"{e.main_cpu_s / e.batches * 1e3:>13.3f} {total:>13.1f}")
        print(f"{kind:<28} {' | '.join(cells)}")
    print(f"  per sample, by process: CPU us (user, sys), minor and major faults, voluntary and "
          f"involuntary switches")
    sub = f"{'us':>8} {'user':>7} {'sys':>7} {'minflt':>7} {'majflt':>6} {'vcsw':>6} {'ivcsw':>6}"
    print(f"{'loader':<28} {'process':<20} " + " | ".join(f"{c}: {sub}" for c in conds))
    for kind in result[conds[0]]["loaders"]:
        for role in ROLES:
            if all(result[c]["loaders"][kind].usage[role].cpu_s == 0 and
                   result[c]["loaders"][kind].usage[role].vcsw == 0 for c in conds):
                continue
            cells = " | ".join(f"{'':>{len(c) + 1}} "
                               f"{_cell(result[c]['loaders'][kind], samples, role)}" for c in conds)
            print(f"{kind:<28} {role:<20} {cells}")
    sys.stdout.flush()


def as_json(w: Workload, result: dict) -> dict:
    samples = w.batches * w.batch_size
    return {"workload": w.name, "title": w.title, "samples": samples, "batches": w.batches,
            "cpu": machine(),
            "conditions": {c: {"machine": r["machine"], "loaders": {
                k: {"wall_s": e.wall_s, "main_cpu_s": e.main_cpu_s, "batches": e.batches,
                    "usage": {role: u._asdict() for role, u in e.usage.items()}}
                for k, e in r["loaders"].items()}} for c, r in result.items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W1,W11,W12,W13",
                        help="of W1, W11, W12, W13 (bytes and text), W13B, W13T")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conditions", default="found,loaded",
                        help="found: the machine as it is; loaded: beside the background load")
    parser.add_argument("--scale", type=float, default=1.0, help="epoch length factor")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="W12: where the CPU goes (py-spy, strace, cProfile): cpu_profile.py")
    parser.add_argument("--seconds", type=float, default=8.0, help="--profile: sampling time")
    parser.add_argument("--out", default=None, help="--profile: directory for the raw profiles")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="ShmLoader forks")
    # A kill from a job controller (SIGTERM) unwinds too: loaders closed, load stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.profile:
        import cpu_profile

        cpu_profile.main(args)
        return
    names = []
    for n in args.workloads.upper().split(","):
        names += ["W13B", "W13T"] if n.strip() == "W13" else [n.strip()]
    conditions = [c.strip() for c in args.conditions.split(",")]
    print(f"{machine()}; {time.strftime('%Y-%m-%d %H:%M')}")
    out = []
    for name in names:
        w = workload(name, args.scale)
        result = run_workload(w, conditions, args.repeats)
        print_workload(w, result, args.repeats)
        out.append(as_json(w, result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
