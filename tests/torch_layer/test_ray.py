"""The loaders under Ray Train (TorchTrainer, 2 workers, gloo) on one local
cluster: tests/scripts/ray_train_run.py runs every trainer once in a
module-scoped fixture (Ray's start-up is most of the cost) and records
what each rank trained on; the tests below check those records.

Ray runs in a child process, never in pytest's own: ray.init leaves
threads behind in its driver, which would make every later loader in this
session fork beside them."""

import faulthandler
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("ray") is None:  # (not imported here: see the docstring)
    pytest.skip("ray[train] is not installed (the test extra has it)", allow_module_level=True)
torch = pytest.importorskip("torch")

from torch.utils.data import DistributedSampler  # noqa: E402

from loader import ShmLoader  # noqa: E402
from loader.main import procs as loader_procs  # noqa: E402

pytestmark = pytest.mark.timeout(400)  # the first test pays for the cluster's runs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ray_train_run.py"
N, BATCH, EPOCHS, WORLD = 100_000, 256, 2, 2
OURS = "loader.torch.dataloader.DataLoader"


def _readme_block() -> str:
    text = (ROOT / "docs" / "frameworks.md").read_text()
    section = text[text.index("## Training on a Ray cluster"):]
    return re.search(r"```py\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray")
    code = out / "readme_block.py"
    code.write_text(_readme_block())
    # The runs take 90-110 s on 2 busy cores, past the suite's 100 s stack-dump
    # watch (faulthandler_timeout), which would print pytest's own idle stack:
    # the bounds here are the child's 380 s limit and this module's timeout.
    faulthandler.cancel_dump_traceback_later()
    t = time.monotonic()
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), str(code)], cwd=ROOT,
                       capture_output=True, text=True, timeout=380,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    driver = json.loads((out / "driver.json").read_text())
    driver["times"]["total"] = time.monotonic() - t
    print("ray runs (s):", {k: round(v, 1) for k, v in driver["times"].items()})
    return out, driver


def _ranks(out: Path, phase: str):
    for r in range(WORLD):
        meta = json.loads((out / f"{phase}_rank{r}.json").read_text())
        with np.load(out / f"{phase}_rank{r}.npz") as z:
            yield meta, {k: z[k] for k in z.files}


def _share(rank: int, epoch: int, shuffle: bool = True) -> list:
    """The rank's indices of an epoch, as Ray's (or a user's) DistributedSampler gives them."""
    s = DistributedSampler(range(N), num_replicas=WORLD, rank=rank, shuffle=shuffle, seed=0)
    s.set_epoch(epoch)
    return list(s)


def _assert_disjoint_complete(per_rank: list[np.ndarray]) -> None:
    joined = np.concatenate(per_rank)
    assert len(joined) == N and np.array_equal(np.sort(joined), np.arange(N))


SHARDED_BY_SAMPLER = ["dl_sampler", "prep_shuffle", "prep_shuffle_nomove", "prep_custom"]
SHARDED_BY_SHM = ["shm", "prep_shm", "prep_shm_nomove"]


def test_every_loader_loads_disjoint_complete_shards_every_epoch(ray_runs):
    """Each variant, 2 epochs of 100,000 samples over 2 ranks: every rank
    gets its DistributedSampler's share in its order (ShmLoader: its own
    seeded order, the same with and without prepare_data_loader), the two
    shards are disjoint and complete, each epoch's order is new, and every
    sample was made by a worker process of the project's loader."""
    out, _ = ray_runs
    ranks = list(_ranks(out, "shards"))
    for meta, _ in ranks:
        assert meta["world"] == WORLD
    for name in SHARDED_BY_SAMPLER + SHARDED_BY_SHM:
        for epoch in range(EPOCHS):
            per_rank = [ids[f"{name}/{epoch}"] for _, ids in ranks]
            _assert_disjoint_complete(per_rank)
            for r, (meta, ids) in enumerate(ranks):
                if name in SHARDED_BY_SAMPLER:
                    assert ids[f"{name}/{epoch}"].tolist() == _share(r, epoch), (name, epoch, r)
                else:
                    assert np.array_equal(ids[f"{name}/{epoch}"], ranks[r][1][f"shm/{epoch}"])
                pids = ids[f"{name}/{epoch}/pids"].tolist()
                assert len(pids) == 2 and -1 not in pids and meta["pid"] not in pids, (name, pids)
        for r in range(WORLD):
            assert not np.array_equal(ranks[r][1][f"{name}/0"], ranks[r][1][f"{name}/1"])


