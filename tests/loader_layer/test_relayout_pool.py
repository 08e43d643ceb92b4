"""A batch laid out again never hangs a small pool (NOTE [ Memory goes to
batches in order ] in loader/batcher/runs.py).

A batch is laid out again when the layout guessed from the batch before
has the wrong shape (bucketing), and when a later row's dtype promotes the
batch (an int32 batch with a float32 row becomes float64).  Before, with a
pool of a few batches the loader waited until its timeout in 13 of 24 mode
combinations: the batch asked for its second slab after later batches had
taken the pool, or needed room for its old and new slab at once; and a
larger pool hung where a smaller one worked.  Now later batches give their
memory back to it (their rows parked in the batcher), and a batch laid out
again gives its own slab back first, so a pool that holds a batch's last
layout always delivers it.

Every case here runs one epoch per pool size, from one page up to four of
its largest batches and a page either side of every batch's need, and
checks each batch: a batch whose slab fits the pool comes whole, with its
exact values and dtype; one that does not is a MemoryError naming both
sizes and memory_cap_bytes, after which the epoch goes on (and the next
epoch is the same).  Whatever pool works, every larger one works too.  A
hang is a LoaderTimeout (timeout=), never a stuck test."""

import re

import numpy as np
import pytest

from loader import LoaderTimeout, ShmLoader, get_worker_info
from loader.shared.layout import Layout, signature
from loader.batcher.slabs import slab_bytes as pool_bytes

pytestmark = pytest.mark.timeout(300)

PAGE = 4096
WIDTHS = (100, 400, 700)
BATCHES = 12


