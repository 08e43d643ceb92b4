"""Run by tests/torch_layer/test_distributed.py under torchrun --nproc_per_node 2: each
rank loads its shard of every epoch with ShmLoader(distributed=True), all
ranks all-reduce once per epoch (as a training step would), and rank 0
prints what every rank received, one JSON line per epoch."""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from loader import ShmLoader

N, BATCH, EPOCHS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
shuffle = sys.argv[4] == "shuffle"

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
loader = ShmLoader(np.arange(N), batch_size=BATCH, shuffle=shuffle, seed=17, num_workers=2,
                   distributed=True, timeout=60)
for epoch in range(EPOCHS):
    got = [int(i) for b in loader for i in b]
    total = torch.tensor([len(got)])
    dist.all_reduce(total)  # one collective per epoch, like a gradient sync
    shards = [None] * world
    dist.all_gather_object(shards, {"rank": rank, "len": len(loader), "indices": got})
    if rank == 0:
        print(json.dumps({"epoch": epoch, "total": int(total), "shards": shards}), flush=True)
loader.close()
dist.destroy_process_group()
