"""Run by tests/torch_layer/test_frameworks.py: a LightningModule trained on
loader.DataLoader with Trainer(max_epochs=2, accelerator="cpu").

    lightning_run.py OUT DEVICES PHASE [STEP]
PHASE full: two epochs; stop: the same run, checkpointed after global step
STEP and stopped there (a crash mid-epoch); resume: from that checkpoint to
the end.  Each rank writes OUT/PHASE_rank<r>.json: the sample ids of every
batch it trained on, by epoch, and the class of the loader Lightning used
(with devices=2 Lightning re-instantiates it with a DistributedSampler)."""

import json
import os
import sys
import warnings

import torch
from torch.utils.data import Dataset

warnings.filterwarnings("ignore", module="lightning")  # its advice on small runs
warnings.filterwarnings("ignore", module="pytorch_lightning")
import pytorch_lightning as pl  # noqa: E402

from loader import DataLoader  # noqa: E402

N, BATCH = 96, 8
out, devices, phase = sys.argv[1], int(sys.argv[2]), sys.argv[3]
step = int(sys.argv[4]) if len(sys.argv) > 4 else None


class Ids(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen = []

    def train_dataloader(self):
        return DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=2,
                          persistent_workers=True)

    def training_step(self, batch, batch_idx):
        x, ids = batch
        self.seen.append([self.current_epoch, ids.tolist()])
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self):
        dl = self.trainer.train_dataloader
        sampler = dl.batch_sampler.sampler if dl.batch_sampler is not None else dl.sampler
        with open(os.path.join(out, f"{phase}_rank{self.global_rank}.json"), "w") as f:
            json.dump({"seen": self.seen, "world": self.trainer.world_size,
                       "loader": f"{type(dl).__module__}.{type(dl).__qualname__}",
                       "sampler": type(sampler).__name__}, f)


pl.seed_everything(0, workers=True, verbose=False)
kwargs = dict(max_epochs=2, accelerator="cpu", devices=devices, logger=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
if devices > 1:
    kwargs["strategy"] = "ddp"
callbacks, ckpt = [], None
if phase == "stop":
    kwargs["max_steps"] = step
    callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=step,
                                                  save_top_k=-1))
else:
    kwargs["enable_checkpointing"] = False
if phase == "resume":
    ckpt = os.path.join(out, "mid.ckpt")
trainer = pl.Trainer(callbacks=callbacks, **kwargs)
trainer.fit(Model(), ckpt_path=ckpt)
