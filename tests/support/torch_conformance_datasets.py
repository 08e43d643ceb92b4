"""Datasets, samplers and collate functions shared by test_torch_conformance.py
(and upstream's datasets that other tests of the torch layer use too).

They live in their own importable module (not in the test file) so that
workers started by spawn or forkserver can unpickle them by name, and so that
a child process started by a test can build the same objects.  Written for
this suite; each class says which upstream scenario it stands for.
"""

import ctypes
import math
import multiprocessing
import os
import sys
import time
from collections import namedtuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

# Barriers and shared counters are made with the fork context: the loaders
# under test fork their workers, and the scenarios that use these objects
# only ever run with fork workers.
FORK = multiprocessing.get_context("fork")


def worker_info():
    """torch's get_worker_info(): the loader must make it work in its workers too."""
    return torch.utils.data.get_worker_info()


# --- map-style ---------------------------------------------------------------

class Indexed(Dataset):
    """Item i is the Python int i (upstream CountingDataset)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class NoGetItem(Dataset):
    """Has a length but no __getitem__: torch's Dataset base raises
    NotImplementedError for every index (upstream ErrorDataset)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


class Segfaults(Dataset):
    """Reading address 0 kills the worker with SIGSEGV (upstream SegfaultDataset)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return ctypes.string_at(0)


class ExitsAbruptly(Dataset):
    """The worker records its pid, then leaves with os._exit(3) (no cleanup)."""

    def __init__(self, n):
        self.n = n
        self.pid = FORK.Value("l", 0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.pid.value = os.getpid()
        os._exit(3)


class SlowFirstItem(Dataset):
    """The first item each copy serves takes sleep_s seconds (upstream SleepDataset)."""

    def __init__(self, n, sleep_s):
        self.n = n
        self.sleep_s = sleep_s
        self.done_sleeping = False

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not self.done_sleeping:
            time.sleep(self.sleep_s)
            self.done_sleeping = True
        return i


class InitialSeed(Dataset):
    """Every item is torch.initial_seed() of the process serving it (upstream SeedDataset)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.initial_seed()


class BarrierDataset(Dataset):
    """A barrier across workers: the first call of sync() in each of
    num_workers processes blocks until all of them have called it, so every
    worker serves at least one item (upstream SynchronizedDataset)."""

    def __init__(self, n, batch_size, num_workers):
        assert n >= batch_size * num_workers, "scenario needs an item for every worker"
        self.n = n
        self.num_workers = num_workers
        self.arrived = FORK.Value("i", 0, lock=True)
        self.gate = FORK.Semaphore(0)

    def sync(self):
        with self.arrived.get_lock():
            self.arrived.value += 1
            if self.arrived.value == self.num_workers:
                self.gate.release()
        self.gate.acquire()
        self.gate.release()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        raise NotImplementedError


class BarrierSeed(BarrierDataset):
    """Item: torch.initial_seed() of the worker, after the barrier (upstream SynchronizedSeedDataset)."""

    def __getitem__(self, i):
        self.sync()
        return torch.initial_seed()


class BarrierWorkerValue(BarrierDataset):
    """Item: self.value, which only worker_init_fn sets in the worker's copy
    (upstream TestWorkerInfoDataset)."""

    def __getitem__(self, i):
        self.sync()
        return torch.tensor(self.value)


class EmptyTensors(Dataset):
    """Every item is an empty tensor (upstream EmptyTensorDataset)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.empty(0)


class WholeBatchDataset(Dataset):
    """__getitem__ receives a whole list of indices (upstream BulkLoadingDataset)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, indices):
        assert isinstance(indices, (list, tuple)), f"expected a list of indices, got {type(indices)}"
        return torch.as_tensor(indices)


class ShuffledChunks(Sampler):
    """Yields a random permutation of the dataset's indices in lists of
    batch_size (upstream BulkLoadingSampler)."""

    def __init__(self, dataset, batch_size):
        self.n = len(dataset)
        self.batch_size = batch_size

    def __iter__(self):
        for chunk in torch.randperm(self.n).split(self.batch_size):
            yield chunk.tolist()

    def __len__(self):
        return math.ceil(self.n / self.batch_size)


class CustomList(list):
    pass


class CustomDict(dict):
    pass


class FromList(Dataset):
    """Serves the given Python objects as they are."""

    def __init__(self, items):
        self.items = list(items)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class CharAndIndex(Dataset):
    """Item i is (the i-th character of '12345', i) (upstream StringDataset)."""

    text = "12345"

    def __len__(self):
        return len(self.text)

    def __getitem__(self, i):
        return self.text[i], i


