"""Issue 14: loader.DataLoader under the frameworks real training code uses,
each run as users run it, in a time-bounded subprocess on localhost:
PyTorch Lightning (1 device; 2 devices with DDP, where Lightning
re-instantiates the loader with a DistributedSampler; mid-epoch checkpoint
resume), HF accelerate with 2 processes under torchrun, tqdm under
-W error, and two torchrun launchers simulating 2 nodes x 2 processes.
Each run records the sample ids every rank saw; the assertions are on
those ids: disjoint, complete, each once, resumed runs equal to unbroken
ones.  The frameworks are in the `test` extra: these tests never skip
when it is installed."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).parents[2]
SCRIPTS = Path(__file__).parents[1] / "scripts"
N = 96  # the scripts' dataset (lightning_run.py, accelerate_epochs.py)
OURS = "loader.torch.dataloader.DataLoader"


def _env() -> dict:
    # workers and ranks share 2 cores: one intra-op thread each
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list, timeout: float) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                       cwd=ROOT)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


def _json_line(*outputs: str) -> dict:
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, outputs
    return json.loads(lines[0])


# --- PyTorch Lightning ----------------------------------------------------------------

def _lightning(out: Path, devices: int, phase: str, step: int | None = None) -> list[dict]:
    """lightning_run.py's records, one per rank."""
    _run([sys.executable, str(SCRIPTS / "lightning_run.py"), str(out), str(devices), phase]
         + ([str(step)] if step is not None else []), timeout=100)
    records = [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(devices)]
    for rec in records:
        assert rec["loader"] == OURS and rec["world"] == devices
        assert rec["sampler"] == ("DistributedSampler" if devices > 1 else "RandomSampler")
    return records


def _by_epoch(seen: list, epoch: int) -> list[int]:
    return [i for e, ids in seen if e == epoch for i in ids]


