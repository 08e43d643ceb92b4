"""What a forked process holds, and what moves out of the pool (issue 28,
items 1-4; NOTE [ Kept batch memory ] in native/leases.pxi).

A process forked from the training process (an async checkpoint, an
evaluation helper, a multiprocessing 'fork' Process, another loader's
workers) inherits the batches the loop holds.  Whatever it does with them,
the parent's batches never change, and its own never change under it, as
with torch's DataLoader.  Kept memory moves out of a tight pool without
losing a write another thread makes, and a move the system refuses leaves
every leaf as it was while the loader goes on.

Every test is time-limited; the autouse guards (conftest.py) check that
nothing is left in /dev/shm and that no process outlives its test.  A
forked child here always ends with os._exit: it must never run pytest's
own code."""

import ctypes
import gc
import mmap
import multiprocessing as mp
import os
import textwrap
import threading

import numpy as np
import pytest

from loader import KeptBatchesShared, ShmLoader, _native

pytestmark = [
    pytest.mark.timeout(240),
    # Python >= 3.12 on a fork beside threads (thread workers, the writer threads
    # below): the children here only read memory and _exit, which is safe.
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

ROW = 1024           # int64 values a sample: 8 KiB
KiB, MiB = 1 << 10, 1 << 20
SLAB = 64 * ROW * 8 + 4096   # a batch of 64 rows, as the pool counts it (with its tags)


class Rows:
    """Sample i: ROW int64 values, all i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(ROW, i, np.int64)


def as_numpy(batch):
    return batch.numpy() if hasattr(batch, "numpy") else batch


def ids_of(batch) -> list[int]:
    """The sample of each row, checking that every value of the row says it."""
    b = as_numpy(batch)
    assert (b == b[:, :1]).all(), "a row mixes two samples"
    return b[:, 0].tolist()


def child_exit(check) -> None:
    """The body of a forked child: exit 0 if check() holds, 3 if not, 4 on
    an exception; never returns into pytest."""
    code = 4
    try:
        code = 0 if check() else 3
    finally:
        os._exit(code)


def exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def fork_checker(batch, kept, wake_after):
    """Fork a child that holds batch and kept, and, once woken, checks
    that every value is what it was at the fork, then drops them all."""
    r, w = os.pipe()
    now = as_numpy(batch).copy()
    expected = [as_numpy(v).copy() for _, v in kept]
    pid = os.fork()
    if pid == 0:
        os.close(w)

        def check():
            os.read(r, 1)  # the parent went on: the pool reused the slabs
            same = np.array_equal(as_numpy(batch), now) and all(
                np.array_equal(as_numpy(v), e) for (_, v), e in zip(kept, expected))
            kept.clear()
            gc.collect()  # every inherited lease dropped here
            return same
        child_exit(check)
    os.close(r)
    return [pid, w, wake_after]


def wake(children, seen) -> None:
    """Wake the children whose time came (seen: samples the parent has had)."""
    for child in children:
        if child[1] is not None and seen >= child[2]:
            os.write(child[1], b"x")
            os.close(child[1])
            child[1] = None


MODES = [  # (worker_mode, in_order, output, memory_cap_bytes)
    pytest.param("process", True, "numpy", 64 * MiB, id="process-in_order-numpy"),
    pytest.param("process", False, "torch", 8 * SLAB, id="process-first_ready-torch-tight"),
    pytest.param("thread", True, "torch", 64 * MiB, id="thread-in_order-torch"),
    pytest.param("thread", False, "numpy", 8 * SLAB, id="thread-first_ready-numpy-tight"),
]


def make(mode, in_order, output, cap, n=20_000, **kw):
    if output == "torch":
        pytest.importorskip("torch")
    return ShmLoader(Rows(n), batch_size=64, shuffle=True, seed=5, num_workers=2,
                     worker_mode=mode, in_order=in_order, output=output,
                     memory_cap_bytes=cap, timeout=60, **kw)


# --- items 1 and 2: forks while batches are held ----------------------------------------

@pytest.mark.parametrize("mode,in_order,output,cap", MODES)
def test_checkpoint_children_forked_every_40_batches_change_nothing(mode, in_order, output, cap):
    """Two epochs of 20,000 samples; the loop keeps a slice of every 10th
    batch, and every 40 batches forks a child (an async checkpoint) that
    holds the current batch and the kept slices, waits until the parent has
    gone 10 batches further (the pool reused the slabs), checks every value
    it holds, then drops them all and collects garbage before it exits.
    The parent's batches, kept or not, are exact throughout."""
    kept, children, seen = [], [], []   # children: [pid, pipe to wake it, when]
    with make(mode, in_order, output, cap) as ld:
        for epoch in range(2):
            for k, batch in enumerate(ld):
                ids = ids_of(batch)
                seen += ids
                if k % 10 == 0:
                    kept.append((ids[:3], batch[:3, :16]))
                if k % 40 == 20:
                    children.append(fork_checker(batch, kept, wake_after=len(seen) + 640))
                wake(children, len(seen))
                del batch
            assert sorted(seen[-20_000:]) == list(range(20_000))
        wake(children, float("inf"))
        codes = [exit_code(pid) for pid, _, _ in children]
        moved = ld.stats()["kept_slabs_moved_out"]
    assert codes == [0] * len(children) and len(children) == 16, codes
    assert moved > 0  # every fork moved what was held out of the pool
    for ids, v in kept:
        assert as_numpy(v)[:, 0].tolist() == ids
        assert (as_numpy(v) == np.array(ids)[:, None]).all()


@pytest.mark.parametrize("how", ["del + gc.collect()", "os._exit, nothing dropped",
                                 "mp fork Process(args=(batch,))"])
@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_a_child_that_drops_an_inherited_batch_never_frees_the_parents(how, worker_mode):
    """repro_child_drop_frees_parent_slab.py: the child's drop released the
    parent's lease, and the parent's kept batch became another batch."""
    with ShmLoader(Rows(400), batch_size=8, shuffle=True, seed=3, num_workers=2,
                   worker_mode=worker_mode, timeout=30) as ld:
        for epoch in range(3):
            it = iter(ld)
            kept = next(it)
            expected = kept.copy()
            if how.startswith("mp"):
                box = [kept]  # the child empties it: its only reference to the batch
                p = mp.get_context("fork").Process(target=_drop_and_exit, args=(box,))
                p.start()
                p.join(30)
                assert p.exitcode == 0
            else:
                pid = os.fork()
                if pid == 0:
                    if how.startswith("del"):
                        del kept, expected
                        gc.collect()
                    os._exit(0)
                assert exit_code(pid) == 0
            rest = [i for b in it for i in ids_of(b)]
            np.testing.assert_array_equal(kept, expected)
            assert sorted(ids_of(kept) + rest) == list(range(400))


def _drop_and_exit(box):
    box.clear()
    gc.collect()


def test_a_child_exiting_normally_after_the_parents_close_leaves_its_batches(procs):
    """The whole program, as a user writes it: 50 batches kept, close(),
    then a forked child that drops them (by garbage collection) and one that
    ends with sys.exit() -- a normal interpreter exit, module globals and
    all.  Before, the child's exit punched the pages out of the arena: the
    parent's 50 kept batches read zeros."""
    code = textwrap.dedent("""
        import gc, os, sys
        import numpy as np
        from loader import ShmLoader

        class D:
            def __len__(self): return 400
            def __getitem__(self, i): return np.full(1024, i, np.int64)

        L = ShmLoader(D(), batch_size=8, num_workers=2, timeout=30)
        kept = [b for b in L]
        expected = [b.copy() for b in kept]
        L.close()
        for how in ("gc", "sys.exit"):
            pid = os.fork()
            if pid == 0:
                if how == "gc":
                    del kept
                    gc.collect()
                    os._exit(0)
                sys.exit(0)
            os.waitpid(pid, 0)
            changed = sum(not np.array_equal(a, e) for a, e in zip(kept, expected))
            print(how, len(kept), changed, flush=True)
        # and a child that keeps reading after the parent dropped everything
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.read(r, 1)
            os._exit(0 if all(np.array_equal(a, e) for a, e in zip(kept, expected)) else 3)
        del kept
        gc.collect()
        os.write(w, b"x")
        _, st = os.waitpid(pid, 0)
        print("child after the parent dropped", os.waitstatus_to_exitcode(st), flush=True)
    """)
    p = procs.python(code)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert out.splitlines() == ["gc 50 0", "sys.exit 50 0", "child after the parent dropped 0"], \
        (out, err)


def _check_when_woken(batch, expected, r):
    os.read(r, 1)
    raise SystemExit(0 if np.array_equal(as_numpy(batch), expected) else 3)


@pytest.mark.parametrize("scenario", ["parent drops", "parent keeps, tight pool"])
@pytest.mark.parametrize("output,fork", [("numpy", "os.fork"), ("torch", "os.fork"),
                                         ("numpy", "mp fork Process(args=(batch,))")])
def test_what_a_forked_child_holds_never_changes_under_it(scenario, output, fork):
    """repro_fork_child_view.py: a child's batch changed once the parent
    dropped it, or once the pool moved the parent's copy out."""
    if output == "torch":
        pytest.importorskip("torch")
    cap = 2 * (8 * ROW * 8 + 4096) if "tight" in scenario else 64 * MiB
    with ShmLoader(Rows(2560), batch_size=8, shuffle=True, seed=1, num_workers=2, timeout=30,
                   memory_cap_bytes=cap, output=output) as ld:
        it = iter(ld)
        b = next(it)
        expected = as_numpy(b).copy()
        r, w = os.pipe()
        if fork == "os.fork":
            pid = os.fork()
            if pid == 0:
                os.close(w)

                def check():
                    os.read(r, 1)
                    return np.array_equal(as_numpy(b), expected)
                child_exit(check)
        else:
            p = mp.get_context("fork").Process(target=_check_when_woken, args=(b, expected, r))
            p.start()
        os.close(r)
        kept = b if "keeps" in scenario else None
        del b
        rest = []
        for k, batch in enumerate(it):
            rest += ids_of(batch)
            if k == 100:
                os.write(w, b"x")
        os.close(w)
        if fork == "os.fork":
            assert exit_code(pid) == 0
        else:
            p.join(30)
            assert p.exitcode == 0
        assert len(rest) == 2552
        if kept is not None:
            np.testing.assert_array_equal(as_numpy(kept), expected)


def test_a_fork_moves_each_held_batch_out_once_and_only_forks_not_the_loaders():
    """Before a fork, every slab the loop holds moves out (once: a second
    fork finds them moved); the loader's own workers, forked while batches
    are held (persistent_workers=False starts them at every epoch, a second
    loader starts its own), move nothing."""
    with ShmLoader(Rows(640), batch_size=64, num_workers=2, timeout=30,
                   persistent_workers=False) as ld:
        last = None
        for epoch in range(3):
            for batch in ld:
                last = batch  # held while the next epoch forks its workers
        with ShmLoader(Rows(64), batch_size=64, num_workers=2, timeout=30) as other:
            assert ids_of(next(iter(other))) == list(range(64))
        assert ld.stats()["kept_slabs_moved_out"] == 0
        assert ids_of(last) == list(range(576, 640))
    with ShmLoader(Rows(640), batch_size=64, num_workers=2, timeout=30) as ld:
        held = [batch for batch in ld][:4]
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            assert exit_code(pid) == 0
            assert ld.stats()["kept_slabs_moved_out"] == 4
        for batch in ld:
            pass
        assert [ids_of(b)[0] for b in held] == [0, 64, 128, 192]


def test_loader_DataLoader_batches_held_across_a_fork():
    torch = pytest.importorskip("torch")
    from loader import DataLoader

    class T(torch.utils.data.Dataset):
        def __len__(self):
            return 4000

        def __getitem__(self, i):
            return torch.full((ROW,), i, dtype=torch.int64)

    dl = DataLoader(T(), batch_size=50, shuffle=True, num_workers=2,
                    generator=torch.Generator().manual_seed(0))
    expected = list(torch.utils.data.DataLoader(T(), batch_size=50, shuffle=True,
                                                generator=torch.Generator().manual_seed(0)))
    kept = []
    for k, batch in enumerate(dl):
        kept.append(batch)
        if k % 20 == 10:
            pid = os.fork()
            if pid == 0:
                child_exit(lambda: all(torch.equal(a, b) for a, b in zip(kept, expected)))
            assert exit_code(pid) == 0
    assert len(kept) == 80 and all(torch.equal(a, b) for a, b in zip(kept, expected))


# --- item 3: writes from another thread while kept memory moves out ---------------------

BIG = 1 << 18   # 2 MiB rows


class BigRows:
    def __len__(self):
        return 300

    def __getitem__(self, i):
        return np.full(BIG, i, np.int64)


@pytest.mark.parametrize("output", ["numpy", "torch"])
@pytest.mark.parametrize("cap_slabs", [3, 1 << 10])
def test_in_place_writes_from_a_thread_survive_moves_out_of_the_pool(output, cap_slabs):
    """repro_thread_write_during_evict.py: a thread adds 1 in place to the
    last three kept batches (numpy and torch release the GIL inside) while a
    pool of three batches moves each kept batch out.  Every add is counted
    on every element; before, up to 333,060 elements lost one.  The roomy
    pool (nothing moves) is the control."""
    torch = pytest.importorskip("torch") if output == "torch" else None
    kept, lock, stop = [], threading.Lock(), threading.Event()

    def writer():
        add = (lambda a: a.add_(1)) if torch else (lambda a: np.add(a, 1, out=a))
        while not stop.is_set():
            with lock:
                last = kept[-3:]
            for entry in last:
                add(entry[0])
                entry[2] += 1   # only this thread writes the count
    ld = ShmLoader(BigRows(), batch_size=1, num_workers=2, timeout=60, output=output,
                   memory_cap_bytes=cap_slabs * (BIG * 8 + 4096))
    it = iter(ld)
    first = next(it)  # the workers are forked: now the thread
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        with lock:
            kept.append([first[0], 0, 0])
        del first
        for k, b in enumerate(it, start=1):
            with lock:
                kept.append([b[0], k, 0])
            del b
        moved = ld.stats()["kept_slabs_moved_out"]
    finally:
        stop.set()
        t.join(30)
        ld.close()
    assert (moved >= 290) if cap_slabs == 3 else moved == 0
    adds = sum(c for _, _, c in kept)
    assert adds > 0
    for arr, i, count in kept:
        a = arr.numpy() if torch else arr
        assert int((a != i + count).sum()) == 0, (i, count)


def test_writes_from_a_thread_survive_a_fork_that_moves_batches_out():
    kept, stop, counts = [], threading.Event(), []

    def writer():
        while not stop.is_set():
            for j, a in enumerate(list(kept)):
                np.add(a, 1, out=a)
                counts[j] += 1
    with ShmLoader(Rows(64 * 40), batch_size=64, num_workers=2, timeout=30) as ld:
        for batch in ld:
            kept.append(batch)
            counts.append(0)
        t = threading.Thread(target=writer, daemon=True)
        t.start()
        try:
            for _ in range(10):
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                assert exit_code(pid) == 0
        finally:
            stop.set()
            t.join(30)
        assert ld.stats()["kept_slabs_moved_out"] == 40
    for k, a in enumerate(kept):
        base = np.repeat(np.arange(64 * k, 64 * (k + 1)), ROW).reshape(64, ROW)
        np.testing.assert_array_equal(a, base + counts[k])


# --- item 4: a move the system refuses ------------------------------------------------

class Split:
    """a and c on different pages of the slab: two kept runs per batch."""

    def __len__(self):
        return 3000

    def __getitem__(self, i):
        return {"a": np.full(2, i, np.int64), "b": np.zeros(3 * 4096, np.uint8),
                "c": np.full(2, -i, np.int64)}


@pytest.mark.parametrize("refusals", [1, 12, 400])
@pytest.mark.parametrize("worker_mode,in_order", [("process", True), ("process", False),
                                                  ("thread", True)])
def test_refused_moves_keep_every_value_and_the_loader_goes_on(refusals, worker_mode, in_order):
    """The system refuses private pages for the next `refusals` moves (as
    one out of memory does): a refusal ahead of need is tried again later,
    one the pool waits for is a MemoryError naming the pool, and the next
    next() goes on.  Every batch is delivered exactly once, none is lost
    with its error, and every kept value is exact."""
    kept, delivered, errors = [], [], []
    with ShmLoader(Split(), batch_size=1, num_workers=2, timeout=30, worker_mode=worker_mode,
                   in_order=in_order, memory_cap_bytes=8 * 5 * 4096) as ld:
        it = iter(ld)
        while True:
            if len(delivered) == 30:
                _native._refuse_next_moves(refusals)
            try:
                b = next(it)
            except MemoryError as e:
                errors.append(str(e))
                continue
            except StopIteration:
                break
            k = int(b["a"][0, 0])
            delivered.append(k)
            kept.append((k, b["a"], b["c"]))
            del b
        _native._refuse_next_moves(0)
    assert sorted(delivered) == list(range(3000))
    if refusals == 400:  # more than moves ahead of need can absorb: the pool waited
        assert errors and all("batch pool (163840 bytes, memory_cap_bytes) is full" in e
                              and "Cannot allocate memory" in e for e in errors)
    assert refusals >= len(errors)
    for k, a, c in kept:
        assert a.tolist() == [[k, k]] and c.tolist() == [[-k, -k]]


libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def vmas() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_at_vm_max_map_count_the_loader_waits_for_mappings_then_goes_on():
    """repro_mapcount_then_hang.py and repro_half_moved_slab.py: mappings
    used up (every other page of one mapping made read-only) until moving
    kept batches out is refused; then given back.  Before, a half-moved
    batch read another batch's values, and the iterator never delivered
    again."""
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    if limit > 1 << 20:
        pytest.skip(f"vm.max_map_count is {limit}: too many mappings to use up in a test")
    page = mmap.PAGESIZE
    n = (limit - vmas() - 600) // 2
    hog = mmap.mmap(-1, 2 * n * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(hog))
    try:
        for i in range(n):
            libc.mprotect(base + 2 * i * page, page, mmap.PROT_READ)
        kept, errors = [], []
        with ShmLoader(Split(), batch_size=1, num_workers=2, timeout=30,
                       memory_cap_bytes=8 * 5 * 4096) as ld:
            it = iter(ld)
            while not errors:
                try:
                    b = next(it)
                except MemoryError as e:
                    errors.append(str(e))
                    break
                kept.append((int(b["a"][0, 0]), b["a"], b["c"]))
                del b
            for i in range(n):
                libc.mprotect(base + 2 * i * page, page, mmap.PROT_READ | mmap.PROT_WRITE)
            kept = kept[::2]
            for b in it:
                kept.append((int(b["a"][0, 0]), b["a"], b["c"]))
                del b
            for b in ld:  # another epoch through the same pool
                pass
        assert errors and "Cannot allocate memory" in errors[0]
        ks = [k for k, _, _ in kept]
        assert len(ks) == len(set(ks)) and ks[-1] == 2999
        for k, a, c in kept:
            assert a.tolist() == [[k, k]] and c.tolist() == [[-k, -k]]
    finally:
        del base
        hog.close()


def test_a_fork_whose_moves_are_refused_warns_and_the_parent_keeps_its_batches():
    with ShmLoader(Rows(640), batch_size=64, num_workers=2, timeout=30) as ld:
        held = list(ld)
        _native._refuse_next_moves(1)
        with pytest.warns(KeptBatchesShared, match="views of those batches may change"):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
        assert exit_code(pid) == 0
        _native._refuse_next_moves(0)
        for b in ld:  # the pool goes on around the batches still held
            pass
        assert [ids_of(b) for b in held] == [list(range(64 * k, 64 * (k + 1)))
                                             for k in range(10)]
