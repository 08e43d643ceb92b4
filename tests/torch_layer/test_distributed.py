"""distributed=True under torchrun (gloo, 2 processes on localhost): each
rank gets a disjoint, equal share of every epoch, together the whole
dataset (padded by repeating its start, as torch's DistributedSampler
does), a new order each epoch, and the same order on every rank without
set_epoch (issue 8)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).parents[1] / "scripts" / "distributed_epochs.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(SCRIPT), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1001, 1000])
def test_each_rank_gets_a_disjoint_equal_share_of_every_epoch(n):
    epochs = torchrun(str(n), "16", "3", "shuffle")
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    orders = []
    per_rank = -(-n // 2)
    for e in epochs:
        a, b = (s["indices"] for s in sorted(e["shards"], key=lambda s: s["rank"]))
        assert len(a) == len(b) == per_rank and e["total"] == 2 * per_rank
        assert all(s["len"] == -(-per_rank // 16) for s in e["shards"])
        together = a + b
        assert sorted(set(together)) == list(range(n))           # complete
        padding = 2 * per_rank - n
        assert len(together) - len(set(together)) == padding    # disjoint but for the padding
        orders.append(together)
    assert orders[0] != orders[1] != orders[2]                   # a new order each epoch


@pytest.mark.timeout(300)
def test_without_shuffle_ranks_take_every_other_index():
    (e,) = torchrun("10", "4", "1", "sequential")
    a, b = (s["indices"] for s in sorted(e["shards"], key=lambda s: s["rank"]))
    assert a == [0, 2, 4, 6, 8] and b == [1, 3, 5, 7, 9]


def shard_of(rank_world, monkeypatch=None, **kwargs):
    from loader import ShmLoader
    import numpy as np

    with ShmLoader(np.arange(23), batch_size=4, shuffle=True, seed=3, num_workers=2,
                   distributed=rank_world, **kwargs) as loader:
        return [[int(i) for b in loader for i in b] for _ in range(2)], len(loader)


@pytest.mark.timeout(60)
def test_explicit_ranks_and_the_environment_give_the_same_shards(monkeypatch):
    """distributed=(rank, world) (e.g. from ray.train.get_context()), or
    RANK / WORLD_SIZE in the environment when no process group exists."""
    (a, len_a), (b, len_b) = shard_of((0, 2)), shard_of((1, 2))
    assert len_a == len_b == 3
    for ea, eb in zip(a, b):
        assert len(ea) == len(eb) == 12 and sorted(set(ea + eb)) == list(range(23))
    assert a[0] != a[1]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert shard_of(True) == (b, len_b)


def test_bad_ranks_are_refused():
    from loader import ShmLoader

    for bad in [(2, 2), (0,), "0/2", (-1, 2)]:
        with pytest.raises(ValueError, match="rank"):
            ShmLoader(list(range(4)), distributed=bad)
