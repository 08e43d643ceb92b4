"""What a worker knows of itself and how its generators are seeded: the
WorkerInfo that get_worker_info() returns (and torch's get_worker_info()
inside a worker process), the per-process seeds as PyTorch's workers take
them, and reproducible=True's per-sample seeds (SampleSeeder)."""

from __future__ import annotations

import _random
import random
import threading
from dataclasses import dataclass

import numpy as np

from loader._native import derived_seeds
from loader.shared.optional import imported_torch

_worker_info = None              # a worker process's
_thread_info = threading.local()  # a worker thread's (worker_mode="thread")
U64 = (1 << 64) - 1


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker knows about itself (the fields of torch's WorkerInfo,
    plus this process's rank among distributed ones)."""
    id: int
    num_workers: int
    seed: int
    dataset: object
    rank: int = 0
    world_size: int = 1
    rng: object = None
    worker_method: str = "multiprocessing"


def get_worker_info() -> WorkerInfo | None:
    """Inside a worker: its id, the number of workers, its seed and its copy
    of the dataset (and, with distributed=True, its rank and the world
    size; for a worker thread, its own generators in .rng).  None in the
    main process.  torch.utils.data.get_worker_info() answers the same
    inside ShmLoader's worker processes."""
    return getattr(_thread_info, "info", None) or _worker_info


def set_worker_info(info: WorkerInfo) -> None:
    global _worker_info
    if info.worker_method == "thread":
        _thread_info.info = info  # torch's is one per process: not set for threads
        return
    _worker_info = info
    torch = imported_torch()
    if torch is not None:
        # torch.utils.data.get_worker_info() reads this module global, so the
        # standard sharding recipe for iterable datasets works unchanged.
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset)


def seed_worker(base_seed: int, worker_id: int, torch_rules: bool) -> int:
    """Seed the generators a dataset may use, once per worker process, as
    PyTorch's workers are seeded: random and torch with base_seed + id.
    numpy's global generator gets a seed of its own: torch's own derivation
    when torch_rules (so DataLoader matches torch), else one of
    derived_seeds' independent streams.  Returns the worker's seed."""
    seed = (base_seed + worker_id) & U64
    random.seed(seed)
    torch = imported_torch()
    if torch is not None:
        torch.manual_seed(seed)
    if torch_rules and torch is not None:
        from torch.utils.data._utils.worker import _generate_state

        np.random.seed(_generate_state(base_seed, worker_id))
    else:
        np.random.seed(derived_seeds(base_seed & U64, 0, worker_id + 1, 0)[1])
    return seed


class Generators:
    """get_worker_info().rng: the generators a worker's dataset should draw
    from: .random (a random.Random), .numpy (a numpy RandomState), .torch
    (a torch.Generator, or None without torch).  In a worker process they
    are the global ones, which the loader seeds; a worker thread has its
    own (threads share the process's global ones, which the loader leaves
    alone)."""

    def __init__(self, own_seed: int | None):
        torch = imported_torch()
        if own_seed is None:
            self.random, self.numpy = random._inst, np.random.mtrand._rand
            self.torch = torch.default_generator if torch is not None else None
            return
        self.random = random.Random()
        self.numpy = np.random.RandomState()
        self.torch = torch.Generator() if torch is not None else None
        SampleSeeder(own_seed, self)(0, 0, 0)


class SampleSeeder:
    """reproducible=True: before every sample, random, numpy's global
    generator and torch's get seeds derived from (seed, epoch, stream,
    item) alone, so a sample's random augmentation never depends on which
    worker loads it, or when.  (For a worker thread: its own generators.)"""

    def __init__(self, seed: int, generators: Generators | None = None):
        self.seed = seed & U64
        g = generators or Generators(None)
        self.torch_gen, self.random, self.numpy = g.torch, g.random, g.numpy
        # random.seed(int) is the C seed plus gauss_next = None (random.py);
        # calling them directly saves a Python frame per sample.
        self.seed_random = _random.Random.seed

    def __call__(self, epoch: int, stream: int, item: int) -> None:
        s_random, s_numpy, s_torch = derived_seeds(self.seed, epoch & U64, stream, item & U64)
        self.seed_random(self.random, s_random)
        self.random.gauss_next = None
        self.numpy.seed(s_numpy)
        if self.torch_gen is not None:
            self.torch_gen.manual_seed(s_torch)
