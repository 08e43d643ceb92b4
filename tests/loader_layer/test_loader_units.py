"""Unit tests of the loader's parts, in one process: the slab allocator
and leases, the batch table's protocol, run words and claims, bells, and
layouts.  The multiprocess behaviour is in test_loader*.py."""

import gc
import mmap
import os
import threading
import time

import numpy as np
import pytest

from loader.shared import control as _control
from loader.shared import layout as _layout
from loader.order import indices as _order
from loader import _native
from loader.shared import table as _table
from loader._native import Bell, LeaseBook
from loader.batcher.slabs import SlabAllocator

from shmq import sync


# --- slab allocator and leases ----------------------------------------------------------

def allocator(nbytes=1 << 16, workers=2):
    arena = sync.shared_array(nbytes, np.uint8)
    released = sync.shared_array(1 << 16, np.int64)
    hazards = sync.shared_array(workers, np.int64)
    return SlabAllocator(arena, released, hazards, slabs_in_flight=4), released, hazards


P = os.sysconf("SC_PAGE_SIZE")


def test_allocation_is_first_fit_in_whole_pages_and_refuses_when_full():
    # whole pages: main may move the pages of a slab the user keeps out of
    # the pool (NOTE [ Kept batch memory ]), which must hold no other slab
    a, released, _ = allocator(4 * P)
    s1 = a.allocate(100)
    s2 = a.allocate(P + 1000)
    assert (s1.offset, s1.nbytes) == (0, P) and (s2.offset, s2.nbytes) == (P, 2 * P)
    assert a.held_bytes == 3 * P
    assert a.allocate(4 * P) is None           # does not fit what is left
    s3 = a.allocate(P)
    assert s3.offset == 3 * P and a.allocate(1) is None
    assert len({s1.lease, s2.lease, s3.lease}) == 3


def test_lease_ids_count_up_reuse_the_last_released_and_run_out_at_max_leases(monkeypatch):
    from loader.batcher import slabs as _slabs

    monkeypatch.setattr(_slabs, "MAX_LEASES", 16)  # (65,536 in use: the same, only slower)
    a, released, _ = allocator(32 * P)
    first = [a.allocate(1) for _ in range(3)]
    assert [s.lease for s in first] == [0, 1, 2]
    for s in first[:2]:
        a.release(s.lease)
    assert [a.allocate(1).lease for _ in range(3)] == [1, 0, 3]  # last released first
    while a.allocate(1) is not None:
        pass
    assert len(a.live) == 16  # every id in use: no slab until one comes back
    a.release(first[2].lease)
    assert a.allocate(1).lease == 2


def test_a_released_lease_is_reclaimed_only_for_its_own_generation():
    a, released, _ = allocator(P)
    s = a.allocate(P)
    assert a.allocate(64) is None
    released[s.lease] = s.generation - 1     # a stale release of an earlier use
    assert a.allocate(64) is None
    sync.atomic_store(released, s.lease, s.generation)
    again = a.allocate(64)
    assert again is not None and again.offset == 0  # the lowest offset: warm pages first
    assert again.token != s.token                   # a new generation, a new hazard token


def test_freed_neighbours_merge():
    a, released, _ = allocator(3 * P)
    slabs = [a.allocate(P) for _ in range(3)]
    for s in (slabs[0], slabs[2], slabs[1]):
        a.release(s.lease)
    assert a.free == [(0, 3 * P)]
    assert a.allocate(3 * P).offset == 0


def test_a_retired_slab_waits_for_every_hazard_naming_it():
    a, released, hazards = allocator(P)
    s = a.allocate(P)
    hazards[1] = s.token                      # worker 1 may still be writing into it
    a.retire(s.lease)
    assert a.allocate(64) is None
    hazards[1] = 0
    assert a.allocate(64) is not None


def test_warm_up_covers_the_slabs_in_flight_only():
    a, _, _ = allocator(64 << 20)
    assert a.warm_target == 0                 # nothing known yet: nothing to fault in
    a.allocate(1 << 20)
    assert a.warm_target == 4 << 20
    a.allocate(3 << 20)
    assert a.warm_target == 12 << 20          # the largest slab so far, times those in flight


