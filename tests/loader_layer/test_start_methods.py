"""start_method="spawn" against the fork start (issue 29, item 3): the same
batches, exactly, over several epochs (map-style and iterable datasets,
in_order True and False, a resume from state_dict), worker_init_fn and
the workers' seeds as with fork, a worker's exception raised in main the
same way, rows that are views of the one arena, an unpicklable dataset
refused by a typed error, nothing left after a SIGKILL of main, and a
jitted JAX loop that gets no fork warning.  See NOTE [ Starting clean ]
in loader/shared/passable.py."""

import os
import random
import signal
import textwrap
import time

import numpy as np
import pytest
from extras import import_or_skip_on_older_python  # tests/support

from killkit import Program, assert_nothing_left, loader_program
# (not DataLoader here: it imports torch, and spawned workers import this
# module to unpickle its datasets)
from loader import ArgumentTypeError, ShmLoader, get_worker_info
from shared_datasets import Filled

pytestmark = pytest.mark.timeout(180)

EPOCHS = 3


class Drawn:
    """Sample i: i, draws from numpy's and random's global generators, and
    what worker_init_fn left in this process (0 if it did not run here)."""

    def __init__(self, n=203):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": np.int64(i), "np": np.random.rand(2), "py": random.random(),
                "init": np.int64(_INIT["mark"])}


class Stream:
    """An iterable dataset: worker w of W yields the arrays filled with
    w, w + W, ... (each worker its own share)."""

    def __init__(self, n=150):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield np.full(3, i, np.int64) + np.int64(_INIT["mark"])


class Failing:
    """Sample 37 raises a KeyError; the others are their index."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 37:
            raise KeyError(f"no sample {i}")
        return np.int64(i)


class Unpicklable:
    """A dataset holding a lambda: pickle refuses it."""

    def __init__(self):
        self.transform = lambda x: x + 1

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.transform(i)


_INIT = {"mark": 0}  # set by mark_worker in each worker; main's stays 0


def mark_worker(worker_id):
    """worker_init_fn: runs in the worker, before its first sample."""
    _INIT["mark"] = 1000 + 10 * worker_id + (get_worker_info().num_workers == 2)


def as_rows(batch) -> list:
    """A batch as plain values, to compare runs exactly."""
    if isinstance(batch, dict):
        return [(int(i), tuple(batch["np"][k].tolist()), float(batch["py"][k]),
                 int(batch["init"][k])) for k, i in enumerate(batch["i"])]
    return [tuple(row) for row in np.asarray(batch).tolist()]


def epochs(loader, n=EPOCHS) -> list:
    return [[as_rows(b) for b in loader] for _ in range(n)]


def loader_of(dataset, start_method, **kw) -> ShmLoader:
    kw.setdefault("num_workers", 2)
    return ShmLoader(dataset, start_method=start_method, worker_init_fn=mark_worker, **kw)


def without_worker_marks(runs):
    """The rows without the worker_init_fn mark, which says which worker
    loaded a sample (the workers claim samples as they come)."""
    return [[[row[:3] for row in batch] for batch in run] for run in runs]


@pytest.mark.parametrize("in_order", [True, False])
def test_map_dataset_batches_are_those_of_the_fork_start(in_order):
    """Shuffled, seeded: every epoch the same batches with the same draws
    (in first-ready mode: the same rows, batches in another order); every
    row loaded by a worker whose worker_init_fn ran (mark 1000 + 10 id + 1),
    as with fork."""
    kw = dict(batch_size=16, shuffle=True, seed=7, in_order=in_order)
    with loader_of(Drawn(), "fork", **kw) as ld:
        forked = epochs(ld)
    with loader_of(Drawn(), "spawn", **kw) as ld:
        spawned = epochs(ld)
    assert sum(len(b) for b in forked[0]) == 203 and len(forked[0]) == 13
    marks = {row[3] for run in spawned for batch in run for row in batch}
    assert marks <= {1001, 1011} and marks == {row[3] for run in forked for b in run for row in b}
    if in_order:
        assert without_worker_marks(spawned) == without_worker_marks(forked)
    else:
        for f, s in zip(without_worker_marks(forked), without_worker_marks(spawned)):
            assert sorted(r for b in s for r in b) == sorted(r for b in f for r in b)
            assert sorted(r[0] for b in s for r in b) == list(range(203))


@pytest.mark.parametrize("in_order", [True, False])
def test_iterable_dataset_streams_are_those_of_the_fork_start(in_order):
    """Each worker's share, its worker_init_fn's mark added: in order, the
    exact sequence of batches; first-ready, the same batches."""
    kw = dict(batch_size=8, in_order=in_order, num_workers=3)
    with loader_of(Stream(), "fork", **kw) as ld:
        forked = epochs(ld)
    with loader_of(Stream(), "spawn", **kw) as ld:
        spawned = epochs(ld)
    expected = sorted(i + 1000 + 10 * (i % 3) for i in range(150))
    for run in forked + spawned:
        assert sorted(row[0] for batch in run for row in batch) == expected
    if in_order:
        assert spawned == forked
    else:
        assert [sorted(run) for run in spawned] == [sorted(run) for run in forked]


def test_worker_seeds_without_a_seed_per_sample_are_those_of_fork():
    """reproducible=False: each worker's generators are seeded once, from
    (seed, worker id), as with fork.  Which worker loads which sample is a
    race, but the k-th draw of a worker is its seed's alone: each worker's
    draws, in the order it loaded its samples (by index: it claims them in
    order), agree with the fork start's as far as both go."""
    kw = dict(batch_size=8, seed=3, reproducible=False, num_workers=2)

    def draws_by_worker(run):
        by = {}
        for i, d, p, mark in sorted(row for batch in run for row in batch):
            by.setdefault(mark, []).append((d, p))
        return by

    with loader_of(Drawn(96), "spawn", **kw) as ld:
        spawned = draws_by_worker(epochs(ld, 1)[0])
    assert set(spawned) <= {1001, 1011} and sum(map(len, spawned.values())) == 96
    # On a loaded machine one worker may load every sample of a run: fork
    # runs until each worker that loaded under spawn has loaded under fork
    # too (each run's draws of a worker are a prefix of the same sequence).
    forked: dict = {}
    for _ in range(10):
        with loader_of(Drawn(96), "fork", **kw) as ld:
            for mark, draws in draws_by_worker(epochs(ld, 1)[0]).items():
                known = forked.get(mark, [])
                n = min(len(known), len(draws))
                assert known[:n] == draws[:n], mark
                forked[mark] = max(known, draws, key=len)
        if set(spawned) <= set(forked):
            break
    assert set(spawned) <= set(forked) <= {1001, 1011}
    for mark in spawned:
        n = min(len(forked[mark]), len(spawned[mark]))
        assert n > 0 and forked[mark][:n] == spawned[mark][:n], mark