class Relaid:
    """Sample i of batch k = i // batch_size (row r = i % batch_size): an
    array of width widths[k % len(widths)] filled with i, int32 unless it
    is a float32 row (rows `late` on of every other batch, after int32
    rows: the batch's dtype changes at a later row than the first).
    Bucketed shapes change every batch, so the layout guessed from the
    batch before is wrong; floats promote the batch to float64."""

    def __init__(self, batch_size, widths=WIDTHS, floats=False, late=0):
        self.batch_size, self.widths, self.floats, self.late = batch_size, widths, floats, late

    def __len__(self):
        return BATCHES * self.batch_size

    def width(self, k):
        return self.widths[k % len(self.widths)]

    def is_float(self, i):
        k, r = divmod(i, self.batch_size)
        return self.floats and k % 2 == 1 and r >= min(self.late, self.batch_size - 1)

    def dtype(self, i):
        return np.dtype(np.float32 if self.is_float(i) else np.int32)

    def __getitem__(self, i):
        return np.full(self.width(i // self.batch_size), i, self.dtype(i))

    def batch_dtype(self, k):
        return np.result_type(*[self.dtype(i) for i in self.positions(k)])

    def positions(self, k):
        return range(k * self.batch_size, (k + 1) * self.batch_size)

    def need_bytes(self, k):
        """The slab batch k takes in its last layout."""
        return pool_bytes(Layout(signature(np.zeros(self.width(k), self.batch_dtype(k))),
                                 self.batch_size).nbytes)


class Fetched(Relaid):
    """Relaid loaded a batch at a time (__getitems__): workers claim whole
    batches, so a batch's samples are its own in first-ready mode too (one
    sample at a time they fill batches in the order they come, and two
    workers would mix bucketed shapes in one batch)."""

    def __getitems__(self, indices):
        return [self[i] for i in indices]


class Collated(Relaid):
    """Relaid with collate_fn=np.stack: each batch one slab row, laid out
    as the worker's collated output (the per-batch path)."""

    def need_bytes(self, k):
        whole = np.zeros((self.batch_size, self.width(k)), self.batch_dtype(k))
        return pool_bytes(Layout(signature(whole), 1, False).nbytes)


class Streamed:
    """Relaid's samples as an iterable dataset: worker w fills batches w,
    w + W, w + 2W... (each worker's stream, as PyTorch shares it out), so
    batch k holds the samples of Relaid's batch k."""

    def __init__(self, relaid, workers):
        self.relaid, self.workers = relaid, workers

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info is not None else 0
        for k in range(w, BATCHES, self.workers):
            for i in self.relaid.positions(k):
                yield self.relaid[i]


KINDS = {
    "bucketed": dict(),                                  # shapes change every batch
    "promoted": dict(widths=(100,), floats=True, late=1),  # dtypes, from row 1 on
    "both": dict(floats=True, late=3),                   # shapes, and dtypes from row 3 on
}


def pool_sizes(ds) -> list:
    """Pool sizes in pages: every one from one page to two past the largest
    batch (at most 10), a page either side of every batch's need, and up
    to four of the largest batches."""
    needs = {ds.need_bytes(k) // PAGE for k in range(BATCHES)}
    most = max(needs)
    sizes = {most + 1, 2 * most - 1, 2 * most, 3 * most + 1, 4 * most}
    sizes |= set(range(1, min(most + 2, 10) + 1))
    sizes |= {n + d for n in needs for d in (-1, 0)}
    return sorted(s for s in sizes if s >= 1)


def refused_batch(error: MemoryError, cap: int) -> tuple:
    """(the batch a MemoryError names, the bytes it says it needs), its
    text checked: both sizes and the remedy."""
    text = str(error)
    k, need = map(int, re.search(r"batch (\d+) needs (\d+) bytes", text).groups())
    assert need > cap and (f"batch {k} needs {need} bytes of slab memory but memory_cap_bytes "
                           f"is {cap}: pass memory_cap_bytes >= {need}") in text
    return k, need


def checked_batch(b, ds, in_order: bool) -> int:
    """The number of a delivered batch (its first sample's), its values and
    dtype checked."""
    b = np.asarray(b)
    k = int(b[0, 0]) // ds.batch_size
    if not in_order:  # first-ready: a batch's samples in the order they came
        b = b[np.argsort(b[:, 0], kind="stable")]
    assert b.dtype == ds.batch_dtype(k), (k, b.dtype)
    rows = np.arange(k * ds.batch_size, (k + 1) * ds.batch_size)
    np.testing.assert_array_equal(b, np.broadcast_to(rows[:, None], (len(rows), ds.width(k))))
    return k


def one_epoch(loader, ds, cap: int, in_order: bool) -> tuple:
    """(batches delivered, [(batch, bytes)] refused for memory) of one
    epoch, every batch checked; in order, a refused batch is raised at its
    turn."""
    delivered, refused, turns = [], [], []
    it = iter(loader)
    while True:
        try:
            k = checked_batch(next(it), ds, in_order)
            delivered.append(k)
        except StopIteration:
            break
        except MemoryError as e:
            k, need = refused_batch(e, cap)
            refused.append((k, need))
        turns.append(k)
    if in_order:
        assert turns == sorted(turns)
    return sorted(delivered), sorted(refused)


def fitting(ds, cap):
    """(the batches a pool of cap bytes delivers, those it refuses)."""
    fits = [k for k in range(BATCHES) if ds.need_bytes(k) <= cap]
    return fits, sorted(set(range(BATCHES)) - set(fits))


def streams_fitting(workers):
    """fitting() for an iterable dataset: a worker that finds its batch
    refused ends its stream for the epoch (main raises the batch's error
    and goes on with the other streams).  It finds it when the layout of
    the batch's first row is too large; a batch refused only once its last
    row promoted it (KINDS' floats start at row 3 of 4) is behind it."""
    def expected(ds, cap):
        fits, refused = [], []
        for w in range(workers):
            for k in range(w, BATCHES, workers):
                if ds.need_bytes(k) <= cap:
                    fits.append(k)
                    continue
                refused.append(k)
                first = np.zeros(ds.width(k), ds.dtype(k * ds.batch_size))
                if pool_bytes(Layout(signature(first), ds.batch_size).nbytes) > cap:
                    break
        return sorted(fits), sorted(refused)
    return expected


def every_pool_size(ds, make_loader, in_order: bool, expected=fitting, numbered=True) -> None:
    """One epoch in each pool size: exactly the batches expected(ds, cap)
    says come, and a MemoryError for each batch it refuses (named by its
    number, or by the bytes it needs where numbered is False: first-ready
    collated batches are numbered as they come); no timeout; a pool that
    works is followed only by pools that work.  A pool that refuses runs a
    second epoch: the loader goes on after MemoryError."""
    works = []
    for pages in pool_sizes(ds):
        cap = pages * PAGE
        fits, too_large = expected(ds, cap)
        with make_loader(cap) as loader:
            try:
                epochs = [one_epoch(loader, ds, cap, in_order)]
                if epochs[0][1]:
                    epochs.append(one_epoch(loader, ds, cap, in_order))
            except LoaderTimeout:
                pytest.fail(f"memory_cap_bytes={cap} ({pages} pages): no batch within timeout")
        for delivered, refused in epochs:
            assert delivered == fits, pages
            if numbered:
                assert [k for k, _ in refused] == too_large, pages
                # the bytes of its last layout, or of one before that was already too large
                assert all(need <= ds.need_bytes(k) for k, need in refused), refused
            else:
                assert sorted(n for _, n in refused) == sorted(map(ds.need_bytes, too_large))
        works.append(not epochs[0][1])
    assert works == sorted(works), list(zip(pool_sizes(ds), works))  # no pool worse than a smaller


MODES = [(0, "process")] + [(w, m) for w in (1, 2) for m in ("process", "thread")]


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "first_ready"])
@pytest.mark.parametrize("workers,mode", MODES, ids=[f"{w}{m[0]}" for w, m in MODES])
@pytest.mark.parametrize("batch_size", [1, 4, 32])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_batch_laid_out_again_in_every_pool_size(kind, batch_size, workers, mode, in_order):
    """Samples placed row by row (two workers in first-ready mode load a
    batch at a time, so that a batch holds its own samples)."""
    cls = Fetched if workers > 1 and not in_order else Relaid
    ds = cls(batch_size, **KINDS[kind])
    every_pool_size(ds, lambda cap: ShmLoader(
        ds, batch_size=batch_size, num_workers=workers, worker_mode=mode, in_order=in_order,
        memory_cap_bytes=cap, timeout=20), in_order,
        expected=fitting if workers else lambda ds, cap: (list(range(BATCHES)), []))


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "first_ready"])
@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("kind", ["bucketed", "both"])
def test_collated_batches_laid_out_again_in_every_pool_size(kind, mode, in_order):
    """collate_fn: each batch's layout is its collated output's."""
    ds = Collated(4, **KINDS[kind])
    every_pool_size(ds, lambda cap: ShmLoader(
        ds, batch_size=4, collate_fn=np.stack, num_workers=2, worker_mode=mode, in_order=in_order,
        memory_cap_bytes=cap, timeout=20), in_order, numbered=in_order)


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "first_ready"])
@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_iterable_dataset_laid_out_again_in_every_pool_size(kind, mode, in_order):
    """Two workers' streams, each filling its own batches.  (Before, a
    batch refused before it was laid out left its stream's worker waiting
    for its table entry: the loader waited until its timeout.)"""
    ds = Relaid(4, **KINDS[kind])
    every_pool_size(ds, lambda cap: ShmLoader(
        Streamed(ds, 2), batch_size=4, num_workers=2, worker_mode=mode, in_order=in_order,
        memory_cap_bytes=cap, timeout=20), in_order, expected=streams_fitting(2))


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("batch_size", [4, 32])
def test_rows_promoted_in_the_order_they_come_in_every_pool_size(batch_size, mode):
    """First-ready, two workers, row by row: a batch holds the samples in
    the order they came, so which batches mix int32 and float32 rows (and
    need a float64 slab) depends on timing.  Every batch that comes is
    exact (its dtype that of its rows), a refused one names sizes past the
    pool, every sample comes once unless its batch was refused, and a pool
    of the largest layout delivers everything."""
    ds = Relaid(batch_size, **KINDS["promoted"])
    most = max(ds.need_bytes(k) for k in range(BATCHES))
    for pages in pool_sizes(ds):
        cap = pages * PAGE
        seen, refused = [], 0
        with ShmLoader(ds, batch_size=batch_size, num_workers=2, worker_mode=mode,
                       in_order=False, memory_cap_bytes=cap, timeout=20) as loader:
            it = iter(loader)
            while True:
                try:
                    b = np.asarray(next(it))
                except StopIteration:
                    break
                except MemoryError as e:
                    need = int(re.search(r"needs (\d+) bytes", str(e)).group(1))
                    assert cap < need <= most and f"memory_cap_bytes is {cap}" in str(e)
                    refused += 1
                    continue
                except LoaderTimeout:
                    pytest.fail(f"memory_cap_bytes={cap} ({pages} pages): no batch within timeout")
                ids = b[:, 0].astype(np.int64)
                np.testing.assert_array_equal(b, np.broadcast_to(ids[:, None], b.shape))
                assert b.dtype == np.result_type(*[ds.dtype(i) for i in ids])
                seen += ids.tolist()
        assert len(set(seen)) == len(seen) == len(ds) - refused * batch_size, pages
        if cap >= most:
            assert refused == 0, pages


