"""Datasets that more than one test file (or one of the kill tier's
programs) uses: one definition each, with what it is for.

A dataset that only one test uses, and that explains that test, stays
beside it.  Everything here is a module-level class, so workers started by
spawn or forkserver unpickle it by name (tests/support is on their
sys.path: pyproject.toml's pythonpath, inherited), and it imports numpy
only: the kill tier's programs import it (killkit.program), and torch
would slow their start-up and register fork handlers of its own.
Datasets built on torch's classes are in torch_conformance_datasets.py.

Not called `datasets`: on pytest's pythonpath that name would shadow
Hugging Face's `datasets` (test_hf_datasets.py, and the frameworks that
import it).
"""

from __future__ import annotations

import time

import numpy as np


class Ids:
    """Sample i is i: what comes out says which index was loaded."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Filled:
    """Sample i: an array of `shape` filled with i, so that a batch says
    which indices it holds (`b[:, 0]`) and a torn or misplaced row shows.

    Work per sample, to shape the load: `delay` seconds asleep (IO-bound:
    a disk, a network), `spin` seconds of busy CPU (compute-bound), and
    `slow`, {index: seconds asleep} for the samples that are late on
    purpose (a first batch that keeps main waiting, a worker caught inside
    dataset[i] when a signal comes).

    Stands for what were Numbers and Sleepy/Busy (the kill tier,
    autoscale), Rows (stats), Big (control), Blocks16 (integrity) and the
    kill programs' DS classes: they differed only in these arguments."""

    def __init__(self, n: int, shape=4, dtype=np.int64, *, delay: float = 0.0,
                 spin: float = 0.0, slow: dict[int, float] | None = None):
        self.n, self.shape, self.dtype = n, shape, dtype
        self.delay, self.spin, self.slow = delay, spin, dict(slow or {})

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        pause = self.slow.get(i, self.delay)
        if pause:
            time.sleep(pause)
        if self.spin:
            end = time.perf_counter() + self.spin
            while time.perf_counter() < end:
                pass
        return np.full(self.shape, i, self.dtype)
