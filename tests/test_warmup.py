"""Warm-up of the batch arena (issue 16; NOTE [ Warming the arena ] in
loader/_warm.pxi): the mechanism, not its speed (bench/loaders.py W1's
"new loader, first 3 epochs" row measures that).

Residency is read from /proc/PID/smaps: the Rss of a process's mappings
of the arena's memfd is what that process has in its own page tables."""

import os
import threading
import time

import numpy as np
import pytest

import shmq
from loader import ShmLoader
from loader._native import WarmChunks, populate
from loader._slabs import slab_bytes
from loader._warmup import ArenaWarmer

from conftest import descendants

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
ROW = 256 * 1024  # float32: 1 MiB a sample


def arena_rss(pid: int) -> int:
    """Bytes of the loader's arena resident in pid's page tables."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = "shmloader-arena" in line
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


class Big:
    """1 MiB float32 samples holding i, after `work_s` of CPU (so that both
    workers write rows of the first batches)."""

    def __init__(self, n, work_s=0.003):
        self.n, self.work_s = n, work_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:
            pass
        return np.full(ROW, i, np.float32)


def wait_for(predicate, timeout):
    """predicate() true within timeout (checked every 50 ms), else False."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_pages_are_resident_ahead_of_the_writers():
    rows, prefetch = 16, 3
    slab = slab_bytes(rows * ROW * 4 + 8 * rows)   # the rows and their int64 tags
    target = (prefetch + 2 + 3) * slab              # SlabAllocator.warm_target: window + 3
    with ShmLoader(Big(40 * rows), batch_size=rows, num_workers=2, prefetch=prefetch,
                   memory_cap_bytes=1 << 30) as ld:
        it = iter(ld)
        first = next(it)
        assert np.array_equal(first[:, 0], np.arange(rows))
        children = list(descendants(os.getpid()))
        assert len(children) == 3

        def rss():
            return {pid: arena_rss(pid) for pid in children}

        # the collator's thread faults in the slabs in flight ahead of need,
        # far more than the batches written so far
        assert wait_for(lambda: max(rss().values()) >= target, 30), (rss(), target)
        # every worker populated whole 2 MiB chunks of each slab it wrote a row
        # of: at least the first slab, though it wrote only some of its rows
        assert all(v >= slab for v in rss().values()), (rss(), slab)
        for i, batch in enumerate(it, 1):
            assert np.array_equal(batch[:, 0], np.arange(i * rows, (i + 1) * rows))
        assert i == 39
        # the warm-up never went past what the pool keeps in flight
        assert max(rss().values()) <= target + 2 * MiB + (ld.stats()["peak_slab_bytes"]), rss()


def test_populate_never_changes_data_even_under_a_writer():
    arena = shmq.shared_array(64 * MiB, np.uint8)
    words = arena.view(np.int64)
    done = threading.Event()

    def writer():  # fills the second half with its pattern while populate runs
        k = 0
        while not done.is_set():
            k += 1
            words[len(words) // 2:] = k
    arena[: 32 * MiB] = 7
    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(3):
            assert populate(arena) is True  # this kernel has MADV_POPULATE_WRITE (>= 5.14)
    finally:
        done.set()
        t.join(10)
    assert np.all(arena[: 32 * MiB] == 7)
    last = words[-1]
    assert np.all(words[len(words) // 2:] == last)


def test_warm_chunks_and_the_warmer_cover_exactly_what_is_asked():
    arena = shmq.shared_array(33 * MiB, np.uint8)
    chunks = WarmChunks(arena)
    assert chunks.populated_bytes() == 0
    warmer = ArenaWarmer(arena)
    try:
        warmer.want(20 * MiB)
        assert warmer.settle(30) and warmer.done == 20 * MiB
        warmer.want(10 * MiB)                         # the target only grows
        warmer.want(100 * MiB)                        # ... up to the arena
        assert warmer.settle(30) and warmer.done == 33 * MiB
    finally:
        warmer.stop()
    assert not warmer.thread.is_alive()
    warmer.want(64 * MiB)                             # stopped: nothing starts again
    assert warmer.thread is not None and not warmer.thread.is_alive()
