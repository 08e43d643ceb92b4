"""Issue 29 item 2 on the real MosaicML Streaming: loader.DataLoader's and
ShmLoader's state over a StreamingDataset, taken mid-epoch 0, 1 or 2 (2
workers, persistent ones, main; shuffled and not), resumed in a new
process, gives the rest of the cut epoch exactly as the uninterrupted run
did, then the same next epoch, with no warning (NOTE [ Datasets that resume
themselves ] in loader/datasets/own_state.py).  The suite's interpreter has
no `streaming`: SHMQ_STREAMING_PYTHON names one that imports it (with
torch and numpy; this repository goes first on its path); without it the
test is skipped.  Without Streaming, its behaviour:
tests/loader_layer/test_resumes_itself.py."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "streaming_resume_run.py"
N, BS, K = 160, 16, 3  # as the script's


def streaming_python() -> str:
    """The interpreter SHMQ_STREAMING_PYTHON names, if it imports streaming."""
    python = os.environ.get("SHMQ_STREAMING_PYTHON")
    if not python:
        pytest.skip("SHMQ_STREAMING_PYTHON is not set: it names an interpreter that imports "
                    "MosaicML Streaming (mosaicml-streaming), torch and numpy")
    found = subprocess.run([python, "-c", "import streaming, torch, numpy"],
                           capture_output=True, text=True, timeout=120)
    if found.returncode:
        pytest.skip(f"SHMQ_STREAMING_PYTHON={python} cannot import streaming, torch and numpy: "
                    f"{found.stderr.strip().splitlines()[-1:]}")
    return python


def run(python: str, step: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    done = subprocess.run([python, str(SCRIPT), step, str(out)], capture_output=True, text=True,
                          timeout=200, env=env, cwd=ROOT)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-3000:]


def test_a_streaming_dataset_resumes_the_cut_epoch_in_a_new_process(tmp_path):
    python = streaming_python()
    run(python, "cut", tmp_path)
    run(python, "resume", tmp_path)
    names = sorted(p.name[:-len(".resumed.json")] for p in tmp_path.glob("*.resumed.json"))
    assert len(names) == 4
    for name in names:
        first = json.loads((tmp_path / f"{name}.json").read_text())
        resumed = json.loads((tmp_path / f"{name}.resumed.json").read_text())
        assert len(first["before"]) == K * BS, name
        assert sorted(first["before"] + first["rest"]) == list(range(N)), name
        assert resumed["rest"] == first["rest"], name  # the rest of the cut epoch, in order
        assert resumed["following"] == first["following"], name
        assert sorted(resumed["following"]) == list(range(N)), name