@pytest.mark.parametrize("in_order", [True, False])
def test_resume_from_state_dict_continues_as_the_fork_start(in_order):
    """state_dict() after 5 batches of epoch 1 of a spawn loader, loaded
    into a new spawn loader: the rest of that epoch and the next are the
    uninterrupted fork run's."""
    kw = dict(batch_size=10, shuffle=True, seed=11, in_order=in_order)
    with loader_of(Drawn(), "fork", **kw) as ld:
        forked = without_worker_marks(epochs(ld))
    with loader_of(Drawn(), "spawn", **kw) as ld:
        next_epochs = [as_rows(b) for b in ld]  # epoch 0
        it = iter(ld)
        seen = [as_rows(next(it)) for _ in range(5)]
        state = ld.state_dict()
    with loader_of(Drawn(), "spawn", **kw) as resumed:
        resumed.load_state_dict(state)
        rest = [as_rows(b) for b in resumed]
        after = [as_rows(b) for b in resumed]
    cut = without_worker_marks([next_epochs, seen + rest, after])
    if in_order:
        assert cut == forked[:3]
    else:
        for f, s in zip(forked, cut):
            assert sorted(r for b in s for r in b) == sorted(r for b in f for r in b)


def test_rows_are_views_of_the_one_arena():
    """Zero-copy: every batch of a spawn loader lies in main's mapping of
    the arena, where the spawned workers wrote its rows."""
    with ShmLoader(Filled(256, (64,), np.float32), batch_size=32, num_workers=2,
                   start_method="spawn") as ld:
        for k, b in enumerate(ld):
            # main views slabs through its lease book's mapping of the arena
            lo, size = ld._session.leases.address, ld._session.shared.arena.nbytes
            at = b.__array_interface__["data"][0]
            assert lo <= at and at + b.nbytes <= lo + size, k
            assert b[:, 0].tolist() == list(range(32 * k, 32 * k + 32))
            assert not b.flags.owndata


