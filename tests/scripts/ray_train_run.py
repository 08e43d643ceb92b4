"""Run by tests/torch_layer/test_ray.py: the project's loaders under Ray Train, on one
local Ray cluster (ray.init(num_cpus=2)) shared by every run below.

    ray_train_run.py OUT README_CODE

Three TorchTrainer runs, 2 workers each (gloo):
- shards: each rank iterates, for EPOCHS epochs each, ShmLoader(distributed=True),
  loader.DataLoader with a DistributedSampler, and prepare_data_loader() of a
  DataLoader(shuffle=True), a DataLoader with a custom sampler, and a
  ShmLoader, with the device move on and off; OUT/shards_rank<r>.npz holds
  the ids of every epoch and the pids that loaded them.
- resume: four prepared loaders (DataLoader and ShmLoader, device move on
  and off) iterated in lockstep; a checkpoint (ray.train.report) mid epoch
  0 and mid epoch 1, each followed two steps later by SIGKILL of both
  ranks; Ray restarts the workers (FailureConfig) and each rank resumes its
  loaders from its own states (ray.train.get_checkpoint()).  The ids
  trained before a checkpoint travel in it, so OUT/resume_rank<r>.npz holds
  what a real run trained on.
- readme: docs/frameworks.md's "Training on a Ray cluster" block (README_CODE), as
  written.
OUT/driver.json: the ranks' warnings, loader classes, Ray's worker pids, and
what was left in /dev/shm or alive after ray.shutdown().
"""

import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

N, BATCH, EPOCHS = 100_000, 256, 2
CHECKPOINTS = (60, 300)   # global steps (per rank: 196 an epoch): mid epoch 0, mid epoch 1
KILL_AFTER = 2            # steps after a checkpoint each rank kills itself


class Ids:
    """Sample i: features i, the id, and the pid of the process that made
    it (-1 when loader.get_worker_info() is None: not the project's worker)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        import loader

        pid = os.getpid() if loader.get_worker_info() is not None else -1
        return np.full(4, i, np.float32), i, pid


class EvenFirst:
    """A custom sampler: Ray replaces it with a DistributedSampler."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(list(range(0, self.n, 2)) + list(range(1, self.n, 2)))


def _record_warnings():
    import warnings

    catcher = warnings.catch_warnings(record=True)
    caught = catcher.__enter__()
    warnings.simplefilter("always")
    return catcher, caught


def _warning_texts(caught) -> list:
    return [f"{w.category.__name__} {w.filename}:{w.lineno}: {str(w.message)[:300]}"
            for w in caught]


def _batch_parts(batch):
    x, ids, pids = batch
    return np.asarray(ids).tolist(), set(np.asarray(pids).tolist())


def _inner(dl):
    return getattr(dl, "_dataloader", dl)


def _kind(dl) -> str:
    inner = _inner(dl)
    return f"{type(dl).__name__}/{type(inner).__module__}.{type(inner).__name__}"


