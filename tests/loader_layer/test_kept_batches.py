"""Any batch, held any way (issue 13, items 1-3): non-array leaves of any
size reach the training loop (NOTE [ Spilled messages ] in shared/spill.py), and
what the training loop keeps of a batch never stalls the loader nor costs
more than PyTorch's copy would (NOTE [ Kept batch memory ] in native/leases.pxi).
Every test is time-limited; the autouse guards (conftest.py) check that
nothing is left in /dev/shm and that no process outlives its test."""

import gc
import os
import signal
from contextlib import closing

import numpy as np
import pytest

import loader as loader_module
from loader import ShmLoader, WorkerError
from loader.main.session import Session

torch = pytest.importorskip("torch")
from loader import DataLoader  # noqa: E402  (needs torch)

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


def test_rows_of_bytes_go_to_main_by_reference_and_the_heap_stays_warm_and_small():
    """Five epochs of 512 x 200 KB bytes (0.5 GB): main opens each row's
    block once (stats' spilled_bytes counts them), and the heap's resident
    pages stay within the regions' windows instead of growing with the
    bytes sent."""
    from loader.shared.spill import RETAIN_BYTES

    n, size = 512, 200_000
    with ShmLoader(Raw(n, size, text=False), batch_size=64, num_workers=2, timeout=60) as ld:
        for _ in range(5):
            check_raw(list(ld), n, size, text=False)
            s = ld.stats()
            assert n * size <= s["spilled_bytes"] <= n * (size + 512)
            # and the slabs: 8 batches of 64 int64 labels and 64 row tags
            assert s["bytes"] - s["spilled_bytes"] == 8 * (64 * 8 + 64 * 8)
        heap = ld._session.shared.spill
        assert heap.allocated_bytes() <= 3 * RETAIN_BYTES  # two workers' windows, the batcher's


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


def test_spill_blocks_free_in_any_order_reuse_warm_pages_and_give_big_pages_back():
    import shmq
    from loader.shared.spill import RETAIN_BYTES, SpillHeap, SpillWriter, Spilled

    heap = SpillHeap(2, region_bytes=512 * MiB)
    ring = shmq.Queue(1 * MiB, anonymous=True)
    try:
        w = SpillWriter(heap, 1)
        small, big = {"a": b"x" * 100_000}, "y" * (200 * MiB)
        w.put(ring, small)
        w.put(ring, small)
        first, second = ring.get(), ring.get()
        assert type(first) is Spilled and first.pos == 0 and second.pos == first.nbytes
        assert heap.receive(second) == small          # freed out of order: both still held
        w._reclaim()
        assert [pos for pos, _ in w.blocks] == [0, first.nbytes]
        assert heap.receive(first) == small
        w.put(ring, big)                                  # the log was empty: offset 0 again
        block = ring.get()
        assert block.pos == 0 and len(w.blocks) == 1 and w.touched > RETAIN_BYTES
        assert heap.receive(block) == big
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
        assert second.pos >= first.pos + first.nbytes
        assert heap.receive(first) == small and heap.receive(second) == small
        with pytest.raises(MemoryError, match="larger than this machine's memory"):
            again.put(ring, "z" * (600 * MiB))
        again.put(ring, small)                            # the writer is still usable
        assert heap.receive(ring.get()) == small
    finally:
        ring.close()


def test_spill_blocks_freed_late_and_out_of_order_are_never_overwritten():
    """Readers free blocks in any order, some late (a batch waiting for a
    slow row holds its rows' blocks): the writer never waits, reuses the
    window's pages once the late ones are freed, and every block reads
    back exactly."""
    from loader.shared.spill import RETAIN_BYTES, SpillHeap, SpillWriter

    heap = SpillHeap(1, region_bytes=1024 * MiB)
    w = SpillWriter(heap, 0)
    held_values = [b"H" * 300_000, "held \udc80 text", 5]
    held = w.values_ref(held_values)
    rng = np.random.default_rng(0)
    live, tops = [], []
    for i in range(4000):
        data = bytes([i % 251]) * int(rng.integers(70_000, 400_000))
        live.append((w.values_ref([data, i]), data, i))
        if len(live) > 20:  # freed in any order among the 10 oldest
            ref, data, j = live.pop(int(rng.integers(0, 10)))
            assert heap.values(ref) == [data, j]
        if i == 1000:       # the slow row's batch arrives at last
            assert heap.values(held) == held_values
            tops.append(w.touched)
    for ref, data, j in live:
        assert heap.values(ref) == [data, j]
    w._reclaim()
    assert w.live == 0 and not w.blocks
    # while the slow block was held the log grew past the window; after it,
    # it came back within the window, and never went beyond what was touched
    assert tops[0] > RETAIN_BYTES
    assert w.touched <= tops[0]
    w.values_ref([b"x" * 100_000])  # empty: back at offset 0, the pages past the window given back
    assert w.runs[0][0] == 0 and w.touched <= RETAIN_BYTES


