"""num_workers="auto": a pool of workers that grows and shrinks while the
training loop runs.

Every interval (a quarter of a second and a few batches at least) main
looks at what it measured:
- how long the training loop waited for batches (main blocked in next()),
- the batches per second it got,
- how busy the active workers were (the time they did not spend waiting,
  which each adds up in its word of shared memory: nothing is measured
  per sample),
- how much of the machine's CPU time went unused (/proc/stat).

If the loop waited (more than WAIT_GROW of the time), the CPUs are not
all busy and the pool is under max_workers, the pool grows: it doubles
while the loop waits most of the time and most of the machine idles
(workers that sleep on IO), grows by half while it waits a fair part of
the time, else by one.  If the loop never waits and the workers idle, it shrinks by one.
A change is kept only if the batch rate did not fall (a grow must gain
GAIN, a shrink may lose at most LOSS), else it is undone and the pool
holds for a while.  So a compute-bound pool stops at about the CPU count
(more workers only share the same CPUs) and an IO-bound one grows until
the loop no longer waits.

Workers are never killed: a worker whose id is not below the active count
stops claiming units (see Worker.may_claim) and sleeps; a worker beyond
those ever started is forked (or started, for thread workers) and joins
the run in progress (a Joined message).
"""

from __future__ import annotations

import os
import time

from loader.main.stats import waited_ns

INTERVAL_S = 0.25      # shortest time between two decisions
MIN_BATCHES = 4        # fewest batches between two decisions
WAIT_GROW = 0.05       # the loop waited more than this share of the time: grow
WAIT_SHRINK = 0.01     # ... less than this, and the workers idle: shrink
IDLE = 0.5             # workers busy less than this share of the time are idle
SATURATED = 0.1        # the machine's CPUs idle less than this share: they are all busy
MOSTLY_IDLE = 0.5      # ... more than this, with the loop waiting more than WAIT_DOUBLE of
WAIT_DOUBLE = 0.5      # the time: double the pool; waiting more than WAIT_HALF: grow by half
WAIT_HALF = 0.2
GAIN, LOSS = 1.03, 0.97
HOLD_INTERVALS = 4     # after a change that did not pay
WARM_INTERVALS = 1     # the first: the pipeline fills, the loop waits for its first batches


def workers_loading(scaler: "Autoscaler | None", num_workers: int) -> int:
    """The workers that load now: the autoscaler's active count under
    num_workers="auto", else the fixed num_workers."""
    return scaler.active if scaler is not None else num_workers


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_max_workers() -> int:
    """IO-bound pools may outnumber the CPUs many times over (a worker is
    forked only when the pool grows to it)."""
    return min(max(32, 16 * cpu_count()), 256)


def _machine_cpu() -> tuple[int, int]:
    """(idle, total) clock ticks of all CPUs so far (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)


class Autoscaler:
    """num_workers="auto": decides how many workers load, from the workers'
    wait clocks (`waited`, NOTE [ Wait clocks ]) and the batch rate, and
    applies it with `set_active(count)`."""

    def __init__(self, waited, set_active, start: int, max_workers: int):
        self.waited_clocks, self.set_active = waited, set_active
        self.active, self.max_workers = start, max_workers
        self.t0 = time.perf_counter()
        self.batches = 0
        self.waited = 0.0
        self.counts = self._counts()
        self.trial = None      # (previous pool size, batch rate before the change)
        self.hold = WARM_INTERVALS
        self.history: list[int] = [start]

    def _counts(self) -> tuple[int, int, int]:
        """(ns the active workers waited, machine idle ticks, total ticks), so far."""
        waited = self.waited_clocks
        return (sum(waited_ns(waited, i) for i in range(self.active)),
                *_machine_cpu())

    def waited_for(self, seconds: float) -> None:
        self.waited += seconds

    def batch_handed_out(self) -> None:
        self.batches += 1
        now = time.perf_counter()
        elapsed = now - self.t0
        if elapsed < INTERVAL_S or self.batches < MIN_BATCHES:
            return
        counts = self._counts()
        workers_waited = counts[0] - self.counts[0]
        ticks = counts[2] - self.counts[2]
        idle = (counts[1] - self.counts[1]) / ticks if ticks > 0 else 0.0
        busy = max(elapsed * 1e9 * self.active - workers_waited, 0.0)
        utilisation = busy / (elapsed * 1e9 * max(self.active, 1))
        rate, wait = self.batches / elapsed, self.waited / elapsed
        self.t0, self.batches, self.waited, self.counts = now, 0, 0.0, counts
        self._decide(rate, wait, utilisation, idle)

    def _decide(self, rate: float, wait: float, utilisation: float, idle: float) -> None:
        if self.trial is not None:
            before, before_rate = self.trial
            self.trial = None
            grew = self.active > before
            if rate < before_rate * (GAIN if grew else LOSS):
                self._set(before)  # it did not pay: undo, and hold a while
                self.hold = HOLD_INTERVALS
            return
        if self.hold:
            self.hold -= 1
            return
        if wait > WAIT_GROW and idle > SATURATED and self.active < self.max_workers:
            if idle > MOSTLY_IDLE and wait > WAIT_DOUBLE:
                step = self.active
            elif wait > WAIT_HALF:
                step = max(1, self.active // 2)
            else:
                step = 1
            self.trial = (self.active, rate)
            self._set(min(self.active + step, self.max_workers))
        elif wait < WAIT_SHRINK and utilisation < IDLE and self.active > 1:
            self.trial = (self.active, rate)
            self._set(self.active - 1)

    def _set(self, active: int) -> None:
        self.active = active
        self.history.append(active)
        self.set_active(active)
        self.counts = self._counts()  # the next interval counts the new pool