def test_leases_release_when_the_last_view_dies_and_discard_after_close():
    fd = os.memfd_create("test-arena")
    os.ftruncate(fd, 1 << 20)
    arena = np.frombuffer(mmap.mmap(fd, 1 << 20), np.uint8)  # the workers' mapping of it
    released = sync.shared_array(16, np.int64)
    bells = sync.shared_array(2, np.int32)
    bell = Bell(bells, 0)
    bells[1] = 1                               # a sleeper: ring() bumps the sequence
    book = LeaseBook(fd, 1 << 20, released, bell)   # the book owns fd now
    v = book.view(3, 7, 8192, 4096)
    batch = v[:16].view(np.float32)            # an array of the batch keeps the slab alive
    del v
    gc.collect()
    assert released[3] == 0 and book.held == {3: (8192, 4096)} and bells[0] == 0
    del batch
    assert released[3] == 7 and bells[0] == 1 and book.held == {}  # at once: no GC needed
    with pytest.raises(ValueError, match="not inside the arena"):
        book.view(5, 1, (1 << 20) - 64, 128)
    # after close, a dropped batch's pages go back instead, once no other
    # held slab shares them
    arena[:] = 1
    w = book.view(4, 1, 3 * 4096, 8192)        # pages 3-4
    x = book.view(6, 1, 5 * 4096 - 64, 128)    # the end of page 4 and the start of page 5
    book.close()
    assert arena[:3 * 4096].max() == 0 and arena[6 * 4096:].max() == 0  # free pages discarded
    assert arena[3 * 4096:6 * 4096].min() == 1                         # held ones kept
    del w
    assert arena[3 * 4096:4 * 4096].max() == 0 and arena[4 * 4096:6 * 4096].min() == 1
    del x
    assert arena.max() == 0 and released[4] == 0 and released[6] == 0
    with pytest.raises(RuntimeError, match="closed"):
        book.view(7, 1, 0, 64)


# --- the batch table ----------------------------------------------------------------------

def layout_of(sample, rows=4, batched=True):
    return _layout.Layout(_layout.signature(sample), rows, batched)


def test_publish_and_unpublish_move_seq_through_an_odd_window():
    t = _table.BatchTable(4)
    lay = layout_of(np.zeros(3))
    base = t.base(run=3, batch=5)
    assert t.entry(3, 5) == 4 + 5 % 4 and t.entry(4, 5) == 5 % 4  # two parities
    t.publish(3, 5, 128, 77, lay, version=2, flags=_table.CONFIRMED, count=1)
    w = t.words
    assert w[base + _table.SEQ] == 2
    assert w[base + _table.STAMP] == _table.stamp(3, 5) and w[base + _table.OFFSET] == 128
    assert (w[base + _table.DIGEST0], w[base + _table.DIGEST1]) == lay.digest and w[base + _table.TOKEN] == 77
    f = t.filled_word(3, 5)
    assert _table.version_of(f) == 2 and _table.flags_of(f) == _table.CONFIRMED and _table.count_of(f) == 1
    t.unpublish(3, 5)
    assert w[base + _table.STAMP] == 0 and w[base + _table.SEQ] == 4


def test_counts_succeed_only_in_the_current_version():
    t = _table.BatchTable(4)
    lay = layout_of(np.zeros(3))
    t.publish(1, 0, 0, 1, lay, version=0, flags=0)
    assert t.count(1, 0, 0) == 1 and t.count(1, 0, 0) == 2
    assert t.freeze(1, 0) == 2                # version + 1, count kept, unpublished
    assert t.count(1, 0, 0) == -1             # a writer of the replaced slab must start over
    f = t.filled_word(1, 0)
    assert _table.version_of(f) == 1 and _table.count_of(f) == 2
    assert t.words[t.base(1, 0) + _table.STAMP] == 0


def test_replace_if_uncounted():
    t = _table.BatchTable(4)
    lay = layout_of(np.zeros(3))
    t.publish(1, 0, 0, 1, lay, version=0, flags=0)
    assert t.replace_if_uncounted(1, 0) is True
    f = t.filled_word(1, 0)
    assert _table.version_of(f) == 1 and _table.flags_of(f) == _table.CONFIRMED and _table.count_of(f) == 0
    t.publish(1, 0, 0, 1, lay, version=1, flags=0)
    t.count(1, 0, 1)
    assert t.replace_if_uncounted(1, 0) is False  # a row is counted: the layout stands
    f = t.filled_word(1, 0)
    assert _table.version_of(f) == 1 and _table.flags_of(f) == _table.CONFIRMED and _table.count_of(f) == 1
    t.add_flags(1, 0, _table.REFUSED)
    assert _table.flags_of(t.filled_word(1, 0)) == _table.CONFIRMED | _table.REFUSED


