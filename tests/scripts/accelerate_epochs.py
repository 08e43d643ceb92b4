"""Run by tests/torch_layer/test_frameworks.py under torchrun --nproc_per_node 2 (gloo,
CPU): Accelerator(cpu=True).prepare(model, optimizer, loader.DataLoader),
two epochs of training.  Rank 0 prints one JSON line: per rank, the class
accelerate loads with, its batch sampler's class, the worker pids seen, and
the sample ids of every epoch."""

import json
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import Dataset

from loader import DataLoader

N, BATCH = 96, 8


class Ids(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
dl = DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
model, opt, prepared = acc.prepare(model, opt, dl)
base = prepared.base_dataloader
epochs, pids = [], set()
for epoch in range(2):
    seen = []
    for x, ids in prepared:
        seen += ids.tolist()
        pids |= {w.pid for w in base._iterator._workers}
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    epochs.append(seen)
shards = [None] * acc.num_processes
dist.all_gather_object(shards, {
    "rank": acc.process_index, "loader": f"{type(base).__module__}.{type(base).__qualname__}",
    "batch_sampler": type(base.batch_sampler).__name__, "pids": sorted(pids),
    "own_pid": os.getpid(), "epochs": epochs})
if acc.is_main_process:
    print(json.dumps({"world": acc.num_processes, "shards": shards}), flush=True)
acc.end_training()
dl.close()
base.close()