def _assert_shards_exact(records: list[dict]) -> None:
    """Every epoch: ranks disjoint and equal, together each sample once;
    epoch 1's order is not epoch 0's."""
    for epoch in (0, 1):
        shards = [_by_epoch(rec["seen"], epoch) for rec in records]
        assert [len(s) for s in shards] == [N // len(records)] * len(records)
        assert sorted(i for s in shards for i in s) == list(range(N))
    assert _by_epoch(records[0]["seen"], 0) != _by_epoch(records[0]["seen"], 1)


@pytest.fixture(scope="module")
def lightning_full(tmp_path_factory):
    """The unbroken 2-epoch runs, per device count (made once)."""
    pytest.importorskip("pytorch_lightning")
    made = {}

    def get(devices: int) -> list[dict]:
        if devices not in made:
            made[devices] = _lightning(tmp_path_factory.mktemp(f"full{devices}"), devices, "full")
        return made[devices]

    return get


@pytest.mark.timeout(110)
@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_trains_on_the_loader_with_exact_shards(lightning_full, devices):
    """Trainer(max_epochs=2, accelerator="cpu"), devices=1 and devices=2
    strategy="ddp": the loader Lightning iterates (re-instantiated with a
    DistributedSampler under DDP) is still loader.DataLoader, and the ranks'
    shards are disjoint, equal and complete in both epochs."""
    _assert_shards_exact(lightning_full(devices))


@pytest.mark.timeout(110)
@pytest.mark.parametrize("devices,step", [(1, 5), (1, 17), (2, 3), (2, 9)],
                         ids=["1dev-mid-epoch0", "1dev-mid-epoch1", "ddp-mid-epoch0",
                              "ddp-mid-epoch1"])
def test_lightning_mid_epoch_checkpoint_resumes_every_sample_once(lightning_full, tmp_path,
                                                                  devices, step):
    """A checkpoint after global step `step` (mid epoch 0 or 1: 12 steps an
    epoch on 1 device, 6 per rank on 2), the run stopped there and resumed
    from it: on every rank the batches before and after the cut are exactly
    the unbroken run's, so each sample comes once per epoch.  Under DDP
    Lightning gives every rank rank 0's loader state."""
    full = lightning_full(devices)
    stopped = _lightning(tmp_path, devices, "stop", step)
    assert (tmp_path / "mid.ckpt").exists()
    resumed = _lightning(tmp_path, devices, "resume")
    per_rank = N // devices // 8
    cut_epoch = step // per_rank
    for r in range(devices):
        assert len(stopped[r]["seen"]) == step
        assert len(resumed[r]["seen"]) == 2 * per_rank - step
        joined = stopped[r]["seen"] + resumed[r]["seen"]
        # the cut epoch is the unbroken one, batch for batch
        assert ([b for b in joined if b[0] == cut_epoch]
                == [b for b in full[r]["seen"] if b[0] == cut_epoch])
        if devices > 1:
            # DistributedSampler's orders depend on (seed, epoch) only: all of it
            assert joined == full[r]["seen"]
        # (1 device: a RandomSampler without a generator draws each later epoch
        # from torch's global generator, which Lightning's checkpoint does not
        # restore, in torch's DataLoader too: a new order, each sample once)
    joined = [{"seen": s["seen"] + z["seen"]} for s, z in zip(stopped, resumed)]
    _assert_shards_exact(joined)


# --- HF accelerate, 2 processes ------------------------------------------------------

@pytest.mark.timeout(110)
def test_accelerate_two_processes_load_their_shards_on_shmloader():
    """Accelerator().prepare(model, opt, loader) under torchrun with 2
    processes: each process loads with loader.DataLoader (its own two
    worker processes), through accelerate's BatchSamplerShard; the shards
    are disjoint and complete in each epoch, the order new each epoch."""
    pytest.importorskip("accelerate")
    r = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
              "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
              str(SCRIPTS / "accelerate_epochs.py")], timeout=100)
    d = _json_line(r.stdout)
    assert d["world"] == 2
    shards = d["shards"]
    assert [s["rank"] for s in shards] == [0, 1]
    for s in shards:
        assert s["loader"] == OURS and s["batch_sampler"] == "BatchSamplerShard"
        assert len(s["pids"]) == 2 and s["own_pid"] not in s["pids"]
    assert not set(shards[0]["pids"]) & set(shards[1]["pids"])
    for epoch in (0, 1):
        assert [len(s["epochs"][epoch]) for s in shards] == [N // 2, N // 2]
        assert sorted(i for s in shards for i in s["epochs"][epoch]) == list(range(N))
    assert shards[0]["epochs"][0] != shards[0]["epochs"][1]


# --- tqdm under -W error ---------------------------------------------------------------

@pytest.mark.timeout(60)
def test_tqdm_over_the_loader_under_warnings_as_errors():
    """tqdm's monitor thread is alive while the workers fork: no warning
    (torch gives none), so a program run with -W error works."""
    pytest.importorskip("tqdm")
    code = textwrap.dedent("""
        import time
        import torch
        from torch.utils.data import TensorDataset
        from tqdm import tqdm
        from loader import DataLoader
        dl = DataLoader(TensorDataset(torch.arange(64)), batch_size=8, shuffle=True,
                        num_workers=2, persistent_workers=True)
        for epoch in range(2):
            seen = []
            for (x,) in tqdm(dl, mininterval=0.01):
                seen += x.tolist()
                time.sleep(0.02)  # long enough for tqdm's monitor thread to run
            assert sorted(seen) == list(range(64)), seen
        dl.close()
        print("OK", epoch)
    """)
    r = _run([sys.executable, "-W", "error", "-c", code], timeout=50)
    assert r.stdout.strip() == "OK 1"
    assert "Warning" not in r.stderr


# --- two nodes, simulated -------------------------------------------------------------

@pytest.mark.timeout(110)
@pytest.mark.parametrize("mode", ["shm", "dataloader"])
def test_two_simulated_nodes_of_two_ranks_shard_and_resume_exactly(mode):
    """torchrun --nnodes 2 --nproc_per_node 2, as two launcher processes on
    127.0.0.1 meeting by c10d rendezvous (4 ranks, gloo), with
    ShmLoader(distributed=True) or loader.DataLoader + DistributedSampler:
    each epoch's shards are disjoint, equal and complete, the order is new
    each epoch, and an epoch cut after 7 batches and resumed from a pickled
    state_dict() by a new loader is, on every rank, the unbroken epoch."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
           "--rdzv_id", f"multinode-{mode}-{port}", "--local_addr", "127.0.0.1",
           "--max_restarts", "0", str(SCRIPTS / "multinode_epochs.py"), mode]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(), cwd=ROOT) for _ in range(2)]
    outs = []
    try:
        for p in nodes:
            out, err = p.communicate(timeout=100)
            assert p.returncode == 0, err[-5000:]
            outs.append(out)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    d = _json_line(*outs)
    assert d["world"] == 4
    shards = d["shards"]
    assert [s["rank"] for s in shards] == [0, 1, 2, 3]
    n = 200
    for run in ("whole", "resumed"):
        for epoch in range(3):
            ids = [[i for b in s[run][epoch] for i in b] for s in shards]
            assert [len(x) for x in ids] == [n // 4] * 4
            assert Counter(i for x in ids for i in x) == Counter(range(n))
    for s in shards:
        assert s["resumed"] == s["whole"]
        epochs = [[i for b in e for i in b] for e in s["whole"]]
        assert epochs[0] != epochs[1] != epochs[2]