def test_trace_records_every_spawned_process(tmp_path):
    """trace=PATH with start_method="spawn": the records' words are a
    memfd too; every sample's load is there once per epoch, by a spawned
    worker's pid, as with fork (test_trace.py)."""
    import json

    path = str(tmp_path / "spawn.json")
    with ShmLoader(Filled(64), batch_size=8, num_workers=2, start_method="spawn",
                   trace=path) as ld:
        for _ in range(2):
            assert sum(len(b) for b in ld) == 64
        workers = {c.pid for c in ld._session.worker_children()}
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    loads = [e for e in events if e["name"] == "load" and e["ph"] == "X"]
    for epoch in (1, 2):  # (epoch 3 may have begun: the next epoch loads ahead)
        assert sorted(e["args"]["index"] for e in loads if e["args"]["epoch"] == epoch) \
            == list(range(64))
    assert {e["pid"] for e in loads} <= workers


def test_spawn_loaders_made_and_dropped_leave_no_descriptor():
    """R6 for start_method="spawn": the memfds a spawn start keeps open for
    its children (word arrays, rings, the arena's copy) are closed with the
    loader, whether it is closed or dropped mid-epoch."""
    import gc

    def open_fds():
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    with ShmLoader(Filled(16), batch_size=8, num_workers=1, start_method="spawn") as ld:
        assert sum(len(b) for b in ld) == 16
    before = open_fds()
    for _ in range(3):
        with ShmLoader(Filled(16), batch_size=8, num_workers=1, start_method="spawn") as ld:
            assert sum(len(b) for b in ld) == 16
    ld = ShmLoader(Filled(16), batch_size=8, num_workers=1, start_method="spawn")
    it = iter(ld)
    assert next(it)[:, 0].tolist() == list(range(8))
    del it, ld
    assert open_fds() == before


def test_a_workers_exception_is_raised_in_main_as_with_fork():
    """The dataset's own KeyError, with its text, from either start."""
    for start_method in ("fork", "spawn"):
        with ShmLoader(Failing(), batch_size=8, num_workers=2, start_method=start_method) as ld:
            with pytest.raises(KeyError, match="no sample 37"):
                for _ in ld:
                    pass


def test_an_unpicklable_dataset_is_a_typed_error_naming_it():
    """Refused before any process starts: an ArgumentTypeError (a
    TypeError) naming the dataset's class and what to do; iter() again
    says the same, and fork loads it."""
    ld = ShmLoader(Unpicklable(), batch_size=4, num_workers=2, start_method="spawn")
    for _ in range(2):
        with pytest.raises(ArgumentTypeError, match=r"the dataset \(a test_start_methods\."
                                                    r"Unpicklable\).*start_method='fork'") as info:
            iter(ld)
        assert isinstance(info.value, TypeError)
    ld.close()
    with ShmLoader(Unpicklable(), batch_size=4, num_workers=2) as ld:
        assert [b.tolist() for b in ld] == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_a_sampler_and_generator_only_main_uses_need_not_pickle():
    """The sampler, batch sampler and generator stay in main (it plans the
    epochs): a spawn start does not send them, so one holding a lambda
    works as under fork, batch for batch."""
    class Reversed:
        def __init__(self, n):
            self.n, self.key = n, lambda i: -i     # a lambda: not picklable

        def __len__(self):
            return self.n

        def __iter__(self):
            return iter(sorted(range(self.n), key=self.key))

    got = {}
    for start in ("fork", "spawn"):
        with ShmLoader(Filled(40), batch_size=8, num_workers=2, sampler=Reversed(40),
                       start_method=start) as ld:
            got[start] = [[b[:, 0].tolist() for b in ld] for _ in range(2)]
    want = [[[39 - 8 * k - j for j in range(8)] for k in range(5)]] * 2
    assert got["spawn"] == got["fork"] == want


def test_an_unpicklable_worker_init_fn_is_named():
    ld = ShmLoader(Filled(8), batch_size=4, num_workers=1, start_method="spawn",
                   worker_init_fn=lambda wid: None)
    with pytest.raises(ArgumentTypeError, match=r"the worker_init_fn \(test_start_methods\.test_an_"
                                                r"unpicklable_worker_init_fn_is_named\.<locals>\."
                                                r"<lambda>\)"):
        iter(ld)
    ld.close()