def _set_epoch(dl, epoch):
    sampler = getattr(_inner(dl), "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def _shards_loop(config):
    import ray.train
    import ray.train.torch as rtt
    from torch.utils.data import DistributedSampler

    from loader import DataLoader, ShmLoader

    catcher, caught = _record_warnings()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    ds = Ids()
    shm = lambda: ShmLoader(ds, batch_size=BATCH, shuffle=True, seed=0, num_workers=2,  # noqa
                            distributed=True, output="torch")
    makers = {
        "shm": shm,
        "dl_sampler": lambda: DataLoader(ds, batch_size=BATCH, num_workers=2,
                                         sampler=DistributedSampler(ds, seed=0)),
        "prep_shuffle": lambda: rtt.prepare_data_loader(
            DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2)),
        "prep_shuffle_nomove": lambda: rtt.prepare_data_loader(
            DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2), move_to_device=False),
        "prep_custom": lambda: rtt.prepare_data_loader(
            DataLoader(ds, batch_size=BATCH, sampler=EvenFirst(N), num_workers=2)),
        "prep_shm": lambda: rtt.prepare_data_loader(shm()),
        "prep_shm_nomove": lambda: rtt.prepare_data_loader(shm(), move_to_device=False),
    }
    _note_pids(config["out"], [os.getpid()])
    out, kinds, times = {}, {}, {}
    for name, make in makers.items():
        dl = make()
        kinds[name] = _kind(dl)
        for epoch in range(EPOCHS):
            _set_epoch(dl, epoch)
            ids, pids = [], set()
            t0 = time.perf_counter()
            for batch in dl:
                i, p = _batch_parts(batch)
                ids += i
                pids |= p
            times[f"{name}/{epoch}"] = time.perf_counter() - t0
            out[f"{name}/{epoch}"] = np.asarray(ids, np.int64)
            out[f"{name}/{epoch}/pids"] = np.asarray(sorted(pids), np.int64)
        _inner(dl).close()
    try:  # an unsharded ShmLoader cannot be rebuilt by Ray: a ValueError saying so
        rtt.prepare_data_loader(ShmLoader(ds, batch_size=BATCH, num_workers=2))
        refused = ""
    except ValueError as e:
        refused = str(e)
    catcher.__exit__(None, None, None)
    np.savez(os.path.join(config["out"], f"shards_rank{rank}.npz"), **out)
    with open(os.path.join(config["out"], f"shards_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": ctx.get_world_size(), "pid": os.getpid(),
                   "kinds": kinds, "times": times, "refused": refused,
                   "warnings": _warning_texts(caught)}, f)


def _resume_loop(config):
    import pickle

    import ray.train
    import ray.train.torch as rtt
    from ray.train import Checkpoint

    from loader import DataLoader, ShmLoader

    catcher, caught = _record_warnings()
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    _note_pids(config["out"], [os.getpid()])
    ds = Ids()
    shm = lambda: ShmLoader(ds, batch_size=BATCH, shuffle=True, seed=0, num_workers=2,  # noqa
                            distributed=True, output="torch")
    dl = lambda: DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2)  # noqa
    loaders = {"dl_move": rtt.prepare_data_loader(dl()),
               "dl_nomove": rtt.prepare_data_loader(dl(), move_to_device=False),
               "shm_move": rtt.prepare_data_loader(shm()),
               "shm_nomove": rtt.prepare_data_loader(shm(), move_to_device=False)}
    step, seen, pids = 0, {name: {} for name in loaders}, set()
    checkpoint = ray.train.get_checkpoint()
    start_step = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            with open(os.path.join(d, f"rank{rank}.pkl"), "rb") as f:
                saved = pickle.load(f)
        step = start_step = saved["step"]
        seen = saved["seen"]
        for name, dl_ in loaders.items():
            dl_.load_state_dict(saved["states"][name])
    first_epoch = saved["epoch"] if checkpoint is not None else 0
    for epoch in range(first_epoch, EPOCHS):
        for dl_ in loaders.values():
            _set_epoch(dl_, epoch)
        its = {name: iter(dl_) for name, dl_ in loaders.items()}
        while True:
            batches = {name: next(it, None) for name, it in its.items()}
            if all(b is None for b in batches.values()):
                break
            step += 1
            for name, b in batches.items():
                ids, p = _batch_parts(b)  # (a None here: the loaders' lengths differ)
                seen[name].setdefault(epoch, []).extend(ids)
                pids |= p
            if step in CHECKPOINTS and step > start_step:
                states = {name: dl_.state_dict() for name, dl_ in loaders.items()}
                _note_pids(config["out"], pids)
                with tempfile.TemporaryDirectory() as d:
                    with open(os.path.join(d, f"rank{rank}.pkl"), "wb") as f:
                        pickle.dump({"step": step, "epoch": epoch, "seen": seen,
                                     "states": states}, f)
                    ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
            if any(step == c + KILL_AFTER and c > start_step for c in CHECKPOINTS):
                # the checkpoint committed by the controller first (reported is not yet
                # registered: a crash right after a report may lose it in Ray, not here)
                ray.train.get_all_reported_checkpoints(
                    consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=60)
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: what follows is lost
    for dl_ in loaders.values():
        _inner(dl_).close()
    catcher.__exit__(None, None, None)
    arrays = {f"{name}/{epoch}": np.asarray(ids, np.int64)
              for name, by_epoch in seen.items() for epoch, ids in by_epoch.items()}
    np.savez(os.path.join(config["out"], f"resume_rank{rank}.npz"), **arrays)
    with open(os.path.join(config["out"], f"resume_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "start_step": start_step, "steps": step, "pid": os.getpid(),
                   "loader_pids": sorted(pids), "kinds": {n: _kind(d) for n, d in
                                                          loaders.items()},
                   "warnings": _warning_texts(caught)}, f)