def test_a_rows_values_travel_raw_by_reference_and_come_back_exact():
    from loader.shared.spill import SPILL_BYTES, SpillHeap, SpillWriter, Spilled

    class Tagged(bytes):
        pass

    heap = SpillHeap(1, region_bytes=64 * MiB)
    w = SpillWriter(heap, 0)
    small = [b"abc", "déf", None, 3.5]
    assert w.values_ref(small) is small                     # small: the list itself
    values = [b"\x00" * SPILL_BYTES, "ü\udc80" * SPILL_BYTES, Tagged(b"t" * 10), [1, "x"],
              np.arange(5), ""]
    ref = w.values_ref(values)
    assert type(ref) is Spilled
    out = heap.values(ref)
    assert [type(v) for v in out] == [bytes, str, Tagged, list, np.ndarray, str]
    assert out[:4] == values[:4] and out[5] == "" and np.array_equal(out[4], np.arange(5))
    assert w.values_ref(values).pos == ref.pos             # the freed block is reused


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
        evicted = ld._session.leases.evicted_slabs
        assert ld.stats()["kept_slabs_moved_out"] == evicted > 0
        assert ld.stats()["kept_bytes_moved_out"] == ld._session.leases.kept_bytes
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
        assert ld._session.leases.evicted_slabs > 0
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
        assert ld._session.leases.evicted_slabs > 0
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
        assert ld._session.leases.evicted_slabs == 0 and ld._session.leases.kept_bytes == 0


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


@pytest.mark.parametrize("victim", ["worker 0", "the batcher"])
def test_a_child_killed_while_kept_batches_move_out(victim, monkeypatch):
    """The batcher or a worker dies just as main moves kept batches out of
    the pool: what the user holds stays intact, the death is reported as
    any death is, and nothing leaks."""
    real = Session.move_kept_out
    killed = []

    def move_and_kill(self, partial_only):
        if not killed and self.leases.held:  # kept batches about to move
            child = next(c for c in self.procs if str(c.role) == victim)
            os.kill(child.pid, signal.SIGKILL)
            killed.append(child.pid)
        return real(self, partial_only)

    monkeypatch.setattr(Session, "move_kept_out", move_and_kill)
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


class Phases:
    """Sample i: (int64 (5,), float32 (2, 3)) in its first 64 of each 192
    samples, {"x": int32 (7,), "y": i} in the next 64, float64 (4, 2) in the
    last: every value says i.  Small: a batch of 32 is one page."""

    def __len__(self):
        return 32 * 64

    def __getitem__(self, i):
        phase = (i // 64) % 3
        if phase == 0:
            return np.full(5, i, np.int64), np.full((2, 3), i, np.float32)
        if phase == 1:
            return {"x": np.full(7, i, np.int32), "y": np.int64(i)}
        return np.full((4, 2), i, np.float64)


def test_kept_leaves_stay_exact_when_their_mapping_is_retired():
    """Regression: a retired mapping sorted its kept runs in place, while
    each KeptRun held its index there; a run dying after that unmapped (or
    mapped back) another run's pages, and a leaf kept long read garbage or
    faulted (4 runs of 6 on the merged code).  Parts of two layouts kept,
    the third dropped, over an epoch 4x the cap: many mappings retired."""
    rows = 32
    kept_a, kept_x = [], []
    with ShmLoader(Phases(), batch_size=rows, num_workers=2, output="torch",
                   memory_cap_bytes=16 * 4096, timeout=60) as ld:
        for k, batch in enumerate(ld):
            if isinstance(batch, tuple):
                kept_a.append((k, batch[0]))
            elif isinstance(batch, dict):
                kept_x.append((k, batch["x"]))
            del batch
        moved = ld._session.leases.evicted_slabs
    assert moved > 0 and len(kept_a) == len(kept_x) == 22
    for k, a in kept_a:
        ids = torch.arange(k * rows, (k + 1) * rows)
        assert torch.equal(a, ids[:, None].repeat(1, 5))
    for k, x in kept_x:
        ids = torch.arange(k * rows, (k + 1) * rows, dtype=torch.int32)
        assert torch.equal(x, ids[:, None].repeat(1, 7))
