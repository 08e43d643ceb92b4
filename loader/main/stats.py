"""Where an epoch's time goes: the clocks the processes keep, and what main
makes of them for ShmLoader.stats() and DataStallWarning.

NOTE [ Wait clocks ]
~~~~~~~~~~~~~~~~~~~~
Each worker and the batcher count the nanoseconds they spend waiting in
one shared int64 word (SharedState.waited: one per worker id, the last one
the batcher's).  Busy time is the rest.  Main reads the words at any
moment, also while their owner is in the middle of a wait, so a wait is
published when it starts, not only when it ends, and in one word (a pair
of words could be read torn):

    word >= 0     not waiting; the word is the total waited so far
    word <  0     waiting since `since`: the word is -(since - total) - 1

so that at time `now` the total waited is `now - (since - total)`.  The
clock is CLOCK_MONOTONIC (time.perf_counter_ns on Linux), the same in
every process.  Every word starts as waiting when the shared state is
made (start_idle), and a process's clock starts from its word's total: a
worker forked late (num_workers="auto" growing the pool) was idle, not
busy, before it existed, and no total ever goes back.

The training loop's waits (main blocked in next()) are timed by the epoch
iterator itself; the slab pool's peak use per run comes with RunEnded.

NOTE [ CPU starvation ]
~~~~~~~~~~~~~~~~~~~~~~~
A wait clock tells waiting for work from not waiting; it cannot tell a
process that works from one that wants a CPU and has none.  When other
programs hold the CPUs, the loader's processes sit on a run queue: after
a bell they are slow to wake (counted as waiting), and while loading
they are slow to run (counted as busy), so the clocks show neither part
saturated ("4 workers 53% busy") and the advice would be to raise
prefetch, which cannot help.

So main also reads, at the epoch's start and end, the kernel's count of
the time each task of the loading spent waiting on a run queue:
/proc/<pid>/task/<tid>/schedstat, second field, in ns (CONFIG_SCHED_INFO;
summed over a process's threads).  That is starvation, measured: time
the task was ready to run and no CPU ran it.  And it reads the CPU time
all programs used on the CPUs this process may run on (/proc/stat),
less the loader's own processes' (schedstat's first field): what other
programs took.  Both at the epoch's ends only: a few dozen small reads.

- cpu_wait_share: the stages' run-queue shares of the epoch, added up:
  the training thread's (it hands batches out and raises LIMIT), the
  batcher's and the mean worker's (num_workers=0: the training thread's
  alone).  Added, because a batch passes the stages one after another:
  a starved main wakes late after each batch, then each worker wakes
  late after LIMIT rises, and so on, each while the others sit idle.
- other_programs_cpu_share: other programs' CPU time over (wall x CPUs);
  loader_cpu_share: the loader's own processes' (the training process's
  included).

Starved by other programs (starved_by_others): the loading waited for a
CPU at least STARVED of the epoch while other programs used at least
OTHERS of the CPUs.  Then the stall is judged as it would have been
without that wait (_explained_by_starvation): no DataStallWarning if
the epoch would have been shorter than STALL_MIN_SECONDS (less the wait
of its most starved stage: at least that much was lost), or if its loop
would have waited at most STALL_SHARE of it (without_cpu_wait: the
stages' waits come off the epoch and off the loop's wait; a worker's own
wait off its busy time, the training thread's and the batcher's off the
workers' idle time, as they waited for those).  Nothing in the loader
would help; the summary line says what happened.  A CPU-bound epoch so
never warns, however loaded the machine: a CPU-bound task's time less
its run-queue wait is about its CPU time, which the load does not
change.  A dataset that sleeps (I/O) still stalls: a task that wakes is
soon run, but its sleep cannot be run faster, so its loop waits with or
without the wait for a CPU (the figures: docs/benchmarks.md, "Stalls
when other programs hold the CPUs").  Then the advice names what held
the epoch up, judged on the shares without the wait, adds that other
programs held the CPUs, and never falls back to raising prefetch.

Waiting for a CPU while the loader's own processes used CPU_BOUND of the
CPUs (and other programs little) means they want more CPUs than there
are: more workers would not help, and the advice says so.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import NamedTuple

from shmq import sync
from loader.errors import DataStallWarning


STALL_SHARE = 0.5        # warn when the loop waited more than this share of an epoch ...
STALL_MIN_SECONDS = 5.0  # ... of at least this long (short epochs are mostly start-up)
BUSY = 0.9               # a part busier than this is the bottleneck
STARVED = 0.25           # loading tasks waited for a CPU this share of the epoch, while ...
OTHERS = 0.25            # ... other programs used this share of the CPUs (NOTE [ CPU starvation ])
CPU_BOUND = 0.75         # ... or the loader's own processes used this share of them


def waited_ns(words, index: int) -> int:
    """The total a wait clock holds now (see NOTE [ Wait clocks ]).  The
    time is read after the word, so that a wait's start is never later
    than `now`: readings never go back."""
    word = sync.atomic_load(words, index)
    return word if word >= 0 else time.perf_counter_ns() - (-word - 1)


def start_idle(words) -> None:
    """Every clock waiting since now: a worker not forked yet (a pool that
    grows later) is idle, not busy, until its own clock starts."""
    now = time.perf_counter_ns()
    for i in range(len(words)):
        sync.atomic_store(words, i, -now - 1)


class WaitClock:
    """One process's (or worker thread's) wait clock: begin() and end()
    around every wait."""

    def __init__(self, words, index: int):
        self.words, self.index = words, index
        self.total = waited_ns(words, index)  # the time before it started counts as waited
        self.since = 0
        sync.atomic_store(words, index, self.total)  # busy from now until its first wait

    def begin(self) -> None:
        self.since = time.perf_counter_ns()
        # SYNC POINT: release store; main's acquire load (waited_ns) pairs with it
        sync.atomic_store(self.words, self.index, -(self.since - self.total) - 1)

    def end(self) -> None:
        self.total += time.perf_counter_ns() - self.since
        sync.atomic_store(self.words, self.index, self.total)


class Task(NamedTuple):
    """A task that loads (NOTE [ CPU starvation ]): a worker or batcher
    process (all its threads), or a thread of this process."""
    id: int          # pid, or the thread's native id
    thread: bool


class CpuSample(NamedTuple):
    """What the CPUs did so far (NOTE [ CPU starvation ]); None where /proc
    does not say."""
    stages: dict             # "loop", "workers", "batcher" -> its tasks
    loading: dict            # Task -> (cpu ns, run-queue ns)
    own_cpu_ns: dict         # pid -> CPU ns of the loader's processes, this one included
    machine_busy_ns: int | None  # CPU ns all programs used on this process's CPUs
    cpus: int


def _schedstat(path: str) -> tuple[int, int] | None:
    try:
        with open(path) as f:
            cpu, runq = f.read().split()[:2]
        return int(cpu), int(runq)
    except (OSError, ValueError):
        return None  # gone, or a kernel without CONFIG_SCHED_INFO


def _process_times(pid: int) -> tuple[int, int] | None:
    """(cpu ns, run-queue ns) of all of a process's threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    times = [t for t in (_schedstat(f"/proc/{pid}/task/{tid}/schedstat") for tid in tids) if t]
    return (sum(t[0] for t in times), sum(t[1] for t in times)) if times else None