def test_the_compiled_writer_uses_the_tables_word_layout():
    k = _native.TABLE_CONSTANTS
    assert (k["STAMP"], k["OFFSET"], k["DIGEST0"], k["DIGEST1"], k["FILLED"], k["TOKEN"], k["SEQ"],
            k["WORDS"]) == (_table.STAMP, _table.OFFSET, _table.DIGEST0, _table.DIGEST1, _table.FILLED, _table.TOKEN, _table.SEQ, _table.WORDS)
    assert (k["CONFIRMED"], k["REFUSED"]) == (_table.CONFIRMED, _table.REFUSED)


class Recorder:
    """A worker's channel that records what the writer sends."""

    def __init__(self):
        self.sent = []

    def request_layout(self, *a):
        self.sent.append(("layout", a))

    def row_values(self, *a):
        self.sent.append(("values", a))

    def filled(self, *a):
        self.sent.append(("filled", a))

    def sample_row(self, *a):
        self.sent.append(("row", a))

    def wait_for_entry(self, run, batch, base, seq):
        self.sent.append(("wait", seq))
        return False  # as if the run ended


def writer(rows=2):
    t = _table.BatchTable(4)
    arena = sync.shared_array(1 << 16, np.uint8)
    hazards = sync.shared_array(2, np.int64)
    ch = Recorder()
    return t, arena, hazards, ch, _native.RowWriter(t, arena, hazards, 1, ch)


def test_the_writer_asks_for_a_layout_once_then_writes_rows_and_says_filled():
    t, arena, hazards, ch, w = writer()
    sample = {"x": np.arange(3, dtype=np.int16), "name": "a"}
    assert w.place(1, 0, 0, 2, 10, sample) == _native.ENDED  # nothing published
    (kind, args), (wait, _) = ch.sent
    assert kind == "layout" and wait == "wait"
    run, batch, row, sig, version, rows, batched = args
    assert (run, batch, row, version, rows, batched) == (1, 0, 0, -1, 2, True)
    assert sig == _layout.signature(sample)
    lay = _layout.Layout(sig, 2)
    t.publish(1, 0, 4096, 99, lay, 0, _table.CONFIRMED)
    ch.sent.clear()
    assert w.place(1, 0, 1, 2, 11, {"x": np.array([7, 8, 9], np.int16), "name": "b"}) == _native.WRITTEN
    assert w.place(1, 0, 0, 2, 10, sample) == _native.WRITTEN
    assert [k for k, _ in ch.sent] == ["values", "values", "filled"]
    assert ch.sent[0][1] == (1, 0, 1, lay.values_key, ["b"]) and ch.sent[2][1] == (1, 0)
    views = lay.views(arena[4096:4096 + lay.nbytes])
    assert views[0].tolist() == [[0, 1, 2], [7, 8, 9]]
    assert _table.count_of(t.filled_word(1, 0)) == 2 and hazards.tolist() == [0, 0]


def test_a_provisional_layout_that_differs_is_asked_to_change_then_the_row_is_sent_whole():
    t, arena, hazards, ch, w = writer()
    guess = _layout.Layout(_layout.signature(np.zeros(3)), 2)
    t.publish(1, 0, 0, 5, guess, 0, 0)        # a guess from earlier batches
    sample = np.zeros(4)
    assert w.place(1, 0, 0, 2, 3, sample) == _native.ENDED
    assert ch.sent[0][0] == "layout" and ch.sent[0][1][4] == 0  # about version 0
    t.add_flags(1, 0, _table.CONFIRMED)           # the batcher: a row was counted meanwhile
    ch.sent.clear()
    assert w.place(1, 0, 0, 2, 3, sample) == _native.SENT
    kind, (run, batch, row, pos, sent, version) = ch.sent[0]
    assert kind == "row" and (run, batch, row, pos, version) == (1, 0, 0, 3, 0) and sent is sample


def test_a_refused_batch_drops_rows_and_a_number_that_does_not_fit_is_a_collate_error():
    t, arena, hazards, ch, w = writer()
    lay = _layout.Layout(_layout.signature(5), 2)
    t.publish(1, 0, 0, 5, lay, 0, _table.CONFIRMED)
    with pytest.raises(_layout.CollateError, match="leaf 0 .*cannot be stored as int64"):
        w.place(1, 0, 0, 2, 0, 2 ** 70)
    assert hazards.tolist() == [0, 0] and _table.count_of(t.filled_word(1, 0)) == 0
    t.add_flags(1, 0, _table.REFUSED)
    assert w.place(1, 0, 1, 2, 1, 3) == _native.DROPPED


