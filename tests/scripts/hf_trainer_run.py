"""Run by tests/torch_layer/test_hf_trainer.py: Hugging Face transformers'
Trainer over a tiny model built here, 2 workers, 2 epochs, with torch's
DataLoader and with loader.DataLoader, each run whole and cut by a
mid-epoch checkpoint then resumed from it (resume_from_checkpoint).

    python hf_trainer_run.py ORDER MODE OUT_DIR SHM_CUTS TORCH_CUTS

ORDER: "trainer_first" (`from transformers import Trainer` before
`from loader import DataLoader`) or "loader_first".  MODE: "override" (a
Trainer subclass whose get_train_dataloader() returns
accelerator.prepare(DataLoader(...)), the class torch's or the
project's) or "built" (the loader Trainer builds itself: transformers'
Trainer, or loader.torch.integrations.transformers.Trainer).  SHM_CUTS,
TORCH_CUTS: the steps to cut each loader's runs at, comma-separated (or
"-": none).  Prints one JSON line (the last of its output): per loader
("torch", "shm"), the sample ids the model trained on, in order ("whole",
and per cut step the cut run's followed by the resumed run's), and
whether each sample came from ShmLoader's workers ("ours")."""

import json
import os
import sys

ORDER, MODE, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
CUTS = {kind: [int(a) for a in arg.split(",") if a != "-"]
        for kind, arg in (("shm", sys.argv[4]), ("torch", sys.argv[5]))}

if ORDER == "trainer_first":
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import loader
    from loader import DataLoader
else:
    import loader
    from loader import DataLoader

    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

import warnings  # noqa: E402

import torch  # noqa: E402

from loader.torch.integrations import LoaderReplacedWarning  # noqa: E402

warnings.simplefilter("error", LoaderReplacedWarning)  # a loader rebuilt as another class

N, BATCH, EPOCHS, WORKERS = 48, 4, 2, 2


class Rows(torch.utils.data.Dataset):
    """Sample i: features from i, its id, and whether a ShmLoader worker made it."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i) / N), "ids": i, "labels": float(i % 3),
                "ours": int(loader.get_worker_info() is not None)}


class Tiny(torch.nn.Module):
    """Records what it trains on, in order."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen, self.ours = [], []

    def forward(self, x, ids, ours, labels=None):
        self.seen += ids.tolist()
        self.ours += ours.tolist()
        return {"loss": (self.lin(x).squeeze(-1) - labels).pow(2).mean()}


class StopAt(TrainerCallback):
    """The run ends right after the checkpoint of this step (a crash)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def trainer_class(kind):
    if MODE == "built":
        if kind == "torch":
            return Trainer
        from loader.torch.integrations.transformers import Trainer as ShmTrainer

        return ShmTrainer
    loader_cls = torch.utils.data.DataLoader if kind == "torch" else DataLoader

    class Override(Trainer):
        def get_train_dataloader(self):
            return self.accelerator.prepare(loader_cls(
                self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                shuffle=True, num_workers=WORKERS, collate_fn=self.data_collator))

    return Override


def train(kind, out_dir, stop_at=None, resume=None):
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
        save_strategy="no" if stop_at is None else "steps", save_steps=stop_at or 500,
        logging_strategy="no", report_to=[], dataloader_num_workers=WORKERS,
        dataloader_pin_memory=False, remove_unused_columns=False, seed=0, use_cpu=True,
        disable_tqdm=True, learning_rate=0.01)
    model = Tiny()
    callbacks = [] if stop_at is None else [StopAt(stop_at)]
    trainer = trainer_class(kind)(model=model, args=args, train_dataset=Rows(),
                                  callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return model.seen, model.ours


def runs(kind):
    seen, ours = train(kind, os.path.join(OUT, kind, "whole"))
    out = {"whole": seen, "ours": ours, "cut": {}}
    for step in CUTS[kind]:
        out_dir = os.path.join(OUT, kind, f"cut{step}")
        cut_seen, cut_ours = train(kind, out_dir, stop_at=step)
        rest_seen, rest_ours = train(kind, out_dir,
                                     resume=os.path.join(out_dir, f"checkpoint-{step}"))
        out["cut"][str(step)] = cut_seen + rest_seen
        out["ours"] += cut_ours + rest_ours
    return out


import transformers.trainer as hf_trainer  # noqa: E402

result = {kind: runs(kind) for kind in ("torch", "shm")}
result["resume_keeps_loader"] = bool(getattr(hf_trainer.skip_first_batches, "_keeps_loader",
                                             False))
print(json.dumps(result))