def _task_times(task: Task) -> tuple[int, int] | None:
    if task.thread:
        return _schedstat(f"/proc/self/task/{task.id}/schedstat")
    return _process_times(task.id)


def _machine_busy_ns(cpus: set) -> int | None:
    """CPU time all programs used on `cpus` (/proc/stat: user, nice, system,
    irq, softirq and steal; guest time is inside user)."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    ticks = 0
    for fields in lines:
        if fields[0] != "cpu" and int(fields[0][3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
            ticks += user + nice + system + irq + softirq + steal
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def cpu_sample(stages: dict, own_pids: list) -> CpuSample:
    """Read the CPUs' account now: `stages` the tasks of each stage of the
    loading ("loop": the training thread; "workers"; "batcher"), own_pids
    the loader's processes (this one's threads are all counted in it)."""
    cpus = os.sched_getaffinity(0)
    tasks = [t for stage in stages.values() for t in stage]
    return CpuSample(
        stages=stages,
        loading={t: times for t in tasks if (times := _task_times(t)) is not None},
        own_cpu_ns={pid: times[0] for pid in own_pids
                    if (times := _process_times(pid)) is not None},
        machine_busy_ns=_machine_busy_ns(cpus), cpus=len(cpus))


def cpu_figures(start: CpuSample, end: CpuSample, wall_ns: int) -> dict:
    """stats()'s cpu_wait_share and other_programs_cpu_share between two
    samples (see NOTE [ CPU starvation ]); a task or process that started
    in between counts from 0, one that ended is left out."""
    shares = {}
    for stage, tasks in end.stages.items():  # each stage: the mean of its tasks
        waits = [end.loading[t][1] - start.loading.get(t, (0, 0))[1]
                 for t in tasks if t in end.loading]
        if waits:
            shares[stage] = _share(sum(waits) / (len(waits) * wall_ns))
    wait = _share(sum(shares.values())) if shares else None
    capacity = wall_ns * end.cpus
    own = sum(max(cpu - start.own_cpu_ns.get(pid, 0), 0) for pid, cpu in end.own_cpu_ns.items())
    others = None
    if start.machine_busy_ns is not None and end.machine_busy_ns is not None:
        others = _share((end.machine_busy_ns - start.machine_busy_ns - own) / capacity)
    return {"cpu_wait_share": wait, "cpu_wait_shares": shares, "other_programs_cpu_share": others,
            "loader_cpu_share": _share(own / capacity) if end.own_cpu_ns else None,
            "cpus": end.cpus}


class EpochClock:
    """Main's account of one epoch, from its first next() to its end: the
    time the training loop waited in next(), the slab bytes handed out,
    the wait clocks of the workers and the batcher (None: the epoch is
    loaded in the training process, num_workers=0), and what the CPUs did
    (`tasks`: () -> (the tasks that load, the loader's pids); NOTE [ CPU
    starvation ])."""

    def __init__(self, words, t0: int, tasks):
        self.words = words
        self.t0 = t0  # when the epoch's first next() began
        self.waits0 = self._waits()
        self.tasks = tasks
        self.cpu0 = cpu_sample(*tasks())
        self.loop_wait_ns = 0
        self.bytes = 0
        self.spilled_bytes = 0

    def _waits(self) -> list[int]:
        if self.words is None:
            return []
        return [waited_ns(self.words, i) for i in range(len(self.words))]

    def figures(self, workers: int, peak_slab_bytes: int, cap_bytes: int) -> dict:
        """What ShmLoader.stats() reports of the epoch just ended (workers:
        the first `workers` ids were the ones loading)."""
        waits = self._waits()
        cpu = cpu_sample(*self.tasks())
        wall = max(time.perf_counter_ns() - self.t0, 1)
        out = {"seconds": wall / 1e9,
               "loop_wait_seconds": self.loop_wait_ns / 1e9,
               "loop_wait_share": min(self.loop_wait_ns / wall, 1.0),
               "bytes": self.bytes + self.spilled_bytes,
               "bytes_per_second": (self.bytes + self.spilled_bytes) * 1e9 / wall,
               "spilled_bytes": self.spilled_bytes,
               "workers_busy_share": None, "batcher_busy_share": None,
               "peak_slab_bytes": peak_slab_bytes, "memory_cap_bytes": cap_bytes,
               **cpu_figures(self.cpu0, cpu, wall)}
        if self.words is not None:
            d = [w - w0 for w, w0 in zip(waits, self.waits0)]
            out["workers_busy_share"] = _share(1 - sum(d[:workers]) / (wall * max(workers, 1)))
            out["batcher_busy_share"] = _share(1 - d[-1] / wall)
        return out


class StatsBook:
    """The figures stats() reports: those of the last epoch that ran to its
    end.  The loader keeps the book and reads it; each epoch is given it
    and records itself as it ends (NOTE [ Who decides on main's batch
    path ] in main/epochs.py)."""

    def __init__(self, memory_cap_bytes: int, warn_stalls: bool):
        self.memory_cap_bytes = memory_cap_bytes
        self.warn_stalls = warn_stalls  # loader.DataLoader keeps torch's behaviour: no warning
        self.last: dict | None = None   # None before the end of the first epoch
        self.warned_stall = False        # a DataStallWarning is given once per loader

    def record(self, epoch: int, msg, clock: EpochClock, workers: int, batches: int = 0,
               samples: int = 0) -> None:
        """An epoch ran to its end: keep its figures (msg: the batcher's
        RunEnded; None when the epoch was loaded in this process, which
        counted `batches` and `samples` itself; workers: those loading)."""
        by_batcher = relayouts = peak = cap = 0
        if msg is not None:
            batches, samples, by_batcher, relayouts = (msg.batches, msg.samples,
                                                       msg.rows_by_batcher, msg.relayouts)
            peak, cap = msg.peak_slab_bytes, self.memory_cap_bytes
        s = {"epoch": epoch, "batches": batches, "samples": samples,
             "samples_written_by_workers": samples - by_batcher,
             "samples_written_by_batcher": by_batcher, "relayouts": relayouts,
             "workers": workers, **clock.figures(workers, peak, cap)}
        s["summary"] = summary_line(s)
        self.last = s
        if self.warn_stalls and not self.warned_stall:
            advice = stall_advice(s)
            if advice is not None:
                self.warned_stall = True  # (before: with -W error the warning raises)
                warn_stalled(advice)


def _share(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def summary_line(s: dict) -> str:
    """One line for logs: the epoch's rate and where its time went."""
    line = (f"epoch {s['epoch']}: {s['batches']} batches, {s['samples']} samples in "
            f"{s['seconds']:.2f} s ({_size(s['bytes_per_second'])}/s); the training loop "
            f"waited {s['loop_wait_share']:.0%} of it")
    if s["workers"]:
        line += (f"; {s['workers']} workers busy {s['workers_busy_share']:.0%}, batcher busy "
                 f"{s['batcher_busy_share']:.0%}; slab pool peak "
                 f"{_size(s['peak_slab_bytes'])} of {_size(s['memory_cap_bytes'])}")
    if _cpu_short(s):
        line += "; " + _starvation(s)
    return line


