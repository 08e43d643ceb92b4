"""reproducible=True (ShmLoader's default when a seed is given): random
augmentation in dataset[i] gives the same batches whatever the worker
count, the timing or the ordering mode, because random, numpy's global
generator and torch's are seeded from (seed, epoch, index) before every
sample, with independent streams (issue 8, item 6)."""

import random
import time

import numpy as np
import pytest

from loader import ShmLoader, get_worker_info

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)


class Augmented:
    """Sample i: its index, draws from the three generators, and (jitter)
    a random pause so that which worker loads what varies run to run."""

    def __init__(self, n=300, jitter=False):
        self.n, self.jitter = n, jitter

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.jitter:
            time.sleep(random.Random().random() * 0.002)  # its own generator: not the seeded one
        return {"i": i, "np": np.random.rand(3), "py": random.random(),
                "t": torch.rand(2), "n": np.random.randint(1 << 30)}


def by_index(loader):
    """Every sample of an epoch as {index: its draws}."""
    out = {}
    for b in loader:
        for k, i in enumerate(b["i"].tolist()):
            out[i] = (tuple(b["np"][k].tolist()), float(b["py"][k]), tuple(b["t"][k].tolist()),
                      int(b["n"][k]))
    return out


def run(epochs=2, **kwargs):
    with ShmLoader(Augmented(**{k: kwargs.pop(k) for k in ["jitter"] if k in kwargs}),
                   batch_size=16, seed=11, shuffle=True, **kwargs) as loader:
        assert loader.reproducible
        return [by_index(loader) for _ in range(epochs)]


def test_the_same_draws_whatever_the_workers_the_timing_and_the_mode():
    reference = run(num_workers=1)
    assert len(reference[0]) == 300 and reference[0] != reference[1]  # epochs differ
    assert run(num_workers=3, jitter=True) == reference
    assert run(num_workers=2, in_order=False, jitter=True) == reference
    assert run(num_workers=0) == reference                             # in the main process


def test_in_order_batches_are_identical_across_runs_and_worker_counts():
    def batches(workers):
        with ShmLoader(Augmented(100, jitter=True), batch_size=8, seed=4, shuffle=True,
                       num_workers=workers, output="torch") as loader:
            return [[(b["i"].tolist(), b["np"].tolist(), b["t"].tolist()) for b in loader]
                    for _ in range(2)]

    assert batches(2) == batches(4)


def test_another_seed_gives_other_draws_and_the_generators_are_independent():
    a = run(epochs=1, num_workers=2)
    with ShmLoader(Augmented(), batch_size=10, seed=12, shuffle=True, num_workers=2) as loader:
        other = by_index(loader)
    assert other.keys() == a[0].keys() and all(other[i] != a[0][i] for i in other)
    # numpy's and torch's streams share no values (the same seed in both Mersenne
    # Twisters would make torch.rand equal np.random.rand to float32 precision)
    for draws in a[0].values():
        assert not np.allclose(draws[0][:2], draws[2], atol=1e-6)


def test_the_main_process_generators_are_left_alone_with_num_workers_0():
    np.random.seed(1)
    expected = np.random.rand()
    np.random.seed(1)
    with ShmLoader(Augmented(20), batch_size=4, seed=2, num_workers=0) as loader:
        list(loader)
    assert np.random.rand() == expected


class Streams:
    def __iter__(self):
        w = get_worker_info().id
        for k in range(20):
            yield np.array([w, k, np.random.randint(1 << 30)])


def test_iterable_streams_are_reproducible_for_a_worker_count():
    def epochs():
        with ShmLoader(Streams(), batch_size=4, num_workers=2, seed=9) as loader:
            return [[b.tolist() for b in loader] for _ in range(2)]

    first = epochs()
    assert first == epochs() and first[0] != first[1]


def test_without_reproducible_worker_init_fn_seeds_hold_across_epochs():
    """reproducible=False: workers are seeded once, as PyTorch's are, and
    what worker_init_fn seeds is not overwritten at the next epoch: the
    epochs continue one stream per worker."""
    def init(worker_id):
        np.random.seed(1000 + worker_id)

    class Draw:
        def __iter__(self):
            w = get_worker_info().id
            for _ in range(3):
                yield np.array([w, np.random.randint(1 << 30)])

    with ShmLoader(Draw(), batch_size=3, num_workers=2, seed=1, reproducible=False,
                   worker_init_fn=init) as loader:
        got = [{int(b[0, 0]): b[:, 1].tolist() for b in loader} for _ in range(2)]
    for w in (0, 1):
        stream = np.random.RandomState(1000 + w).randint(1 << 30, size=6).tolist()
        assert got[0][w] + got[1][w] == stream