@pytest.mark.parametrize("sample", [
    np.arange(6.0).reshape(2, 3)[:, ::2],                     # strided: the reference path
    (np.float32(1.5), np.int8(-2), True, 7, 2.5, 1 + 2j),     # numbers and numpy scalars
    {"a": [np.uint8(3), None, b"x"], "b": np.array(4, np.int32)},
])
def test_the_compiled_writer_stores_exactly_what_the_reference_path_stores(sample):
    t, arena, hazards, ch, w = writer()
    sig, leaves = _layout.signature_and_leaves(sample)
    lay = _layout.Layout(sig, 2)
    t.publish(1, 0, 0, 5, lay, 0, _table.CONFIRMED)
    assert w.place(1, 0, 1, 2, 0, sample) == _native.WRITTEN
    reference = np.zeros(lay.nbytes, np.uint8)
    lay.write_row(reference, 1, leaves, 0)  # tag: the position given to place()
    np.testing.assert_array_equal(arena[:lay.nbytes], reference)


def test_torch_tensors_are_written_through_the_reference_path():
    torch = pytest.importorskip("torch")
    t, arena, hazards, ch, w = writer()
    sample = {"t": torch.arange(4, dtype=torch.float32), "s": torch.tensor(3)}
    sig, leaves = _layout.signature_and_leaves(sample)
    assert sig[1] == ((_layout.TENSOR, "<f4", (4,)), (_layout.TENSOR, "<i8", ()))  # a 0-d tensor stays 0-d
    lay = _layout.Layout(sig, 2)
    t.publish(1, 0, 0, 5, lay, 0, _table.CONFIRMED)
    assert w.place(1, 0, 0, 2, 0, sample) == _native.WRITTEN
    views = lay.views(arena[:lay.nbytes])
    assert views[0][0].tolist() == [0, 1, 2, 3] and views[1][0] == 3


# --- run words and bells ------------------------------------------------------------------

def run_counters(c):
    return _native.RunCounters(c.ctl, _control.RUN_LAYOUT)


def words(*, epoch, limit, size=-1, kept=-1, units=-1, nbatches=-1, order=_order.ORDER_RANGE,
          order_seed=0, base_seed=0):
    """A run's words, an iterable dataset's (-1) unless said."""
    return _control.RunWords(epoch=epoch, size=size, kept=kept, units=units, nbatches=nbatches,
                             order=order, order_seed=order_seed, offsets=0, base_seed=base_seed,
                             limit=limit)


def test_runs_are_claimed_by_tagged_cas_and_end_with_one_store():
    c = _control.Control(num_workers=2)
    counters = run_counters(c)
    c.start_run(1, words(epoch=1, size=10, kept=8, units=8, nbatches=2,
                         order=_order.ORDER_PERMUTATION, order_seed=5, base_seed=11, limit=3))
    assert c.latest_run() == 1 and c.live(1)
    assert [c.read(1, w) for w in (_control.EPOCH, _control.SIZE, _control.KEPT, _control.UNITS,
                                   _control.NBATCHES, _control.ORDER, _control.ORDER_SEED,
                                   _control.BASE_SEED)] == \
        [1, 10, 8, 8, 2, _order.ORDER_PERMUTATION, 5, 11]

    assert [counters.claim(1) for _ in range(3)] == [0, 1, 2]
    assert counters.claim(1, True) == 0 and c.claimed(1) == 3
    assert counters.below_limit(1, 2) and not counters.below_limit(1, 3)
    c.set_limit(1, 4)
    assert counters.below_limit(1, 3)
    c.start_run(2, words(epoch=2, size=10, kept=10, units=10, nbatches=3, limit=3))  # other parity
    assert counters.claim(2) == 0 and c.live(1)
    c.end_run(1)
    assert counters.claim(1) == -1 and counters.claim(1, True) == -1 and not c.live(1)
    assert c.claimed(1) == -1 and counters.claim(2) == 1
    c.stop()
    assert c.stopped


def test_iterable_runs_have_a_limit_per_worker():
    c = _control.Control(num_workers=2)
    c.start_run(1, words(epoch=1, limit=[3, 5]))
    assert c.limits.tolist() == [0, 0, 3, 5]  # run 1's parity: each worker's limit
    c.raise_worker_limit(1, 1)
    assert c.limits.tolist() == [0, 0, 3, 6]
    c.start_run(2, words(epoch=2, limit=[1, 1]))
    assert c.limits.tolist() == [1, 1, 3, 6]