def _shm_entries() -> set:
    from shmq import segment

    return {e for e in os.listdir(segment.SHM_DIR)
            if e.startswith(segment.PREFIX) or (e.startswith("sem.") and segment.PREFIX in e)}


def _segment_pid(entry: str) -> int | None:
    """The creator pid a /dev/shm entry's name carries (as tests/conftest.py reads it)."""
    from shmq import segment

    for part in entry[len(segment.PREFIX):].split("-"):
        if part.isdigit():
            return int(part)
    return None


def _note_pids(out: str, pids) -> None:
    """Appended by every rank (killed ones too): whose exit the driver checks."""
    with open(os.path.join(out, "pids.txt"), "a") as f:
        f.write("".join(f"{p}\n" for p in pids))


def _descendants(root: int) -> list:
    """Every process under root (pids from /proc, as tests/conftest.py finds them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main():
    out, readme_code = sys.argv[1], sys.argv[2]
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    before = _shm_entries()
    times = {}
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    times["init"] = time.monotonic() - t0
    storage = tempfile.mkdtemp(prefix="ray-results-")
    scaling = ScalingConfig(num_workers=2, use_gpu=False)
    try:
        t = time.monotonic()
        TorchTrainer(_shards_loop, train_loop_config={"out": out}, scaling_config=scaling,
                     run_config=RunConfig(name="shards", storage_path=storage)).fit()
        times["shards"] = time.monotonic() - t
        t = time.monotonic()
        TorchTrainer(_resume_loop, train_loop_config={"out": out}, scaling_config=scaling,
                     run_config=RunConfig(name="resume", storage_path=storage,
                                          failure_config=FailureConfig(max_failures=2))).fit()
        times["resume"] = time.monotonic() - t
        t = time.monotonic()
        with open(readme_code) as f:
            code = f.read()
        os.chdir(storage)  # where the recipe's run keeps its results
        namespace = {"__name__": "__main__"}
        exec(compile(code, "docs/frameworks.md (Training on a Ray cluster)", "exec"), namespace)
        result = namespace["result"]
        with result.checkpoint.as_directory() as d:
            readme_files = sorted(os.listdir(d))
        times["readme"] = time.monotonic() - t
    finally:
        ray_tree = _descendants(os.getpid())  # Ray's own processes, its workers, their loaders
        t = time.monotonic()
        ray.shutdown()
        times["shutdown"] = time.monotonic() - t
    ranks = []
    for phase in ("shards", "resume"):
        for r in (0, 1):
            with open(os.path.join(out, f"{phase}_rank{r}.json")) as f:
                ranks.append(json.load(f))
    pids = {p for d in ranks for p in [d["pid"], *d.get("loader_pids", [])] if p > 0}
    with open(os.path.join(out, "pids.txt")) as f:
        pids |= {int(line) for line in f if int(line) > 0}
    with np.load(os.path.join(out, "shards_rank0.npz")) as z0, \
            np.load(os.path.join(out, "shards_rank1.npz")) as z1:
        pids |= {int(p) for z in (z0, z1) for k in z.files if k.endswith("/pids")
                 for p in z[k] if p > 0}
    pids |= set(ray_tree)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # (what Ray's shutdown signalled may take a moment to exit)
    left_shm = sorted(e for e in _shm_entries() - before if _segment_pid(e) in pids)
    with open(os.path.join(out, "driver.json"), "w") as f:
        json.dump({"times": times, "readme_checkpoint": readme_files,
                   "alive_after_shutdown": {p: _cmdline(p) for p in sorted(pids) if _alive(p)},
                   "ray_tree": len(ray_tree),
                   "checked_pids": len(pids), "shm_left": left_shm}, f)


if __name__ == "__main__":
    main()