def _cpu_short(s: dict) -> bool:
    """The loading tasks waited for a CPU a good share of the epoch."""
    return s["cpu_wait_share"] is not None and s["cpu_wait_share"] >= STARVED


def _cpu_bound(s: dict) -> bool:
    """The loader's own processes used the CPUs and still waited for them."""
    mine = s["loader_cpu_share"]
    return _cpu_short(s) and mine is not None and mine >= CPU_BOUND


def starved_by_others(s: dict) -> bool:
    """Other programs held the CPUs the loader waited for (NOTE [ CPU
    starvation ]): the loop's waits are theirs, not the loader's."""
    others = s["other_programs_cpu_share"]
    return _cpu_short(s) and others is not None and others >= OTHERS


def _starvation(s: dict) -> str:
    loaders = "the training thread" if not s["workers"] else "the loader's processes"
    text = f"{loaders} waited for a CPU {s['cpu_wait_share']:.0%} of the epoch"
    if s["other_programs_cpu_share"] is not None:
        text += (f" while other programs used {s['other_programs_cpu_share']:.0%} of the "
                 f"{s['cpus']} CPUs")
    return text


def _stalled(s: dict) -> bool:
    return s["seconds"] >= STALL_MIN_SECONDS and s["loop_wait_share"] > STALL_SHARE