class Mixed:
    """An iterable dataset of n samples shared out among the workers:
    sample i is an array of 100 i's, float32 when i % 7 == 3, else int32,
    so that batches a shuffle buffer mixes are promoted as they fill."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        w, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(w, self.n, workers):
            yield np.full(100, i, self.dtype(i))

    @staticmethod
    def dtype(i):
        return np.dtype(np.float32 if i % 7 == 3 else np.int32)


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "first_ready"])
@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_shuffle_buffer_promoting_its_batches_in_every_pool_size(batch_size, mode, in_order):
    """shuffle_buffer=8 over 2 workers: windows of 4 one-sample batches
    (a pool of 7 lets them load: _slabs.never_fits), or of one batch of 4.
    Batches promoted while a window fills, in pools from one page: every
    sample once, each batch of its rows' dtype; a pool short of the
    windows is the MemoryError naming both sizes (three seeds each; before,
    a pool of one batch of 4 hung: the next batch laid out ahead held the
    page the one being promoted needed)."""
    need = (7 if batch_size == 1 else 1) * PAGE
    for pages in range(1, need // PAGE + 3):
        cap = pages * PAGE
        for seed in range(3):
            seen = []
            with ShmLoader(Mixed(96), batch_size=batch_size, num_workers=2, shuffle_buffer=8,
                           seed=seed, worker_mode=mode, in_order=in_order, memory_cap_bytes=cap,
                           timeout=20) as loader:
                it = iter(loader)
                try:
                    for b in it:
                        ids = b[:, 0].astype(np.int64)
                        np.testing.assert_array_equal(b, np.broadcast_to(ids[:, None], b.shape))
                        assert b.dtype == np.result_type(*map(Mixed.dtype, ids))
                        seen += ids.tolist()
                except MemoryError as e:
                    assert cap < need and (f"memory_cap_bytes is {cap}: pass memory_cap_bytes >= "
                                           f"{need}") in str(e), (pages, str(e))
                    continue
                except LoaderTimeout:
                    pytest.fail(f"memory_cap_bytes={cap} ({pages} pages), seed {seed}: no batch "
                                f"within timeout")
            assert cap >= need and sorted(seen) == list(range(96)), (pages, seed)


class Named(Relaid):
    """Relaid's samples as {"x": the array, "name": f"s{i}"}: a batch's
    names travel beside its slab, and stay with their rows while the rows
    are parked."""

    def __getitem__(self, i):
        return {"x": super().__getitem__(i), "name": f"s{i}"}


@pytest.mark.parametrize("workers,in_order", [(2, True), (1, False)])
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_rows_with_names_laid_out_again_in_every_pool_size(mode, workers, in_order):
    ds = Named(4, **KINDS["both"])
    for pages in pool_sizes(ds):
        cap = pages * PAGE
        fits, too_large = fitting(ds, cap)
        delivered, refused = [], []
        with ShmLoader(ds, batch_size=4, num_workers=workers, worker_mode=mode, in_order=in_order,
                       memory_cap_bytes=cap, timeout=20) as loader:
            it = iter(loader)
            while True:
                try:
                    b = next(it)
                except StopIteration:
                    break
                except MemoryError as e:
                    refused.append(refused_batch(e, cap)[0])
                    continue
                except LoaderTimeout:
                    pytest.fail(f"memory_cap_bytes={cap} ({pages} pages): no batch within timeout")
                k = checked_batch(b["x"], ds, in_order)
                names = [f"s{i}" for i in ds.positions(k)]
                assert (b["name"] if in_order else sorted(b["name"], key=names.index)) == names
                delivered.append(k)
        assert (sorted(delivered), sorted(refused)) == (fits, too_large), pages
