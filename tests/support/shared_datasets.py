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


class ResumesItself:
    """An iterable dataset that keeps its state as MosaicML Streaming's
    StreamingDataset does (NOTE [ Datasets that resume themselves ] in
    loader/datasets/own_state.py), the behaviour a per-copy state cannot
    describe: its epoch counter and a loaded state are in memory that main's
    copy and every worker's share (a new dataset: a new process, at epoch
    0); the first copy to begin a pass decides its epoch (the loaded state
    if not older than the counter, else the counter's) and moves the
    counter on, as Streaming's leader does behind its barrier; one order
    per epoch (seeded by it, or 0..n-1 without shuffle) over all workers,
    after sample_in_epoch of it, in batches of batch_size, batch j to
    worker j mod W; state_dict(num_samples, from_beginning), in main, and
    load_state_dict() into the shared memory.  Sample: [index, epoch].
    Made before the loader's processes fork (its lock is inherited)."""

    NEXT, ARRIVED, EPOCH, START, LOADED, LOADED_EPOCH, LOADED_SAMPLE = range(7)

    def __init__(self, n: int = 96, batch_size: int = 8, shuffle: bool = True):
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle
        self.lock, self.shared = ctx.Lock(), ctx.RawArray("q", 7)

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's order, over all workers."""
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng(epoch).permutation(self.n)

    def _loaded(self, epoch: int):
        """(epoch, its first sample): the loaded state's, if not older."""
        s = self.shared
        if s[self.LOADED] and s[self.LOADED_EPOCH] >= epoch:
            return s[self.LOADED_EPOCH], s[self.LOADED_SAMPLE]
        return epoch, 0

    def _begin_pass(self, workers: int) -> tuple[int, int]:
        s = self.shared
        with self.lock:
            if s[self.ARRIVED] % workers == 0:  # the pass's first copy decides it
                s[self.EPOCH], s[self.START] = self._loaded(s[self.NEXT])
                s[self.NEXT] = s[self.EPOCH] + 1
            s[self.ARRIVED] += 1
            return s[self.EPOCH], s[self.START]

    def __iter__(self):
        from loader import get_worker_info

        info = get_worker_info()
        w, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start = self._begin_pass(workers)
        rest = self.order(epoch)[start:]
        bs = self.batch_size
        for j in range(w, -(-len(rest) // bs), workers):
            for i in rest[j * bs:(j + 1) * bs]:
                yield np.array([i, epoch])

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict:
        epoch, offset = self._loaded(self.shared[self.NEXT] - 1)
        return {"epoch": int(epoch),
                "sample_in_epoch": int(num_samples if from_beginning else offset + num_samples)}

    def load_state_dict(self, state: dict) -> None:
        s = self.shared
        s[self.LOADED_EPOCH], s[self.LOADED_SAMPLE] = state["epoch"], state["sample_in_epoch"]
        s[self.LOADED] = 1


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