def test_prepare_data_loader_keeps_the_projects_loader(ray_runs):
    """shuffle=True and a custom sampler (which Ray rebuilds with a
    DistributedSampler), device move on and off, and ShmLoader: the loader
    the loop iterates is the project's, inside Ray's device mover (with
    state_dict) when it moves; an unsharded ShmLoader is refused with the
    remedy."""
    out, _ = ray_runs
    for meta, _ in _ranks(out, "shards"):
        mover = "StatefulWrappedDataLoader"
        assert meta["kinds"] == {
            "shm": "ShmLoader/loader.main.loader.ShmLoader",
            "dl_sampler": f"DataLoader/{OURS}",
            "prep_shuffle": f"{mover}/{OURS}",
            "prep_shuffle_nomove": f"DataLoader/{OURS}",
            "prep_custom": f"{mover}/{OURS}",
            "prep_shm": f"{mover}/loader.main.loader.ShmLoader",
            "prep_shm_nomove": "ShmLoader/loader.main.loader.ShmLoader"}
        assert "distributed=True" in meta["refused"] and "add_dist_sampler=False" in meta[
            "refused"]


def test_kill_and_resume_mid_epoch_gives_every_sample_once_per_rank(ray_runs):
    """Four prepared loaders in lockstep (DataLoader and ShmLoader, device
    move on and off), checkpointed through ray.train.report mid epoch 0
    and mid epoch 1, both ranks SIGKILLed two steps after each, restarted
    by Ray and resumed from ray.train.get_checkpoint(): what each rank
    trained on (before each checkpoint, then after it) is its share of
    each epoch exactly once, batch for batch the unbroken run's order."""
    out, _ = ray_runs
    shards = [ids for _, ids in _ranks(out, "shards")]
    ranks = list(_ranks(out, "resume"))
    for meta, _ in ranks:
        assert meta["start_step"] == 300  # the last attempt resumed from the second checkpoint
        assert meta["steps"] == EPOCHS * (N // WORLD // BATCH + 1)
    for name in ("dl_move", "dl_nomove", "shm_move", "shm_nomove"):
        for epoch in range(EPOCHS):
            per_rank = [ids[f"{name}/{epoch}"] for _, ids in ranks]
            _assert_disjoint_complete(per_rank)
            for r in range(WORLD):
                got = per_rank[r].tolist()
                want = _share(r, epoch) if name.startswith("dl") else shards[r][
                    f"shm/{epoch}"].tolist()
                assert len(got) == len(set(got)) == N // WORLD, (name, epoch, r)
                assert got == want, (name, epoch, r)


def test_no_warnings_and_nothing_left_after_shutdown(ray_runs):
    """No rank saw a warning (the fork advice included: Ray's threads are
    its own); after ray.shutdown() no process of the cluster (Ray's own,
    its workers, their loaders' workers and batchers, those of killed
    attempts too) is alive, and none left an entry in /dev/shm."""
    out, driver = ray_runs
    for phase in ("shards", "resume"):
        for meta, _ in _ranks(out, phase):
            assert meta["warnings"] == [], meta["warnings"]
    assert driver["checked_pids"] >= 2 * WORLD * 3  # the ranks and their loaders' workers
    assert driver["ray_tree"] >= 4  # Ray's own processes were counted too
    assert driver["alive_after_shutdown"] == {}
    assert driver["shm_left"] == []


def test_readme_recipe_runs_as_written(ray_runs):
    """docs/frameworks.md's block ran on the cluster and its last checkpoint holds
    each rank's model, optimizer and loader state."""
    _, driver = ray_runs
    assert driver["readme_checkpoint"] == ["rank0.pt", "rank1.pt"]


def _fork_advice(threads_target) -> list[str]:
    """The warnings a ShmLoader gives as it forks from a thread other than
    main (as Train V2 runs the training function), beside a thread running
    threads_target."""
    stop = threading.Event()
    other = threading.Thread(target=threads_target, args=(stop,), daemon=True)
    other.start()
    caught, failure = [], []

    def training_thread():
        try:
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                loader = ShmLoader(list(range(64)), batch_size=8, num_workers=2)
                assert [int(i) for b in loader for i in b] == list(range(64))
                loader.close()
            caught.extend(str(w.message) for w in got)
        except BaseException as e:  # (re-raised in the test's thread)
            failure.append(e)

    t = threading.Thread(target=training_thread)
    t.start()
    t.join(60)
    stop.set()
    other.join(5)
    assert not t.is_alive() and not failure, failure
    return caught


def _waits(stop):
    stop.wait()


def _rays_own(stop):
    stop.wait()


_rays_own.__module__ = "ray.train.v2._internal.execution.worker_group.thread_runner"


def test_the_fork_advice_leaves_out_a_ray_workers_own_threads(monkeypatch):
    """In a Ray worker (ray._private.worker in worker mode), the main
    thread and threads whose target is Ray's are Ray's own: a ShmLoader
    forking beside them gives no advice the user cannot follow.  A thread
    of the user's in the same worker still gets it, as does any thread
    outside a Ray worker."""
    worker = types.SimpleNamespace(WORKER_MODE=1, global_worker=types.SimpleNamespace(mode=1))
    monkeypatch.setitem(sys.modules, "ray._private.worker", worker)
    monkeypatch.setattr(loader_procs, "_advised_threads", False)
    assert _fork_advice(_rays_own) == []
    advice = _fork_advice(_waits)
    assert len(advice) == 1 and "before starting threads" in advice[0]
    monkeypatch.setattr(loader_procs, "_advised_threads", False)
    worker.global_worker.mode = 0  # the driver: every other thread is the user's
    assert len(_fork_advice(_rays_own)) == 1


def _python(code: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter with warnings as errors (Ray is imported
    there, never in pytest's process)."""
    import os

    return subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("first", ["loader", "ray"])
def test_import_loader_installs_the_ray_integration_in_either_order(first):
    """`import loader` before or after `import ray.train.torch`: the
    function ray.train.torch exports (Train V2's), the V1 and V2 modules'
    own are the wrapped ones, and install() again changes nothing."""
    imports = ["import loader", "import ray.train.torch as rtt"]
    code = "\n".join(imports if first == "loader" else imports[::-1]) + """
import sys
from loader.torch.integrations import ray as integ
fn = rtt.prepare_data_loader
assert fn._keeps_loader, fn
for name in integ._RAY_MODULES:
    assert sys.modules[name].prepare_data_loader._keeps_loader, name
integ.install()
assert rtt.prepare_data_loader is fn
print("ok")
"""
    r = _python(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_rebuild_that_still_ends_on_torchs_class_warns_loudly():
    """A Ray whose prepare_data_loader builds the new loader some other way
    (here: torch's class by its own name, not the module's `DataLoader`):
    the result is handed back with a LoaderReplacedWarning naming the class
    and the way to keep the project's loader."""
    code = """
import types, warnings
import torch
import loader
from loader import DataLoader
from loader import LoaderReplacedWarning
from loader.torch.integrations.ray import _keeping

def rebuilds_as_torch(dl, add_dist_sampler, move_to_device, auto_transfer):
    return torch.utils.data.DataLoader(dl.dataset, batch_size=dl.batch_size)

mod = types.SimpleNamespace(DataLoader=torch.utils.data.DataLoader, _WrappedDataLoader=object)
with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    out = _keeping(rebuilds_as_torch, mod)(DataLoader(list(range(8)), batch_size=4))
assert type(out) is torch.utils.data.DataLoader
assert [w.category for w in got] == [LoaderReplacedWarning], got
text = str(got[0].message)
assert "torch.utils.data.dataloader.DataLoader" in text and "add_dist_sampler=False" in text
assert mod.DataLoader is torch.utils.data.DataLoader  # the names are put back
print("ok")
"""
    r = _python(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# Issue 28, item 11: the integration is installed however ray.train.torch
# comes to be imported (NOTE [ Installing the integrations ]).
_PREPARE_AS_RANK_0_OF_2 = """
import sys, warnings
import torch, loader
import ray.train, ray.train.torch as rtt
v2 = sys.modules["ray.train.v2.torch.train_loop_utils"]
class Ctx:
    def get_world_size(self): return 2
    def get_world_rank(self): return 0
    def get_local_rank(self): return 0
ray.train.get_context = lambda: Ctx()
v2.record_extra_usage_tag = lambda *a, **k: None
class Sampler(torch.utils.data.DistributedSampler):
    def __init__(self, dataset, shuffle=True, **kw):
        super().__init__(dataset, num_replicas=2, rank=0, shuffle=shuffle)
v2.DistributedSampler = Sampler
dl = loader.DataLoader(torch.utils.data.TensorDataset(torch.arange(100)), batch_size=10,
                       shuffle=True, num_workers=2)
out = rtt.prepare_data_loader(dl, move_to_device=False)
assert type(out) is loader.DataLoader, type(out)
seen = sorted(i for (x,) in out for i in x.tolist())
assert len(seen) == 50 and len(set(seen)) == 50, seen
from loader.torch.integrations import _pending
assert "ray.train.torch" not in _pending, _pending  # (accelerate's waits: it is not imported)
print("ok")
"""

_IMPORT_ORDERS = {
    "a find_spec probe first": """
import importlib.util, loader
assert importlib.util.find_spec("ray.train.torch") is not None
""",
    "an instrumenting finder ahead": """
import sys, importlib.abc, importlib.machinery, loader
class Instrument(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.startswith("ray.train"):
            return importlib.machinery.PathFinder.find_spec(name, path)
sys.meta_path.insert(0, Instrument())
""",
    "the first import failed, then retried": """
import sys, importlib.abc, loader
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "ray.train.torch.train_loop_utils":
            raise ImportError("simulated")
sys.meta_path.insert(0, Block())
try:
    import ray.train.torch
except ImportError:
    pass
else:
    raise AssertionError("the simulated failure did not happen")
del sys.meta_path[0]  # the program's own finder, still at index 0
assert type(sys.meta_path[0]).__name__ != "Block"
for m in [m for m in sys.modules if m.startswith("ray.train.torch")]:
    del sys.modules[m]
""",
}


@pytest.mark.parametrize("order", list(_IMPORT_ORDERS))
def test_the_ray_integration_survives_probes_other_finders_and_failed_imports(order):
    """repro_ray_integration_lost.py: the finder left sys.meta_path at the
    first find_spec (a probe's, whose spec nobody executes; a failed
    import's), or never saw the import (a finder ahead of it found the
    module): Ray then rebuilt the loader.DataLoader as torch's class,
    silently.  Each order: the prepared loader is loader.DataLoader, with
    rank 0's half of the samples, and Ray's install is no longer pending."""
    r = _python(_IMPORT_ORDERS[order] + _PREPARE_AS_RANK_0_OF_2)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_one_finder_waits_for_every_integration_and_leaves_when_done():
    code = """
import sys
import loader, loader.torch.dataloader
from loader.torch.integrations import _IntegrationFinder, _pending
finders = [f for f in sys.meta_path if isinstance(f, _IntegrationFinder)]
assert len(finders) == 1 and set(_pending) == {"ray.train.torch", "accelerate.data_loader"}, _pending
import ray.train.torch
assert set(_pending) == {"accelerate.data_loader"}, _pending
import accelerate
assert not _pending and finders[0] not in sys.meta_path
print("ok")
"""
    r = _python(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
