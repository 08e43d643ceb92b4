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


class CountsItsEpochs:
    """An iterable dataset that counts its epochs itself, as MosaicML
    Streaming's StreamingDataset does: a copy's pass is its epoch `epoch`,
    ordered by a permutation seeded by it, each worker taking every
    num_workers-th sample; once a pass ends, the next is the next epoch.
    Sample: [index, epoch].  Keeps torchdata's Stateful protocol:
    state_dict() says where it is (its epoch, the samples of it yielded),
    and after load_state_dict() its next pass goes on from there, so that a
    resumed loader gives the rest of the cut epoch, not of epoch 0 (NOTE
    [ Datasets that keep their own state ]).  test_own_state.py, and
    test_stateful_datasets.py on torch's classes."""

    def __init__(self, n: int = 96):
        self.n, self.epoch, self.yielded = n, 0, 0

    def worker(self) -> tuple[int, int]:
        """(this worker's id, the number of workers)."""
        from loader import get_worker_info

        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def __iter__(self):
        w, workers = self.worker()
        share = np.random.default_rng(self.epoch).permutation(self.n)[w::workers]
        for k in range(self.yielded, len(share)):
            self.yielded = k + 1
            yield np.array([share[k], self.epoch])
        self.epoch, self.yielded = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.yielded = state["epoch"], state["yielded"]