def test_the_fork_advice_names_spawn_and_a_spawn_start_needs_none(monkeypatch):
    """R16: with another thread running, the fork start's advice names
    start_method='spawn'; a spawn start forks nothing and gives none."""
    import threading
    import warnings

    from loader.main import procs as _procs

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        monkeypatch.setattr(_procs, "_advised_threads", False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with ShmLoader(Filled(16), batch_size=8, start_method="spawn") as ld:
                assert [b[:, 0].tolist() for b in ld] == [list(range(8)), list(range(8, 16))]
        with ShmLoader(Filled(16), batch_size=8) as ld:
            with pytest.warns(RuntimeWarning, match="or pass start_method='spawn'"):
                it = iter(ld)
            assert [b[:, 0].tolist() for b in it] == [list(range(8)), list(range(8, 16))]
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("value, match", [
    ("forkserver", "'spawn' starts the processes clean"),
    ("thread", "must be 'fork'"),
])
def test_start_method_refuses_what_it_does_not_know(value, match):
    with pytest.raises(ValueError, match=match):
        ShmLoader(Filled(8), start_method=value)


def test_spawn_with_thread_workers_is_refused():
    with pytest.raises(ValueError, match="worker_mode='thread' starts none"):
        ShmLoader(Filled(8), start_method="spawn", worker_mode="thread")


def test_auto_workers_added_later_are_spawned_too():
    """num_workers="auto" starts workers while an epoch runs: in spawn
    mode those are spawned as well, and every sample comes exactly once."""
    with ShmLoader(Filled(200), batch_size=10, num_workers="auto", max_workers=3,
                   start_method="spawn") as ld:
        it = iter(ld)
        got = [next(it)[:, 0].tolist()]
        ld._set_active_workers(3)  # as the autoscaler does (main/autoscale.py)
        got += [b[:, 0].tolist() for b in it]
        assert len(ld._session.worker_children()) == 3
    assert sum(got, []) == list(range(200))


@pytest.mark.parametrize("context, started", [
    ("spawn", "spawn"), ("forkserver-context", "spawn"), ("fork", "fork")])
def test_dataloader_multiprocessing_context_chooses_the_start(context, started):
    """loader.DataLoader: multiprocessing_context="spawn" or "forkserver"
    (a name or a context) starts clean, as ShmLoader(start_method=
    "spawn"); "fork" forks; the batches are torch's.  (One worker: each
    spawned one imports torch.)"""
    pytest.importorskip("torch")
    import multiprocessing

    from loader import DataLoader
    from torch_conformance_datasets import Indexed

    if context.endswith("-context"):
        context = multiprocessing.get_context(context[:-len("-context")])
    dl = DataLoader(Indexed(23), batch_size=4, num_workers=1, multiprocessing_context=context)
    assert sum((b.tolist() for b in dl), []) == list(range(23))
    assert dl._shm.start_method == started
    dl.close()


class TorchDrawn:
    """Sample i: i and draws from torch's, numpy's and random's global
    generators (torch imported in the worker: this module must not import
    it, spawned workers import this module)."""

    def __len__(self):
        return 60

    def __getitem__(self, i):
        import torch

        return {"i": i, "t": torch.rand(2), "np": float(np.random.rand()), "py": random.random()}


def test_dataloader_spawn_seeds_workers_by_torchs_rules_as_fork():
    """loader.DataLoader, shuffled with a generator, 2 workers, 2 epochs:
    multiprocessing_context="spawn" gives the fork start's batches, every
    draw included (base_seed + worker id, as torch seeds its workers)."""
    torch = pytest.importorskip("torch")
    from loader import DataLoader

    def run(context):
        dl = DataLoader(TorchDrawn(), batch_size=6, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(4), persistent_workers=True,
                        multiprocessing_context=context)
        try:
            return [[(b["i"].tolist(), b["t"].tolist(), b["np"].tolist(), b["py"].tolist())
                     for b in dl] for _ in range(2)]
        finally:
            dl.close()

    forked, spawned = run("fork"), run("spawn")
    assert sorted(sum((b[0] for b in forked[0]), [])) == list(range(60))
    assert spawned == forked


# --- main killed; JAX ----------------------------------------------------------------

KILLED = loader_program("""
    loader = ShmLoader(Filled(10 ** 9), batch_size=8, num_workers=2, start_method="spawn")
    it = iter(loader)
    print("pids", *[p.pid for p in loader._session.procs], flush=True)
    done = 0
    for b in it:
        assert b[:, 0].tolist() == list(range(done, done + 8))
        done += 8
        if done == 80:
            print("iterating", flush=True)
""")


def test_sigkill_of_main_leaves_no_spawned_process_and_nothing_in_dev_shm():
    """R4/R22 for start_method="spawn": the spawned workers and batcher die
    with main (the parent-death signal they ask for first thing), and
    nothing has a name in /dev/shm."""
    _kill_main_once_it_says(KILLED, "iterating", children=3)


def _kill_main_once_it_says(code: str, line: str, children: int | None = None) -> None:
    """SIGKILL the program's main process (only it) once it prints `line`;
    then nothing of its tree is left, in the process table or /dev/shm."""
    prog = Program(code)
    try:
        prog.wait_for(line, 60)
        if children is not None:
            assert len(prog.reported_pids()) == children
        prog.signal(signal.SIGKILL, group=False)
        sent = time.monotonic()
        assert prog.wait(10) == -signal.SIGKILL
        assert_nothing_left(prog, since=sent, within=5.0)
    finally:
        prog.cleanup()


STARTING = loader_program("""
    print("ready", flush=True)
    while True:
        with ShmLoader(Filled(16), batch_size=8, num_workers=2, start_method="spawn") as loader:
            it = iter(loader)
            print("pids", *[p.pid for p in loader._session.procs], flush=True)
            assert [b[:, 0].tolist() for b in it] == [list(range(8)), list(range(8, 16))]
""")


def test_sigkill_of_main_while_spawned_children_start_leaves_nothing():
    """Killed while its children are still starting (importing the
    loader): they ask to die with main before anything slow, so they go."""
    _kill_main_once_it_says(STARTING, "pids")  # a start just began: the next children import


JAX_LOOP = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, {support!r})
    warnings.simplefilter("error", RuntimeWarning)   # -W error::RuntimeWarning, as asked
    import numpy as np
    import jax, jax.numpy as jnp
    from shared_datasets import Filled
    from loader import ShmLoader

    @jax.jit
    def step(w, x):
        return w + jnp.sum(x * x, axis=0)

    w = step(jnp.zeros(16, jnp.float32), jnp.ones((4, 16), jnp.float32))  # JAX's threads run
    caught = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ShmLoader(Filled(200, (16,), np.float32), batch_size=20, num_workers=2,
                       shuffle=True, seed=5, output="numpy", start_method=sys.argv[1]) as ld:
            for epoch in range(2):
                for b in ld:
                    w = step(w, b)
    print("warnings", len([c for c in caught if "fork" in str(c.message)]))
    print("result", *np.asarray(w).tolist())