class NestedDict(Dataset):
    """Item i: {'a_tensor': 4x2 filled with i, 'another_dict': {'a_number': i}} (upstream DictDataset)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"a_tensor": torch.full((4, 2), float(i)), "another_dict": {"a_number": i}}


Record = namedtuple("Record", ["data", "label", "random_tensor"])
Pair = namedtuple("Pair", ["positive", "negative"])


class NamedTuples(Dataset):
    """Item i: Record(data=Pair(i, -i), label=str(i), random_tensor=3 random floats)
    (upstream NamedTupleDataset)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return Record(data=Pair(positive=i, negative=-i), label=str(i), random_tensor=torch.randn(3))


class StartMustStayZero(Dataset):
    """Fails unless the copy serving it saw start == 0 (upstream DummyDataset).
    The main process changes `start` between epochs; persistent workers keep
    the copy they were started with."""

    def __init__(self):
        self.data = list(range(10))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if torch.is_tensor(i):
            i = i.tolist()
        assert self.start == 0, f"worker's dataset copy has start={self.start}"
        return self.data[i]


class TagsWorker(Dataset):
    """Item i: (id of the worker that served it, data[i]); the id is set by
    the bound method worker_init_fn in the worker's copy (upstream TestWorkerQueueDataset)."""

    def __init__(self, data):
        self.data = data
        self.worker_id = None

    def worker_init_fn(self, worker_id):
        self.worker_id = worker_id

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.worker_id, self.data[i]


class Conv(Dataset):
    """Runs a convolution in the parent before the fork and in the worker (upstream ConvDataset)."""

    def __init__(self):
        self.x = torch.ones(1, 1, 24000)
        self[0]

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.nn.functional.conv1d(self.x, torch.ones(1, 1, 2))


class SlowIndex(Dataset):
    """Item i: (worker id, i); index slow_index takes 1 s (upstream TestSlowIndexDataset)."""

    def __init__(self, n, slow_index):
        self.n = n
        self.slow_index = slow_index

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        wid = worker_info().id
        if i == self.slow_index:
            time.sleep(1.0)
        return wid, i


class ExitScenarioMap(Dataset):
    """Item i: tensor([i]); once error_event is set, the last worker raises
    RuntimeError('Worker error') (upstream TestProperExitDataset)."""

    def __init__(self, n, error_event):
        self.n = n
        self.error_event = error_event

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = worker_info()
        if self.error_event is not None and self.error_event.is_set() and info.id == info.num_workers - 1:
            raise RuntimeError("Worker error")
        return torch.tensor([i])


class GetItems(Dataset):
    """A dataset with a batched __getitems__ next to __getitem__."""

    def __init__(self, values):
        self.values = values

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        return self.values[i]

    def __getitems__(self, indices):
        return [self.values[i] for i in indices]


class RaisesFor(Dataset):
    """Index bad_index raises exc_type(message); the others return their index."""

    def __init__(self, n, bad_index, exc_type, message):
        self.n = n
        self.bad_index = bad_index
        self.exc_type = exc_type
        self.message = message

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad_index:
            raise self.exc_type(self.message)
        return i


# --- iterable-style ------------------------------------------------------------

