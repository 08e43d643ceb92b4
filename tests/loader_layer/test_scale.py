"""Issue 19: an epoch's cost independent of the dataset's size.

The seeded order is a bijection computed per position (NOTE [ The seeded
order ] in loader/order/indices.py): checked here exhaustively for small n,
sampled near 2**31 and 2**33, against a plain-Python rendering of the
documented generator, across epochs, seeds, worker counts, ordering modes
and ranks; then whole loaders over 10,000,000 and 2,000,000,000 samples,
with a resume state of a few hundred bytes."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from loader import ShmLoader
from loader._native import SeededOrder
from loader.order.indices import epoch_order, shard
from capped import run_capped
from shared_datasets import Ids

# --- the generator, as documented, in plain Python ---------------------------------

_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def reference_index(n: int, seed: int, epoch: int, q: int) -> int:
    """NOTE [ The seeded order ]: the 6-round Feistel network over
    [0, 2**bits) keyed by (seed, epoch), cycle-walked into [0, n)."""
    bits = max(2, (n - 1).bit_length())
    state = _mix64(seed ^ 0x6A09E667F3BCC909) ^ _mix64((epoch + 0x3C6EF372FE94F82B) & _M64)
    keys = []
    for _ in range(6):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        keys.append(_mix64(state))

    def encrypt(x):
        lo, hi = bits >> 1, bits - (bits >> 1)
        for k in keys:
            low = x & ((1 << lo) - 1)
            high = (x >> lo) ^ (_mix64(low ^ k) & ((1 << hi) - 1))
            x = (low << hi) | high
            lo, hi = hi, lo
        return x

    q = encrypt(q)
    while q >= n:
        q = encrypt(q)
    return q


def full(n, seed, epoch, rank=0, world=1):
    out = np.empty(-(-n // world), np.int64)
    SeededOrder(n, seed, epoch, True, rank, world).fill(out, 0)
    return out


# --- the permutation ---------------------------------------------------------------

SMALL = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 61, 64, 97, 127, 128, 1009, 1024, 4093, 4096,
         65521, 65536, 100_003]


@pytest.mark.parametrize("n", SMALL)
def test_the_order_is_a_permutation_for_every_small_n(n):
    """Exhaustively: primes, powers of two and their neighbours; every
    index exactly once, for several seeds and epochs."""
    for seed, epoch in [(0, 1), (5, 1), (5, 2), ((1 << 63) - 1, 7), (1 << 63, 3)]:
        order = full(n, seed, epoch)
        assert np.array_equal(np.sort(order), np.arange(n)), (n, seed, epoch)


def test_the_order_is_the_documented_generator():
    """The compiled network is the one NOTE [ The seeded order ] describes
    (the order of a seed is part of what a checkpoint relies on)."""
    for n in [2, 5, 64, 1000, 4099]:
        assert full(n, 9, 2).tolist() == [reference_index(n, 9, 2, q) for q in range(n)]
    for n in [(1 << 31) - 1, 1 << 31, (1 << 33) + 17]:
        o = SeededOrder(n, 123, 4, True)
        for q in [0, 1, n // 3, n - 2, n - 1]:
            assert o.at(q) == reference_index(n, 123, 4, q), (n, q)


@pytest.mark.parametrize("n", [(1 << 31) - 1, 1 << 31, (1 << 31) + 1, (1 << 33) - 5,
                               (1 << 33) + 7])
def test_the_order_near_2_31_and_2_33_is_injective_on_large_samples(n):
    """Sampled: 4,000,000 positions (two contiguous windows, at the start
    and the end, and 1,000,000 random ones) give distinct indices in
    [0, n).  Near 2**31 the network is of 31 or 32 bits, near 2**33 of 33
    or 34: the cut into unequal halves is exercised both ways."""
    o = SeededOrder(n, 77, 1, True)
    parts = []
    for first in (0, n - 1_500_000):
        out = np.empty(1_500_000, np.int64)
        o.fill(out, first)
        parts.append(out)
    positions = np.random.default_rng(n).integers(1_500_000, n - 1_500_000, 1_000_000)
    positions = np.unique(positions)
    out = np.empty(len(positions), np.int64)
    o.take(out, positions)
    parts.append(out)
    got = np.concatenate(parts)
    assert got.min() >= 0 and got.max() < n
    assert len(np.unique(got)) == len(got) == 3_000_000 + len(positions)


def test_orders_differ_between_epochs_and_seeds_and_look_uniform():
    n = 100_000
    orders = {(s, e): full(n, s, e) for s in (1, 2) for e in (1, 2, 3)}
    keys = list(orders)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            same = int((orders[a] == orders[b]).sum())
            assert same < 20, (a, b, same)  # ~1 expected for independent permutations
    # where index 0..9 land over 2,000 (seed, epoch) pairs of a 10-index order: uniform
    counts = np.zeros((10, 10), np.int64)
    for s in range(200):
        for e in range(10):
            counts[np.arange(10), full(10, s, e)] += 1
    assert counts.min() > 120 and counts.max() < 290, counts  # expected 200 each


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 64, 10_007])
def test_ranks_cut_the_order_as_torchs_distributed_sampler(world, n):
    """Rank r's order is torch's DistributedSampler cut (padded with the
    order's start) of the whole order: equal shares, disjoint but for the
    padding, together every index."""
    whole = epoch_order(n, 3, 2)
    shares = [epoch_order(n, 3, 2, rank=r, world=world) for r in range(world)]
    for r, share in enumerate(shares):
        assert np.array_equal(share, shard(whole, r, world)), (r, world)
    assert {len(s) for s in shares} == {-(-n // world)}
    together = np.concatenate(shares)
    assert set(together.tolist()) == set(range(n))
    assert len(together) - len(set(together.tolist())) == -(-n // world) * world - n


def _epoch_snapshot(n, epochs=2, **kw):
    out = []
    with ShmLoader(Ids(n), **kw) as ld:
        for _ in range(epochs):
            out.append([b.copy() for b in ld])
    return out


def test_the_loader_gives_the_order_whatever_the_workers_and_mode():
    """200,003 samples, batches of 1,000, two epochs: the same order with
    0, 1 and 3 workers in order; first-ready, the same batches' contents
    (a batch is the next 1,000 samples to arrive, so its rows may mix,
    but every sample exactly once)."""
    n = 200_003
    ref = [epoch_order(n, 42, e) for e in (1, 2)]
    assert not np.array_equal(ref[0], ref[1])
    for workers in (0, 1, 3):
        got = _epoch_snapshot(n, batch_size=1000, shuffle=True, seed=42, num_workers=workers)
        for e in range(2):
            assert np.array_equal(np.concatenate(got[e]), ref[e]), (workers, e)
    got = _epoch_snapshot(n, batch_size=1000, shuffle=True, seed=42, num_workers=3, in_order=False)
    for e in range(2):
        assert np.array_equal(np.sort(np.concatenate(got[e])), np.arange(n))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_distributed_loaders_share_each_epoch_exactly(world):
    n = 50_001
    per_rank = [_epoch_snapshot(n, batch_size=500, shuffle=True, seed=8, num_workers=2,
                                distributed=(r, world)) for r in range(world)]
    for e in range(2):
        shares = [np.concatenate(per_rank[r][e]) for r in range(world)]
        assert {len(s) for s in shares} == {-(-n // world)}
        for r in range(world):
            assert np.array_equal(shares[r], epoch_order(n, 8, e + 1, r, world))
        assert set(np.concatenate(shares).tolist()) == set(range(n))


# --- resuming with a small state ---------------------------------------------------

class FastIds(Ids):
    """Ids, fetched a batch per call (NOTE [ Batched fetch ]): 10,000,000
    samples in seconds."""

    def __getitems__(self, indices):
        return indices


@pytest.mark.parametrize("in_order", [True, False])
def test_a_10m_epoch_resumes_from_a_few_hundred_bytes_exactly(in_order):
    """10,000,000 samples, batches of 65,536: a state taken after 40
    batches of the first epoch is a few hundred bytes; a new loader given
    it yields exactly the rest of that epoch (every remaining sample once,
    none delivered before, in the epoch's order when in order), then the
    second epoch as an uninterrupted run would."""
    n, B = 10_000_000, 1 << 16
    kw = dict(batch_size=B, shuffle=True, seed=19, num_workers=2, in_order=in_order)
    first = epoch_order(n, 19, 1)
    with ShmLoader(FastIds(n), **kw) as ld:
        it = iter(ld)
        head = [next(it).copy() for _ in range(40)]
        state = ld.state_dict()
    size = len(pickle.dumps(state))
    assert size < 1024, (size, state["map"])
    assert state["map"]["done_prefix"] + sum(b - a for a, b in state["map"]["done_ranges"]) \
        == 40 * B
    with ShmLoader(FastIds(n), **kw) as ld:
        ld.load_state_dict(state)
        rest = np.concatenate([b for b in ld])
        second = np.concatenate([b for b in ld])
    before = np.concatenate(head)
    assert len(before) + len(rest) == n
    assert np.array_equal(np.sort(np.concatenate([before, rest])), np.arange(n))
    if in_order:
        assert np.array_equal(before, first[:40 * B]) and np.array_equal(rest, first[40 * B:])
    assert np.array_equal(second, epoch_order(n, 19, 2)) if in_order else \
        np.array_equal(np.sort(second), np.arange(n))


def test_first_ready_ranges_stay_few_and_merge():
    """The delivered positions past the prefix are kept as ranges: a
    batch delivered ahead of the prefix is one range; the prefix swallows
    it when the gap fills."""
    from loader.order.progress import DonePositions

    d = DonePositions()
    d.mark(np.arange(100, 200))
    d.mark(np.arange(300, 400))
    assert d.state() == (0, [[100, 200], [300, 400]])
    d.mark(np.arange(200, 300))
    assert d.state() == (0, [[100, 400]])
    d.mark(np.array([5, 3, 4, 0, 1, 2]))
    assert d.state() == (6, [[100, 400]])
    d.mark(np.arange(6, 100))
    assert d.state() == (400, [])


def test_a_format_1_state_loads_unless_it_is_an_old_seeded_shuffle_in_progress():
    """States of the format before ranges: an unshuffled epoch in progress
    resumes exactly; an epoch in progress of the old seeded shuffle (numpy's
    permutation) cannot be resumed by this order, and says so and what to
    do; the loader stays usable."""
    def old(state):
        m = {k: v for k, v in state["map"].items() if k != "done_ranges"}
        m["done_extra"] = [p for a, b in state["map"]["done_ranges"] for p in range(a, b)]
        return dict(state, format="shmloader-state-1", map=m)

    with ShmLoader(Ids(100), batch_size=8, num_workers=2, in_order=False) as ld:
        it = iter(ld)
        got = [next(it).copy() for _ in range(3)]
        state = ld.state_dict()
    with ShmLoader(Ids(100), batch_size=8, num_workers=2) as ld:
        ld.load_state_dict(old(state))
        rest = [x for b in ld for x in b.tolist()]
    assert sorted(rest + [x for b in got for x in b.tolist()]) == list(range(100))

    with ShmLoader(Ids(100), batch_size=8, num_workers=2, shuffle=True, seed=4) as ld:
        it = iter(ld)
        next(it)
        state = ld.state_dict()
        with pytest.raises(ValueError) as raised:
            ld.load_state_dict(old(state))
        text = str(raised.value)
        assert "'format'" in text and "numpy's permutation" in text and "complete=True" in text
        ld.load_state_dict(state)  # its own state still loads
        assert len([x for b in ld for x in b.tolist()]) == 92


# --- 2,000,000,000 samples -----------------------------------------------------------

_HUGE = """
    import pickle
    from loader import ShmLoader
    from loader.order.indices import computed_order

    def tree_kb(ld):
        kids = [c.pid for c in ld._session.procs]
        return rss_kb(os.getpid()) + sum(rss_kb(p) for p in kids)

    class Tiny:
        def __len__(self): return 2_000_000_000
        def __getitem__(self, i): return i

    base = rss_kb(os.getpid())
    t0 = time.perf_counter()
    kw = dict(batch_size=4096, shuffle=True, seed=2024, num_workers=2)
    with ShmLoader(Tiny(), **kw) as ld:
        it = iter(ld)
        first = next(it).copy()
        took = time.perf_counter() - t0
        batches = [first] + [next(it).copy() for _ in range(4)]
        state = ld.state_dict()
        after = [next(it).copy() for _ in range(2)]
        grown = tree_kb(ld) - base * 3   # main and two forks of it
        batcher = rss_kb(ld._session.procs[-1].pid)
    with ShmLoader(Tiny(), **kw) as ld:
        ld.load_state_dict(state)
        it = iter(ld)
        resumed = [next(it).copy() for _ in range(2)]
    print(json.dumps({
        "first_batch_s": took, "state_bytes": len(pickle.dumps(state)),
        "grown_kb": grown, "base_kb": base, "batcher_kb": batcher,
        "head_ok": bool(np.array_equal(np.concatenate(batches),
                                       computed_order(1, 2_000_000_000, 2024, 1, 0, 1,
                                                      2_000_000_000)[0:5 * 4096])),
        "resumed_ok": all(np.array_equal(a, b) for a, b in zip(after, resumed)),
    }))
"""


def test_2e9_samples_start_at_once_in_bounded_memory_and_resume():
    """A shuffled dataset of 2,000,000,000 samples under RLIMIT_DATA 3 GiB
    (so that an O(n) regression fails with a MemoryError, not the OOM
    killer): the first batch within a few seconds, the loader's processes
    growing by less than 100 MB over what they start with, the epoch's
    order as documented, and a state of a few hundred bytes from which a
    new loader goes on with exactly the next batches."""
    got = run_capped(_HUGE, timeout=100)
    assert got["first_batch_s"] < 5, got
    assert got["grown_kb"] < 100 * 1024, got
    assert got["state_bytes"] < 1024, got
    assert got["head_ok"] and got["resumed_ok"], got


# --- samplers, streamed ------------------------------------------------------------

class Strided:
    """A sampler of `n` indices (i * 7919 mod n, a permutation when n is
    prime to 7919), yielded one by one as a generator: list() of it would
    take minutes and gigabytes at a billion."""

    def __init__(self, n, lie=0):
        self.n, self.lie = n, lie

    def __len__(self):
        return self.n + self.lie

    def __iter__(self):
        n = self.n
        return ((i * 7919) % n for i in range(n))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False])
def test_a_billion_index_sampler_starts_at_once_and_resumes(workers, in_order):
    """sampler= of 1,000,000,000 indices is pulled a window ahead of the
    workers (NOTE [ Streamed samplers ]): 300 batches of 4,096 come at
    once and are exactly the sampler's first 1,228,800 indices (in order;
    first-ready: the same set); the order file holds only the window; a
    state resumes with exactly the next batches."""
    import time

    n, B, k = 1_000_000_000, 4096, 300
    expect = (np.arange(k * B, dtype=np.int64) * 7919) % n
    kw = dict(batch_size=B, sampler=Strided(n), num_workers=workers, in_order=in_order)
    t0 = time.perf_counter()
    with ShmLoader(Ids(n), **kw) as ld:
        it = iter(ld)
        first = next(it).copy()
        took = time.perf_counter() - t0
        got = np.concatenate([first] + [next(it).copy() for _ in range(k - 1)])
        if workers:
            run = ld._runs.current
            allocated = os.fstat(ld._session.shared.order_fd(run.id)).st_blocks * 512
            assert allocated < 3 << 20, allocated  # the window, not 8 bytes x 1.2M delivered
        state = ld.state_dict()
        after = np.concatenate([next(it).copy() for _ in range(3)])
    assert took < 5, took
    if in_order:
        assert np.array_equal(got, expect)
    else:  # the first k * B to arrive: distinct, and among those loadable by then (a
        # worker's position may still be loading while later ones arrive)
        loadable = set(((np.arange((k + 64) * B) * 7919) % n).tolist())
        assert len(set(got.tolist())) == len(got) and set(got.tolist()) <= loadable
        assert len(set(got.tolist()) & set(expect.tolist())) >= len(got) - 64 * B
    assert len(pickle.dumps(state)) < 1024
    with ShmLoader(Ids(n), **kw) as ld:
        ld.load_state_dict(state)
        it = iter(ld)
        resumed = np.concatenate([next(it).copy() for _ in range(3)])
    if in_order:
        assert np.array_equal(resumed, after)
        assert np.array_equal(resumed, (np.arange(k * B, (k + 3) * B) * 7919) % n)
    else:  # neither run delivers what was delivered before the state
        assert not set(resumed.tolist()) & set(got.tolist())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streamed_sampler_gives_every_index_of_whole_epochs(workers):
    """100,003 indices in batches of 1,000, two epochs: exactly the
    sampler's sequence each epoch (the sampler is pulled again)."""
    n = 100_003
    got = _epoch_snapshot(n, batch_size=1000, sampler=Strided(n), num_workers=workers)
    expect = (np.arange(n) * 7919) % n
    for e in range(2):
        assert np.array_equal(np.concatenate(got[e]), expect)


def test_a_sampler_shorter_than_its_len_is_a_clear_error():
    with ShmLoader(Ids(1000), batch_size=100, sampler=Strided(1000, lie=500),
                   num_workers=2) as ld:
        with pytest.raises(ValueError) as raised:
            list(ld)
    text = str(raised.value)
    assert "ended after 1000 indices" in text and "len() is 1500" in text


def test_more_than_2_32_units_is_a_clear_error_and_whole_batches_go_past_it():
    """A run's cursor counts units in 32 bits: 5,000,000,000 samples claimed
    one by one is a ValueError saying so and what to do; claimed as whole
    batches (a collate_fn) the epoch starts, in the seeded order."""
    from loader.order.indices import ORDER_PERMUTATION, computed_order

    n = 5_000_000_000
    with ShmLoader(Ids(n), batch_size=512, shuffle=True, seed=1, num_workers=2) as ld:
        with pytest.raises(ValueError) as raised:
            next(iter(ld))
        assert "2**32" in str(raised.value) and "collate_fn" in str(raised.value)
    with ShmLoader(Ids(n), batch_size=512, shuffle=True, seed=1, num_workers=2,
                   collate_fn=np.array) as ld:
        first = next(iter(ld))
    assert np.array_equal(first, computed_order(ORDER_PERMUTATION, n, 1, 1, 0, 1, n)[0:512])
