"""A pool of exactly one batch never stalls the loader (NOTE [ Memory goes
to batches in order ] in loader/batcher/runs.py, and batches main holds back in
NOTE [ Kept batch memory ] in loader/native/leases.pxi).

With memory_cap_bytes at one slab, every batch waits for the one before it
to be handed out and dropped.  Before, the loader waited until its timeout
whenever that one slab went to a batch that could not be handed out yet: a
batch that arrived out of order or one of the next epoch (main held it
back), or one laid out ahead while the batch before it waited (no worker
could fill it).  Every test here runs epochs of hundreds of batches, in
order and first-ready, and checks every sample; iterable datasets too, and
a shuffle buffer, whose windows the pool must hold (else a MemoryError)."""

import time

import numpy as np
import pytest

from loader import ShmLoader, get_worker_info

pytestmark = pytest.mark.timeout(120)

PAGE = 4096  # a slab is whole pages: these batches take one page


class Jittered:
    """Sample i: i in three leaves (an array, an int, a str); loading it
    takes 0-1.6 ms by a fixed pattern, so the workers finish out of turn."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep((i * 7919 % 5) * 0.0004)
        return {"x": np.full((2, 3), i, np.float32), "i": i, "name": f"s{i}"}


def samples(batch) -> list:
    i = batch["i"].tolist()
    np.testing.assert_array_equal(batch["x"], np.broadcast_to(batch["i"][:, None, None],
                                                              (len(i), 2, 3)))
    assert batch["name"] == [f"s{k}" for k in i]
    return i


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("in_order", [True, False])
def test_a_pool_of_one_batch_delivers_every_epoch(in_order, batch_size, workers, mode):
    """Three epochs of 300 samples, each followed by an iterator dropped
    after two batches, with the next epoch started ahead (persistent
    workers): every epoch whole."""
    n = 300
    with ShmLoader(Jittered(n), batch_size=batch_size, num_workers=workers, worker_mode=mode,
                   memory_cap_bytes=PAGE, in_order=in_order, timeout=20) as loader:
        for _ in range(3):
            got = [k for b in loader for k in samples(b)]
            assert got == list(range(n)) if in_order else sorted(got) == list(range(n))
            peek = iter(loader)
            assert len(samples(next(peek))) == batch_size
            next(peek)
            del peek


class SlowFirst(Jittered):
    """Sample 0 takes 0.3 s: with one sample a batch, batch 1 is complete
    long before batch 0 asks for memory."""

    def __getitem__(self, i):
        if i == 0:
            time.sleep(0.3)
        return super().__getitem__(i)


def test_a_batch_received_out_of_turn_moves_out_of_a_pool_of_one_batch():
    """Batch 1 takes the only slab while batch 0 loads; main cannot hand it
    out before batch 0, so it copies it out of the pool, and says so in
    stats().  The loop keeps no batch while it calls next(), so no slab it
    keeps is moved out: what stats() counts is what main held back."""
    with ShmLoader(SlowFirst(40), batch_size=1, num_workers=2, memory_cap_bytes=PAGE,
                   timeout=20) as loader:
        got = []
        for b in loader:
            got += samples(b)
            del b
        assert got == list(range(40))
        stats = loader.stats()
    assert stats["kept_slabs_moved_out"] >= 1
    assert stats["kept_bytes_moved_out"] == PAGE * stats["kept_slabs_moved_out"]


def test_a_pool_of_one_batch_with_kept_batches_and_a_slow_step():
    """The loop keeps every 10th batch whole and takes 1 ms a step: kept
    slabs and held-back batches both move out, every kept batch stays
    exact."""
    n = 200
    kept = []
    with ShmLoader(Jittered(n), batch_size=2, num_workers=2, memory_cap_bytes=PAGE,
                   timeout=20) as loader:
        for epoch in range(2):
            got = []
            for k, b in enumerate(loader):
                got += samples(b)
                if k % 10 == 0:
                    kept.append(b)
                time.sleep(0.001)
            assert got == list(range(n))
    assert [samples(b) for b in kept] == [[i, i + 1] for _ in range(2) for i in range(0, n, 20)]


class Stream:
    """An iterable dataset of n samples, shared out among the workers;
    sample i as in Jittered."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, self.n, workers):
            time.sleep((i * 7919 % 5) * 0.0004)
            yield {"x": np.full((2, 3), i, np.float32), "i": i, "name": f"s{i}"}


def round_robin(n: int, workers: int, batch_size: int) -> list:
    """Stream's samples in order: each worker's batches in turn, as
    PyTorch delivers an iterable dataset's (every stream here is whole
    batches long)."""
    streams = [list(range(w, n, workers)) for w in range(workers)]
    return [k for j in range(0, len(streams[0]), batch_size)
            for s in streams for k in s[j:j + batch_size]]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("in_order", [True, False])
def test_an_iterable_dataset_with_a_pool_of_one_batch(in_order, batch_size):
    n = 300
    with ShmLoader(Stream(n), batch_size=batch_size, num_workers=2, memory_cap_bytes=PAGE,
                   in_order=in_order, timeout=20) as loader:
        for _ in range(3):
            got = [k for b in loader for k in samples(b)]
            if in_order:
                assert got == round_robin(n, 2, batch_size)
            else:
                assert sorted(got) == list(range(n))


@pytest.mark.parametrize("in_order", [True, False])
def test_a_shuffle_buffer_in_the_smallest_pool_that_lets_it_load(in_order):
    """shuffle_buffer=8 over 2 workers, one sample a batch: each worker
    fills 4 batches at once, and loading goes on with one worker's whole
    window and the other's short of one: 7 one-page batches (before, the
    batches one worker laid out ahead took the pool from the other's next
    batch, and the loader waited until its timeout even with 8)."""
    n = 300
    with ShmLoader(Stream(n), batch_size=1, num_workers=2, shuffle_buffer=8, seed=3,
                   memory_cap_bytes=7 * PAGE, in_order=in_order, timeout=20) as loader:
        for _ in range(3):
            got = [k for b in loader for k in samples(b)]
            assert sorted(got) == list(range(n)) and got != list(range(n))


def test_a_shuffle_buffer_the_pool_cannot_hold_is_a_memory_error_naming_both_sizes():
    """One page short of that: a MemoryError at the first batch that says
    what is needed, again at every next() of that epoch, and again from
    the next epoch.  (Without the check, 6 pages waited for ever, by
    default, for 3 seeds of 8: each worker short of the one batch it drew.)"""
    need = 7 * PAGE
    with ShmLoader(Stream(300), batch_size=1, num_workers=2, shuffle_buffer=8, seed=3,
                   memory_cap_bytes=need - PAGE, timeout=20) as loader:
        for _ in range(2):
            it = iter(loader)
            for _ in range(2):
                with pytest.raises(MemoryError) as info:
                    next(it)
                text = str(info.value)
                assert ("shuffle_buffer=8 fills 4 batches at once in each of the 2 workers: "
                        f"loading needs 7 batches of {PAGE} bytes in memory ({need} bytes)") in text
                assert (f"memory_cap_bytes is {need - PAGE}: pass memory_cap_bytes >= {need}"
                        in text)