def without_cpu_wait(s: dict) -> dict | None:
    """The epoch's shares as they would have been had the loading not
    waited for a CPU (NOTE [ CPU starvation ]): that wait comes off the
    epoch and off the loop's wait; a worker's own wait off its busy time,
    and the training thread's and the batcher's off the workers' idle
    time (they waited for those).  None when the wait was the whole
    epoch."""
    wait, stages = s["cpu_wait_share"], s["cpu_wait_shares"]
    if wait >= 1:
        return None
    kept = 1 - wait

    def busy(share, stage):
        return None if share is None else _share((share - stages.get(stage, 0.0)) / kept)

    loop_wait = _share((s["loop_wait_share"] - wait) / kept)
    return dict(s, cpu_wait_share=0.0, loop_wait_share=loop_wait,
                workers_busy_share=busy(s["workers_busy_share"], "workers"),
                batcher_busy_share=busy(s["batcher_busy_share"], "batcher"))


def _explained_by_starvation(s: dict) -> bool:
    """Would there have been no stall to warn of had the loading not waited
    for a CPU (NOTE [ CPU starvation ])?  Either the epoch would have been
    shorter than STALL_MIN_SECONDS (less the wait of its most starved
    stage: at least that much was lost), or the loop would have waited at
    most STALL_SHARE of it (less the wait of all the stages)."""
    shortest = s["seconds"] * (1 - max(s["cpu_wait_shares"].values()))
    figures = without_cpu_wait(s)
    return shortest < STALL_MIN_SECONDS or figures is None or \
        figures["loop_wait_share"] <= STALL_SHARE


