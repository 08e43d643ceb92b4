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
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import shmq


class DataStallWarning(UserWarning):
    """The training loop spent most of an epoch waiting for batches.  The
    message says which part of the loader was the bottleneck and what to
    change; ShmLoader.stats() has the figures.  Silence it with
    warnings.filterwarnings("ignore", category=loader.DataStallWarning)."""


STALL_SHARE = 0.5        # warn when the loop waited more than this share of an epoch ...
STALL_MIN_SECONDS = 5.0  # ... of at least this long (short epochs are mostly start-up)
BUSY = 0.9               # a part busier than this is the bottleneck


def waited_ns(words, index: int) -> int:
    """The total a wait clock holds now (see NOTE [ Wait clocks ]).  The
    time is read after the word, so that a wait's start is never later
    than `now`: readings never go back."""
    word = shmq.atomic_load(words, index)
    return word if word >= 0 else time.perf_counter_ns() - (-word - 1)


def start_idle(words) -> None:
    """Every clock waiting since now: a worker not forked yet (a pool that
    grows later) is idle, not busy, until its own clock starts."""
    now = time.perf_counter_ns()
    for i in range(len(words)):
        shmq.atomic_store(words, i, -now - 1)


class WaitClock:
    """One process's (or worker thread's) wait clock: begin() and end()
    around every wait."""

    def __init__(self, words, index: int):
        self.words, self.index = words, index
        self.total = waited_ns(words, index)  # the time before it started counts as waited
        self.since = 0
        shmq.atomic_store(words, index, self.total)  # busy from now until its first wait

    def begin(self) -> None:
        self.since = time.perf_counter_ns()
        # SYNC POINT: release store; main's acquire load (waited_ns) pairs with it
        shmq.atomic_store(self.words, self.index, -(self.since - self.total) - 1)

    def end(self) -> None:
        self.total += time.perf_counter_ns() - self.since
        shmq.atomic_store(self.words, self.index, self.total)


class EpochClock:
    """Main's account of one epoch, from its first next() to its end: the
    time the training loop waited in next(), the slab bytes handed out,
    and the wait clocks of the workers and the batcher (None: the epoch
    is loaded in the training process, num_workers=0)."""

    def __init__(self, words, t0: int):
        self.words = words
        self.t0 = t0  # when the epoch's first next() began
        self.waits0 = self._waits()
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
        wall = max(time.perf_counter_ns() - self.t0, 1)
        out = {"seconds": wall / 1e9,
               "loop_wait_seconds": self.loop_wait_ns / 1e9,
               "loop_wait_share": min(self.loop_wait_ns / wall, 1.0),
               "bytes": self.bytes + self.spilled_bytes,
               "bytes_per_second": (self.bytes + self.spilled_bytes) * 1e9 / wall,
               "spilled_bytes": self.spilled_bytes,
               "workers_busy_share": None, "batcher_busy_share": None,
               "peak_slab_bytes": peak_slab_bytes, "memory_cap_bytes": cap_bytes}
        if self.words is not None:
            d = [w - w0 for w, w0 in zip(waits, self.waits0)]
            out["workers_busy_share"] = _share(1 - sum(d[:workers]) / (wall * max(workers, 1)))
            out["batcher_busy_share"] = _share(1 - d[-1] / wall)
        return out


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
    return line


def stall_advice(s: dict) -> str | None:
    """A DataStallWarning's text when the epoch stalled on data, else None."""
    if s["seconds"] < STALL_MIN_SECONDS or s["loop_wait_share"] <= STALL_SHARE:
        return None
    head = (f"ShmLoader: the training loop waited for batches {s['loop_wait_share']:.0%} of "
            f"epoch {s['epoch']} ({s['loop_wait_seconds']:.1f} of {s['seconds']:.1f} s). ")
    if not s["workers"]:
        return head + ("num_workers=0 loads in the training process itself: use worker "
                       "processes (num_workers='auto' picks a count).")
    batcher_busy = s["batcher_busy_share"] >= BUSY
    if batcher_busy and s["samples_written_by_batcher"]:
        # (before the workers: a worker blocked sending to a busy batcher looks busy too)
        return head + (f"The batcher was busy {s['batcher_busy_share']:.0%} of the time: "
                       f"{s['samples_written_by_batcher']} of {s['samples']} samples were "
                       f"written by it because their dtypes or structure differ from the "
                       f"batch's layout; give every sample the same dtypes and keys, or a "
                       f"collate_fn.")
    if s["workers_busy_share"] >= BUSY:
        return head + (f"Its {s['workers']} workers were busy {s['workers_busy_share']:.0%} of "
                       f"the time: they are the bottleneck. Use more workers "
                       f"(num_workers='auto' finds a count), or make dataset[i] cheaper.")
    if batcher_busy:
        return head + (f"The batcher was busy {s['batcher_busy_share']:.0%} of the time: it "
                       f"lays out and hands over every batch, so many small batches keep it "
                       f"busy; use fewer, larger batches.")
    if s["peak_slab_bytes"] >= 0.9 * s["memory_cap_bytes"]:
        return head + (f"The slab pool was full ({_size(s['peak_slab_bytes'])} of "
                       f"memory_cap_bytes={_size(s['memory_cap_bytes'])}): raise "
                       f"memory_cap_bytes, or drop references to old batches sooner.")
    return head + (f"Neither the {s['workers']} workers ({s['workers_busy_share']:.0%} busy) "
                   f"nor the batcher ({s['batcher_busy_share']:.0%}) were saturated: the "
                   f"wait is in start-up or in latency; raise prefetch, or use "
                   f"persistent_workers=True if it is off.")


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