def test_a_claim_of_an_old_run_fails_once_its_block_is_reused():
    c = _control.Control(num_workers=1)
    counters = run_counters(c)
    c.start_run(1, words(epoch=1, size=5, kept=5, units=5, nbatches=1, limit=5))
    c.start_run(3, words(epoch=3, size=5, kept=5, units=5, nbatches=1, limit=5))  # 1's block
    assert counters.claim(1) == -1 and counters.claim(3) == 0


def test_a_bell_wakes_a_sleeper_and_never_loses_a_ring():
    words = sync.shared_array(2, np.int32)
    bell = _native.Bell(words, 0)
    flag = []
    assert bell.wait(lambda: True, 5.0) is True      # ready at once: no sleep
    t0 = time.monotonic()
    assert bell.wait(lambda: False, 0.05) is False   # a bounded sleep
    assert time.monotonic() - t0 < 2
    bell.ring()                                      # nobody sleeps: nothing to do
    assert words[0] == 0
    threading.Timer(0.2, lambda: (flag.append(1), bell.ring())).start()
    t0 = time.monotonic()
    assert bell.wait(lambda: bool(flag), 10.0) is True
    assert time.monotonic() - t0 < 5 and words[1] == 0   # woken, not timed out
    with pytest.raises(TypeError):
        _native.Bell(sync.shared_array(2, np.int64), 0)
    with pytest.raises(IndexError):
        _native.Bell(words, 1)


# --- layouts ------------------------------------------------------------------------------

def test_layout_offsets_are_aligned_and_values_are_kept_apart():
    sig = _layout.signature({"a": np.zeros((2, 3), np.float32), "b": "text", "c": 1})
    lay = _layout.Layout(sig, rows=5)
    assert lay.offsets == [0, 128, 128]             # 5*24 bytes -> 128; "b" takes no room
    assert lay.row_nbytes == [24, 0, 8]
    assert lay.tags_offset == 192 and lay.nbytes == 256   # 5 int64 tags after the leaves
    assert lay.value_leaves == [1]
    spec = lay.spec(3, {0: ["x"], 1: ["y"], 2: ["z"]})
    assert spec.leaves == (_layout.ArrayLeaf(0, "<f4", (3, 2, 3), False), _layout.Value(["x", "y", "z"]),
                           _layout.ArrayLeaf(128, "<i8", (3,), False))
    assert _layout.unflatten(spec.structure, [1, 2, 3]) == {"a": 1, "b": 2, "c": 3}


def test_unbatched_layouts_keep_numbers_as_values_and_no_leading_axis():
    sig = _layout.signature({"x": np.zeros((2, 2), np.int8), "n": 7})
    lay = _layout.Layout(sig, rows=1, batched=False)
    assert lay.value_leaves == [1]
    assert lay.spec(1, {0: [7]}).leaves == (_layout.ArrayLeaf(0, "|i1", (2, 2), False), _layout.Value(7, False))


def test_digests_name_signature_rows_and_batching_exactly():
    a, b = _layout.signature(-1), _layout.signature(-2)
    assert _layout.Layout(a, 4).digest == _layout.Layout(b, 4).digest       # values do not matter
    assert _layout.Layout(a, 4).digest != _layout.Layout(a, 5).digest
    assert _layout.Layout(a, 1).digest != _layout.Layout(a, 1, batched=False).digest
    assert _layout.Layout(_layout.signature(np.zeros(2, "<f4")), 4).digest != \
        _layout.Layout(_layout.signature(np.zeros(2, "<f8")), 4).digest


def test_promotion_and_castability():
    i, f = _layout.signature({"y": 1}), _layout.signature({"y": 1.5})
    wide = _layout.promoted(i, f)
    assert wide == f and _layout.promoted(f, i) == f
    assert _layout.castable(i, _layout.Layout(f, 2)) and not _layout.castable(f, _layout.Layout(i, 2))
    assert _layout.promoted(_layout.signature(np.zeros(2)), _layout.signature(np.zeros(3))) is None
    assert _layout.promoted(_layout.signature(np.array(["a"])), _layout.signature(np.array([1.0]))) is None
    assert _layout.promoted(_layout.signature((1,)), _layout.signature([1])) is None
    assert "structure" in _layout.describe_difference(_layout.signature((1,)), _layout.signature([1]))


def test_object_arrays_and_ndarray_subclasses_are_refused():
    with pytest.raises(_layout.CollateError, match="Python objects"):
        _layout.signature(np.array([None, 1]))
    with pytest.raises(_layout.CollateError, match="subclass"):
        _layout.signature(np.ma.masked_array([1, 2]))