def stall_advice(s: dict) -> str | None:
    """A DataStallWarning's text when the epoch stalled on data, else None.
    None too when other programs held the CPUs and the epoch would not have
    stalled without the loader's wait for them (starved_by_others): no
    setting of the loader would help, and the summary line says so.  When
    it would have stalled anyway, the advice says what else held it up,
    and that other programs held the CPUs, never to raise prefetch."""
    if not _stalled(s):
        return None
    starved = starved_by_others(s)
    if starved and _explained_by_starvation(s):
        return None
    figures = without_cpu_wait(s) if starved else s
    head = (f"ShmLoader: the training loop waited for batches {s['loop_wait_share']:.0%} of "
            f"epoch {s['epoch']} ({s['loop_wait_seconds']:.1f} of {s['seconds']:.1f} s). ")
    if not s["workers"]:
        note = f" Other programs held the CPUs too: {_starvation(s)}." if starved else ""
        return head + ("num_workers=0 loads in the training process itself: use worker "
                       "processes (num_workers='auto' picks a count).") + note
    note = (f" Other programs held the CPUs too: {_starvation(s)} (the busy shares above "
            f"leave that wait out)." if starved else "")
    advice = _bottleneck(figures, starved)
    if advice is None:  # starved, and nothing of the loader's was saturated
        return head + (f"Neither the {s['workers']} workers ({figures['workers_busy_share']:.0%}"
                       f" busy) nor the batcher ({figures['batcher_busy_share']:.0%}) were "
                       f"saturated (without their wait for a CPU), and other programs held the "
                       f"CPUs: {_starvation(s)}. The loader waits for them: free the CPUs (or "
                       f"give the loader its own) before changing its settings.")
    return head + advice + note


def _bottleneck(s: dict, starved: bool) -> str | None:
    """What held the epoch up, and what to do: None when nothing in the
    loader did and other programs held the CPUs (starved)."""
    batcher_busy = s["batcher_busy_share"] >= BUSY
    if batcher_busy and s["samples_written_by_batcher"]:
        # (before the workers: a worker blocked sending to a busy batcher looks busy too)
        return (f"The batcher was busy {s['batcher_busy_share']:.0%} of the time: "
                f"{s['samples_written_by_batcher']} of {s['samples']} samples were written by "
                f"it because their dtypes or structure differ from the batch's layout; give "
                f"every sample the same dtypes and keys, or a collate_fn.")
    if _cpu_bound(s) and not starved:
        # (before the busy shares: a task waiting for a CPU looks busy, or idle after a bell)
        return (f"The CPUs were the bottleneck: {_starvation(s)}, so the training process, "
                f"its {s['workers']} workers and the batcher want more than there is. More "
                f"workers will not help: use fewer (num_workers='auto' finds a count), or make "
                f"dataset[i] cheaper.")
    if s["workers_busy_share"] >= BUSY:
        return (f"Its {s['workers']} workers were busy {s['workers_busy_share']:.0%} of the "
                f"time: they are the bottleneck. Use more workers (num_workers='auto' finds a "
                f"count), or make dataset[i] cheaper.")
    if batcher_busy:
        return (f"The batcher was busy {s['batcher_busy_share']:.0%} of the time: it lays out "
                f"and hands over every batch, so many small batches keep it busy; use fewer, "
                f"larger batches.")
    if s["peak_slab_bytes"] >= 0.9 * s["memory_cap_bytes"]:
        return (f"The slab pool was full ({_size(s['peak_slab_bytes'])} of "
                f"memory_cap_bytes={_size(s['memory_cap_bytes'])}): raise memory_cap_bytes, or "
                f"drop references to old batches sooner.")
    if starved:
        return None
    return (f"Neither the {s['workers']} workers ({s['workers_busy_share']:.0%} busy) nor the "
            f"batcher ({s['batcher_busy_share']:.0%}) were saturated: the wait is in start-up "
            f"or in latency; raise prefetch, or use persistent_workers=True if it is off.")


def warn_stalled(advice: str) -> None:
    warnings.warn(advice, DataStallWarning, stacklevel=_first_frame_outside_loader())


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _first_frame_outside_loader() -> int:
    """The stacklevel of the training loop's line, for warnings.warn called
    by our caller (however deep in the loader that is: an epoch's next(),
    steps(), num_workers=0)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
