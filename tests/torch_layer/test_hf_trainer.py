"""Issue 29 item 1: Hugging Face transformers' Trainer with loader.DataLoader,
beside torch's DataLoader run the same way (tests/scripts/hf_trainer_run.py:
a tiny model built in code, 2 workers, 2 epochs of 12 steps, each sample's
id recorded as the model trains on it).  A run cut by a mid-epoch checkpoint
and resumed from it (resume_from_checkpoint: Trainer skips the cut epoch's
first batches with accelerate's skip_first_batches) must train every sample
exactly once per epoch, in the order of the whole run, which is torch's.

The default run has one representative (Trainer imported first, the loader
Trainer builds, a cut in epoch 1); the whole matrix (both import orders,
the loader Trainer builds and the one get_train_dataloader() returns, cuts
in epochs 0 and 1, torch's runs cut too) is the stress tier:

    python -m pytest -m stress tests/torch_layer/test_hf_trainer.py
"""

import json
import os
import subprocess
import sys

import pytest

from extras import import_or_skip_on_older_python

pytest.importorskip("torch")
import_or_skip_on_older_python("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "hf_trainer_run.py")
N, EPOCHS = 48, 2  # the script's dataset and epochs (12 steps of 4 per epoch)

pytestmark = pytest.mark.timeout(600)


def run_trainer(tmp_path, order: str, mode: str, shm_cuts: str, torch_cuts: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, SCRIPT, order, mode, str(tmp_path), shm_cuts, torch_cuts],
                       env=env, capture_output=True, text=True, timeout=560, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def epochs_of(ids: list) -> list:
    return [ids[e * N:(e + 1) * N] for e in range(EPOCHS)]


def check(result: dict) -> None:
    torch_whole = result["torch"]["whole"]
    assert [sorted(e) for e in epochs_of(torch_whole)] == [list(range(N))] * EPOCHS
    assert epochs_of(torch_whole)[0] != epochs_of(torch_whole)[1]  # set_epoch: a new order
    assert set(result["torch"]["ours"]) == {0}
    for kind in ("torch", "shm"):
        runs = {"whole": result[kind]["whole"], **result[kind]["cut"]}
        for name, ids in runs.items():
            # every sample once per epoch, in torch's order: cut, resumed or not
            assert ids == torch_whole, (kind, name)
    assert set(result["shm"]["ours"]) == {1}  # every sample from ShmLoader's workers
    assert result["resume_keeps_loader"]


def test_trainer_builds_loader_dataloader_and_resumes_exactly(tmp_path):
    """repro_dl_accelerate_seedable_sampler.py and repro_dl_trainer_import_order.py
    under Trainer itself: `from transformers import Trainer` first,
    loader.torch.integrations.transformers.Trainer building the loader,
    cut at step 17 (mid-epoch 1) and resumed."""
    result = run_trainer(tmp_path, "trainer_first", "built", "17", "-")
    check(result)
    assert len(result["shm"]["cut"]["17"]) == N * EPOCHS


@pytest.mark.stress
@pytest.mark.parametrize("mode", ["built", "override"])
@pytest.mark.parametrize("order", ["trainer_first", "loader_first"])
def test_trainer_resumes_every_cut_exactly_in_every_way(tmp_path, order, mode):
    """Both import orders, the loader Trainer builds and the one
    get_train_dataloader() returns (accelerator.prepare(DataLoader(...))),
    cuts mid-epoch 0 (step 5) and mid-epoch 1 (step 17), torch's loader
    cut the same way."""
    result = run_trainer(tmp_path, order, mode, "5,17", "5,17")
    check(result)
    assert set(result["shm"]["cut"]) == set(result["torch"]["cut"]) == {"5", "17"}


def test_the_trainers_eval_and_test_loaders_are_loader_dataloaders_too(tmp_path):
    """The Trainer of loader.torch.integrations.transformers builds its
    eval and test loaders as loader.DataLoader as well, and leaves
    transformers.trainer's name DataLoader as it was; a Trainer class
    that builds them another way gets a LoaderReplacedWarning."""
    import torch
    import transformers
    import transformers.trainer as hf_trainer

    from loader import DataLoader
    from loader.torch.integrations import LoaderReplacedWarning
    from loader.torch.integrations.transformers import Trainer

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    args = transformers.TrainingArguments(str(tmp_path), dataloader_pin_memory=False,
                                          report_to=[], use_cpu=True)
    trainer = Trainer(model=torch.nn.Linear(1, 1), args=args, train_dataset=data,
                      eval_dataset=data)
    for made in (trainer.get_train_dataloader(), trainer.get_eval_dataloader(),
                 trainer.get_test_dataloader(data)):
        assert isinstance(made.base_dataloader, DataLoader), type(made.base_dataloader)
    assert hf_trainer.DataLoader is torch.utils.data.DataLoader

    class BuildsTorchs(Trainer):
        def _get_dataloader(self, dataset, *a, **kw):
            return self.accelerator.prepare(torch.utils.data.DataLoader(dataset))

    other = BuildsTorchs(model=torch.nn.Linear(1, 1), args=args, train_dataset=data)
    with pytest.warns(LoaderReplacedWarning, match=r"Trainer.get_train_dataloader\(\) built a "
                                                   r"torch.utils.data.dataloader.DataLoader"):
        other.get_train_dataloader()
