"""Run by tests/torch_layer/test_frameworks.py under two torchrun launchers (--nnodes 2
--nproc_per_node 2, c10d rendezvous on 127.0.0.1; 4 ranks, gloo).

    multinode_epochs.py MODE     (MODE: shm | dataloader)
shm: ShmLoader(distributed=True); dataloader: loader.DataLoader with a
DistributedSampler and set_epoch.  Each rank loads EPOCHS epochs without a
break ("whole"), then again from scratch, cut in epoch 1 after CUT batches,
its state_dict() pickled, the loader closed, and a new one resumed from
the state for the rest ("resumed").  Rank 0 prints one JSON line: every
rank's sample ids, by epoch, of both runs."""

import json
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist

N, BATCH, EPOCHS, CUT = 200, 5, 3, 7
mode = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def make():
    if mode == "shm":
        from loader import ShmLoader

        return ShmLoader(np.arange(N), batch_size=BATCH, shuffle=True, seed=17, num_workers=2,
                         distributed=True, timeout=60)
    from loader import DataLoader

    sampler = torch.utils.data.DistributedSampler(Ids(), shuffle=True, seed=17)
    return DataLoader(Ids(), batch_size=BATCH, sampler=sampler, num_workers=2, timeout=60)


def epoch_of(loader, epoch):
    if mode == "dataloader":
        loader.sampler.set_epoch(epoch)
    return iter(loader)


def ids(batch):
    return [int(i) for i in batch]


whole = []
loader = make()
for epoch in range(EPOCHS):
    whole.append([ids(b) for b in epoch_of(loader, epoch)])
loader.close()

resumed = []
loader = make()
for epoch in range(EPOCHS):
    it = epoch_of(loader, epoch)
    if epoch != 1:
        resumed.append([ids(b) for b in it])
        continue
    part = [ids(next(it)) for _ in range(CUT)]
    state = pickle.dumps(loader.state_dict())
    del it
    loader.close()
    loader = make()
    loader.load_state_dict(pickle.loads(state))
    if mode == "dataloader":  # set_epoch is not called again for a resumed epoch: the state says it
        pass
    resumed.append(part + [ids(b) for b in loader])
loader.close()

shards = [None] * world
dist.all_gather_object(shards, {"rank": rank, "whole": whole, "resumed": resumed})
if rank == 0:
    print(json.dumps({"world": world, "shards": shards}), flush=True)
dist.destroy_process_group()