""")


def test_a_jitted_jax_loop_gets_no_fork_warning_and_the_fork_starts_values():
    """JAX imported and run before the loader starts: with
    start_method="spawn" no RuntimeWarning about os.fork() (none recorded,
    none on stderr) and the jitted loop's result is the fork start's
    batches' (computed here without JAX, so nothing forks a JAX process);
    with start_method="fork", JAX's warning does come (the check can fail)."""
    import_or_skip_on_older_python("jax")
    support = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support")
    code = JAX_LOOP.format(support=support)
    expected = np.zeros(16, np.float32) + np.float32(4.0)
    with ShmLoader(Filled(200, (16,), np.float32), batch_size=20, num_workers=2, shuffle=True,
                   seed=5) as ld:
        for _ in range(2):
            for b in ld:
                expected = expected + np.sum(b * b, axis=0, dtype=np.float32)
    for start_method in ("spawn", "fork"):
        prog = Program(code, start_method)
        try:
            code_ = prog.wait(120)
            out, err = prog.stdout(), prog.stderr()
            assert code_ == 0, err
            lines = dict(line.split(" ", 1) for line in out)
            if start_method == "spawn":
                assert lines["warnings"] == "0", err
                assert err == ""  # no fork warning, nor anything from the spawned processes
                assert [float(v) for v in lines["result"].split()] == expected.tolist()
            else:
                assert lines["warnings"] != "0" or "os.fork() was called" in err, (out, err)
        finally:
            prog.cleanup()