class CountingIterable(IterableDataset):
    """Yields 0..n-1 in every process that iterates it; has __len__ n
    (upstream CountingIterableDataset)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


class CountingIterableNoLen(IterableDataset):
    """Yields 0..n-1; no __len__."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class PerWorkerRange(IterableDataset):
    """Worker k yields range(sizes[k]); only usable in workers
    (upstream WorkerSpecificIterableDataset)."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        info = worker_info()
        assert info is not None, "get_worker_info() returned None inside a worker"
        return iter(range(self.sizes[info.id]))

    def __len__(self):
        return sum(self.sizes)


class RaisesOnIter(IterableDataset):
    """__iter__ itself fails (upstream ErrorIterableDataset)."""

    def __iter__(self):
        raise RuntimeError("Error in __iter__")


class WorkerIdStream(IterableDataset):
    """Each of the workers yields its own id, length // num_workers times
    (upstream TestMultiEpochDataset)."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        info = worker_info()
        assert info is not None, "get_worker_info() returned None inside a worker"
        for _ in range(self.length // info.num_workers):
            yield info.id

    def __len__(self):
        return self.length


class AffinityOfWorker(IterableDataset):
    """Yields the CPU numbers the worker may run on (upstream SetAffinityDataset)."""

    def __init__(self, expected_cpu):
        self.expected_cpu = expected_cpu

    def __iter__(self):
        return iter(os.sched_getaffinity(0))


def pin_worker_to_expected_cpu(worker_id):
    dataset = worker_info().dataset
    os.sched_setaffinity(0, [dataset.expected_cpu])


class SlowMiddle(IterableDataset):
    """The sharding recipe: worker k of n yields (k, i) for its contiguous
    ceil(len/n) slice of [start, end); item `mid` takes 1 s
    (upstream TestSlowIterableDataset)."""

    def __init__(self, start, end):
        self.start = start
        self.end = end
        self.mid = math.ceil((end - start) / 2)

    def _slice(self, wid, lo, hi):
        for i in range(lo, hi):
            if i == self.mid:
                time.sleep(1.0)
            yield wid, i

    def __iter__(self):
        info = worker_info()
        per_worker = math.ceil((self.end - self.start) / info.num_workers)
        lo = self.start + info.id * per_worker
        return self._slice(info.id, lo, min(lo + per_worker, self.end))


class ExitScenarioIterable(IterableDataset):
    """Yields tensor(-1000) `n` times per process; once error_event is set,
    the last worker raises RuntimeError('Worker error')
    (upstream TestProperExitIterableDataset)."""

    def __init__(self, n, error_event):
        self.n = n
        self.left = n
        self.error_event = error_event

    def __len__(self):
        return self.n

    def __iter__(self):
        return self

    def __next__(self):
        info = worker_info()
        if self.error_event is not None and self.error_event.is_set() and info.id == info.num_workers - 1:
            raise RuntimeError("Worker error")
        self.left -= 1
        if self.left < 0:
            raise StopIteration
        return torch.tensor(-1000)


class SeedReport(IterableDataset):
    """Each worker yields one record of its random state right after start:
    (id, seed from get_worker_info, torch.initial_seed(), random.random(),
    numpy's global random_sample(), torch.rand(()))."""

    def __iter__(self):
        import random

        info = worker_info()
        yield (info.id, info.seed, torch.initial_seed(), random.random(),
               float(np.random.random_sample()), float(torch.rand(())))


# --- worker_init_fn and collate_fn -----------------------------------------------

def seed_12345(worker_id):
    """upstream init_fn"""
    torch.manual_seed(12345)


def fail_in_init(worker_id):
    """upstream error_worker_init_fn"""
    raise RuntimeError("Error in worker_init_fn")


def silence_stderr(worker_id):
    """Points the worker's fd 2 at /dev/null, so an expected crash prints
    nothing (upstream disable_stderr)."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


class PairBatch:
    """A custom batch type built by a collate_fn (upstream SimpleCustomBatch)."""

    def __init__(self, samples):
        inputs, targets = zip(*samples)
        self.inp = torch.stack(inputs, 0)
        self.tgt = torch.stack(targets, 0)

    def pin_memory(self):
        self.inp = self.inp.pin_memory()
        self.tgt = self.tgt.pin_memory()
        return self

    def is_pinned(self):
        return self.inp.is_pinned() and self.tgt.is_pinned()


def collate_pair_batch(samples):
    return PairBatch(samples)


def collate_packed(samples):
    """Stacks the first fields time-major and packs them with random lengths."""
    data = torch.stack([s[0] for s in samples], 1)
    t, b = data.size()
    lengths = torch.randint(1, t, size=(b,), dtype=torch.int64)
    return torch.nn.utils.rnn.pack_padded_sequence(data, lengths, enforce_sorted=False)


def collate_packed_batch_first(samples):
    data = torch.stack([s[0] for s in samples], 0)
    b, t = data.size()
    lengths = torch.randint(1, t, size=(b,), dtype=torch.int64)
    return torch.nn.utils.rnn.pack_padded_sequence(data, lengths, batch_first=True, enforce_sorted=False)


class NamedTupleDataset(Dataset):
    """Upstream TestNamedTupleDataLoader's dataset: the namedtuple lives in
    the class body, so its qualname is 'Batch' and pickle cannot find it by
    name.  test_dataloader_habits.py loads it without workers (nothing may
    need pickling), test_dataloader_integrations.py with two (the class
    travels by identity: the workers are forked)."""
    Batch = namedtuple("Batch", ["data", "label"])

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.Batch(data=torch.full((2,), i), label=i)
