"""Any batch, held any way (issue 13, items 1-3): non-array leaves of any
size reach the training loop (NOTE [ Spilled messages ] in _spill.py), and
what the training loop keeps of a batch never stalls the loader nor costs
more than PyTorch's copy would (NOTE [ Kept batch memory ] in _leases.pxi).
Every test is time-limited; the autouse guards (conftest.py) check that
nothing is left in /dev/shm and that no process outlives its test."""

import gc
import os
import signal
from contextlib import closing

import numpy as np
import pytest

import loader as loader_module
from loader import DataLoader, ShmLoader, WorkerError

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20

# torch's own advice when workers outnumber the cores (loader.DataLoader gives it as torch does)
more_workers_than_cores = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB (VmRSS, RssAnon, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# --- item 1: non-array leaves of any size ------------------------------------------------

class Raw:
    """Sample i: `size` bytes of i % 251 (a raw JPEG, say), a text of
    `size` characters, and i."""

    def __init__(self, n, size, text=True):
        self.n, self.size, self.text = n, size, text

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        sample = {"raw": bytes([i % 251]) * self.size, "i": i}
        if self.text:
            sample["text"] = chr(0x3b1 + i % 24) * self.size  # Greek: 2 bytes a character in UTF-8
        return sample


def check_raw(batches, n, size, text=True):
    """Every sample exactly once, every byte and character exact; returns
    the indices in delivery order."""
    seen = []
    for b in batches:
        ids = [int(i) for i in b["i"]]
        assert len(b["raw"]) == len(ids)
        for k, i in enumerate(ids):
            assert b["raw"][k] == bytes([i % 251]) * size
            if text:
                assert b["text"][k] == chr(0x3b1 + i % 24) * size
        seen += ids
    assert sorted(seen) == list(range(n))
    return seen


@more_workers_than_cores
@pytest.mark.parametrize("workers", [1, 2, 8])
@pytest.mark.parametrize("in_order", [True, False])
def test_batches_of_256_raw_images_of_200_kb(workers, in_order):
    n, size = 512, 200_000   # two batches of 51 MB of bytes
    with ShmLoader(Raw(n, size, text=False), batch_size=256, num_workers=workers,
                   in_order=in_order, timeout=60) as ld:
        for _ in range(2):
            seen = check_raw(list(ld), n, size, text=False)
            if in_order:
                assert seen == list(range(n))
    with closing(DataLoader(Raw(n, size, text=False), batch_size=256, num_workers=workers,
                            in_order=in_order, timeout=60)) as dl:
        seen = check_raw(list(dl), n, size, text=False)
        if in_order:
            assert seen == list(range(n))


@more_workers_than_cores
@pytest.mark.parametrize("workers", [1, 2, 8])
def test_batches_of_64_texts_of_1_mb(workers):
    n, size = 128, 1_000_000
    with ShmLoader(Raw(n, size), batch_size=64, num_workers=workers, timeout=60) as ld:
        assert check_raw(list(ld), n, size) == list(range(n))
    with closing(DataLoader(Raw(n, size), batch_size=64, num_workers=workers, timeout=60,
                            in_order=False)) as dl:
        check_raw(list(dl), n, size)


class Extras:
    """An object only pickle carries: 50,000 distinct 1 KB records (50 MB)."""

    def __init__(self, i):
        self.records = [bytes([i, k % 256]) * 500 for k in range(50_000)]

    def __eq__(self, other):
        return type(other) is Extras and other.records == self.records


class Huge:
    """Sample 0: a 100 MB string; sample 1: 50 MB of pickled extras."""

    def __init__(self, extras=True):
        self.extras = extras

    def __len__(self):
        return 2

    def __getitem__(self, i):
        if i == 0 or not self.extras:
            return {"text": str(i) * 100_000_000}
        return {"text": "small", "extras": Extras(i)}


def test_one_100_mb_string_and_50_mb_of_pickled_extras():
    with ShmLoader(Huge(), batch_size=None, num_workers=2, timeout=120) as ld:
        first, second = list(ld)
    assert first["text"] == "0" * 100_000_000
    assert second["text"] == "small" and second["extras"] == Extras(1)
    del first, second
    with closing(DataLoader(Huge(extras=False), batch_size=1, num_workers=2, timeout=120)) as dl:
        texts = [b["text"] for b in dl]
    assert texts == [["0" * 100_000_000], ["1" * 100_000_000]]


def test_a_row_of_values_over_the_old_ring_size_in_thread_mode_too():
    n, size = 96, 300_000
    with ShmLoader(Raw(n, size), batch_size=32, num_workers=2, worker_mode="thread",
                   timeout=60) as ld:
        assert check_raw(list(ld), n, size) == list(range(n))


def test_the_spill_log_frees_in_order_rewinds_when_empty_and_gives_big_pages_back():
    import shmq
    from loader._spill import RETAIN_BYTES, SpillHeap, SpillWriter, Spilled

    heap = SpillHeap(2, region_bytes=512 * MiB)
    ring = shmq.Queue(1 * MiB, anonymous=True)
    try:
        w = SpillWriter(heap, 1)
        small, big = {"a": b"x" * 100_000}, "y" * (200 * MiB)
        w.put(ring, small)
        w.put(ring, small)
        assert heap.head(1) > heap.tail(1) == 0           # two blocks live
        assert heap.receive(ring.get()) == small and heap.tail(1) < heap.head(1)
        assert heap.receive(ring.get()) == small and heap.tail(1) == heap.head(1)
        w.put(ring, big)                                  # the log was empty: a new lap, offset 0
        assert heap.head(1) % heap.region_bytes == ring_block(heap, 1)
        assert heap.receive(ring.get()) == big and w.touched > RETAIN_BYTES
        w.put(ring, 7)                                    # small: no block at all
        assert heap.receive(ring.get()) == 7 and w.touched > RETAIN_BYTES
        w.put(ring, small)                                # empty again: the big pages go back
        assert w.touched <= RETAIN_BYTES
        heap.receive(ring.get())
        # a writer started again under the same id continues after its predecessor
        w.put(ring, small)
        again = SpillWriter(heap, 1)
        again.put(ring, small)
        first, second = ring.get(), ring.get()
        assert type(first) is Spilled and second.pos >= first.pos + first.nbytes
        assert heap.receive(first) == small and heap.receive(second) == small
        with pytest.raises(MemoryError, match="larger than this machine's memory"):
            again.put(ring, "z" * (600 * MiB))
        assert ring.get_nowait.__self__ is ring  # the ring is still usable
        again.put(ring, small)
        assert heap.receive(ring.get()) == small
    finally:
        ring.close()


def ring_block(heap, region):
    """The size of the region's only live block (head - tail)."""
    return heap.head(region) - max(heap.tail(region), heap.head(region) // heap.region_bytes
                                   * heap.region_bytes)


# --- items 2 and 3: kept memory -------------------------------------------------------------

class Images(torch.utils.data.Dataset):
    """Sample i: a 3x32x32 float32 image filled with i, and its label i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 32, 32), float(i)), i


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_keeping_every_label_of_200000_samples_under_a_64_mib_cap(mode):
    n, bs = 200_000, 250   # 800 batches of 3 MB: 2.4 GB of slabs through a 64 MiB pool
    gc.collect()
    rss0, anon0 = status_kib("VmRSS"), status_kib("RssAnon")
    targets = []
    with ShmLoader(Images(n), batch_size=bs, num_workers=2, output="torch", worker_mode=mode,
                   memory_cap_bytes=64 * MiB, timeout=60) as ld:
        for x, y in ld:
            assert float(x[0, 0, 0, 0]) == float(y[0])
            targets.append(y)
        evicted = ld._leases.evicted_slabs
        grown_anon = status_kib("RssAnon") - anon0
        grown_rss = status_kib("VmRSS") - rss0
    assert torch.equal(torch.cat(targets), torch.arange(n))
    assert evicted >= len(targets) - 64 * MiB // (bs * 3 * 32 * 32 * 4)  # the pool was reused
    # What is kept is the labels, a page each at most, not the 2.4 GB of slabs:
    assert grown_anon <= len(targets) * 4 + 32 * 1024, (grown_anon, len(targets))
    assert grown_rss <= 64 * 1024 + len(targets) * 4 + 48 * 1024, grown_rss


def test_keeping_whole_batches_past_the_cap_keeps_their_values():
    n, bs = 4000, 100      # 40 batches of 1.2 MB kept whole through an 8 MiB pool
    outputs = []
    with ShmLoader(Images(n), batch_size=bs, num_workers=2, output="torch",
                   memory_cap_bytes=8 * MiB, timeout=60) as ld:
        for epoch in range(2):
            for batch in ld:
                outputs.append(batch)
        assert ld._leases.evicted_slabs > 0
    assert len(outputs) == 80
    for k, (x, y) in enumerate(outputs):
        ids = torch.arange(bs * (k % 40), bs * (k % 40 + 1))
        assert torch.equal(y, ids)
        assert torch.equal(x, ids.float()[:, None, None, None].expand(bs, 3, 32, 32))


def test_views_of_views_stay_unchanged_after_their_slab_is_reused():
    """x[0, :10], torch.from_numpy, .T, a slice of a tensor: each keeps only
    its leaf, and reads the same values after the pool reused the slab."""
    class Grid:
        def __len__(self):
            return 3000

        def __getitem__(self, i):
            return np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + i, i

    kept = []
    with ShmLoader(Grid(), batch_size=50, num_workers=2, memory_cap_bytes=4 * MiB,
                   timeout=60) as ld:
        for k, (x, y) in enumerate(ld):
            if k % 3 == 0:
                kept.append(("row", k, x[0, :10]))
            elif k % 3 == 1:
                kept.append(("torch", k, torch.from_numpy(x)[1:3, ::2]))
            else:
                kept.append(("T", k, x[2].T))
            kept.append(("label", k, torch.from_numpy(y)[-5:]))
        assert ld._leases.evicted_slabs > 0
    base = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    for what, k, v in kept:
        first = 50 * k
        if what == "row":
            np.testing.assert_array_equal(v, base[:10] + first)
        elif what == "torch":
            want = np.stack([base[::2] + first + 1, base[::2] + first + 2])
            np.testing.assert_array_equal(v.numpy(), want)
        elif what == "T":
            np.testing.assert_array_equal(v, (base + first + 2).T)
        else:
            np.testing.assert_array_equal(v.numpy(), np.arange(first + 45, first + 50))


def test_a_loop_that_keeps_nothing_never_copies():
    with ShmLoader(Images(2000), batch_size=100, num_workers=2, output="torch",
                   memory_cap_bytes=8 * MiB, timeout=60) as ld:
        for _ in range(3):
            for x, y in ld:
                assert float(x[-1, 0, 0, 0]) == float(y[-1])
        assert ld._leases.evicted_slabs == 0 and ld._leases.kept_bytes == 0


def test_repro_keep_labels_in_its_own_form():
    """../shared/repros/repro_loader_keep_labels.py, as a test."""
    class Labelled(torch.utils.data.Dataset):
        def __len__(self):
            return 4000

        def __getitem__(self, i):
            return torch.zeros(3, 64, 64), i

    targets = []
    with ShmLoader(Labelled(), batch_size=100, num_workers=2, output="torch",
                   memory_cap_bytes=64 * MiB, timeout=15) as ld:
        for x, y in ld:
            targets.append(y)
    assert len(targets) == 40 and torch.equal(torch.cat(targets), torch.arange(4000))


@pytest.mark.parametrize("victim", ["worker 0", "the collator"])
def test_a_child_killed_while_kept_batches_move_out(victim, monkeypatch):
    """The collator or a worker dies just as main moves kept batches out of
    the pool: what the user holds stays intact, the death is reported as
    any death is, and nothing leaks."""
    real = ShmLoader._move_kept_out
    killed = []

    def move_and_kill(self, partial_only):
        if not killed and self._leases.held:  # kept batches about to move
            child = next(c for c in self._procs if c.role == victim)
            os.kill(child.pid, signal.SIGKILL)
            killed.append(child.pid)
        return real(self, partial_only)

    monkeypatch.setattr(ShmLoader, "_move_kept_out", move_and_kill)
    kept = []
    with ShmLoader(Images(4000), batch_size=100, num_workers=2, output="torch",
                   memory_cap_bytes=4 * MiB, timeout=30) as ld:
        with pytest.raises(WorkerError) as info:
            for batch in ld:
                kept.append(batch)
    assert killed and kept
    assert victim in str(info.value) and f"pid {killed[0]}" in str(info.value)
    for k, (x, y) in enumerate(kept):
        ids = torch.arange(100 * k, 100 * (k + 1))
        assert torch.equal(y, ids)
        assert torch.equal(x[:, 0, 0, 0], ids.float())
