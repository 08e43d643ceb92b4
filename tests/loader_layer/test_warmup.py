"""Warm-up of the batch arena (issue 16; NOTE [ Warming the arena ] in
loader/native/warm.pxi): the mechanism, not its speed (bench/loaders.py W1's
"new loader, first 3 epochs" row measures that).

What the arena's memfd has allocated is its st_blocks; what one process
has in its own page tables is the Rss of its mappings of the memfd in
/proc/PID/smaps."""

import os
import threading
import time

import numpy as np
import pytest

from loader import ShmLoader
from loader._native import arena_array
from loader.batcher.slabs import slab_bytes
from loader.batcher.warmup import ArenaWarmer

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


def arena_allocated() -> int:
    """Bytes the loader's arena memfd has allocated (main holds it open)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "shmloader-arena" in os.readlink(f"/proc/self/fd/{fd}"):
                return os.stat(f"/proc/self/fd/{fd}").st_blocks * 512
        except OSError:
            continue
    raise AssertionError("no arena memfd open in this process")


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
    target = (prefetch + 3) * slab                  # LoaderSpec.slabs_in_flight, map-style
    with ShmLoader(Big(40 * rows), batch_size=rows, num_workers=2, prefetch=prefetch,
                   memory_cap_bytes=1 << 30) as ld:
        it = iter(ld)
        first = next(it)
        assert np.array_equal(first[:, 0], np.arange(rows))
        # the loader's own children (an earlier test's may still be exiting)
        children = [c for c in descendants(os.getpid()) if c in {p.pid for p in ld._session.procs}]
        assert len(children) == 3
        # the batcher's thread allocates the slabs in flight ahead of need,
        # far more than the batches written so far
        assert wait_for(lambda: arena_allocated() >= target, 30), (arena_allocated(), target)
        # every worker populated its page tables for whole 2 MiB chunks of each
        # slab it wrote a row of: at least one slab, though it wrote only some
        # of its rows; the batcher, which writes no row, maps no page
        def rss():
            return sorted(arena_rss(pid) for pid in children)
        assert wait_for(lambda: rss()[1] >= slab, 30), (rss(), slab)  # (a worker may start late)
        assert rss()[0] == 0, rss()
        for i, batch in enumerate(it, 1):
            assert np.array_equal(batch[:, 0], np.arange(i * rows, (i + 1) * rows))
        assert i == 39
        # the warm-up never went past what the pool keeps in flight
        peak = ld.stats()["peak_slab_bytes"]
        assert arena_allocated() <= max(target, peak) + 2 * MiB, (arena_allocated(), peak)


def test_the_warmer_never_changes_data_even_under_a_writer():
    fd = os.memfd_create("test-warm")
    try:
        os.ftruncate(fd, 64 * MiB)
        arena = arena_array(fd, 64 * MiB)
        words = arena.view(np.int64)
        arena[: 32 * MiB] = 7
        done = threading.Event()

        def writer():  # fills the second half with its pattern while the warmer runs
            k = 0
            while not done.is_set():
                k += 1
                words[len(words) // 2:] = k
        t = threading.Thread(target=writer)
        t.start()
        warmer = ArenaWarmer(fd, 64 * MiB)
        try:
            warmer.want(64 * MiB)
            assert warmer.settle(30) and warmer.done == 64 * MiB
        finally:
            warmer.stop()
            done.set()
            t.join(10)
        assert os.fstat(fd).st_blocks * 512 == 64 * MiB
        assert np.all(arena[: 32 * MiB] == 7)
        assert np.all(words[len(words) // 2:] == words[-1])
    finally:
        os.close(fd)


def test_the_warmer_covers_exactly_what_is_asked():
    fd = os.memfd_create("test-warm")
    try:
        os.ftruncate(fd, 33 * MiB)
        warmer = ArenaWarmer(fd, 33 * MiB)
        try:
            warmer.want(20 * MiB)
            assert warmer.settle(30) and warmer.done == 20 * MiB
            assert os.fstat(fd).st_blocks * 512 == 20 * MiB
            warmer.want(10 * MiB)                     # the target only grows
            warmer.want(100 * MiB)                    # ... up to the arena
            assert warmer.settle(30) and warmer.done == 33 * MiB
        finally:
            warmer.stop()
        assert not warmer.thread.is_alive()
        warmer.want(64 * MiB)                         # stopped: nothing starts again
        assert not warmer.thread.is_alive() and warmer.target == 33 * MiB
    finally:
        os.close(fd)
