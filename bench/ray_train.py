"""RAY: the same synthetic model trained under Ray Train (TorchTrainer, 2
workers, gloo, one local cluster with ray.init(num_cpus=2)), fed by
PyTorch's DataLoader, loader.DataLoader and ShmLoader(distributed=True),
each through ray.train.torch.prepare_data_loader as Ray's docs show.

    python bench/ray_train.py [--samples 40000] [--epochs 4] [--rounds 2]

Sample i: a (3, 64, 64) float32 image (48 KiB, made from i in dataset[i])
and an int64 label; batch 64 per rank, 2 loader workers per rank,
persistent workers (ShmLoader's default; Ray's rebuild of a loader drops
persistent_workers, so the DataLoaders get a DistributedSampler from the
start and are prepared with add_dist_sampler=False, as a user who wants
persistent workers does).  The two "Ray's rebuild" rows are Ray's own
idiom, DataLoader(shuffle=True) handed to prepare_data_loader, which
rebuilds it with a DistributedSampler and without persistent workers.  The model: flatten -> Linear(12288,
10), SGD, wrapped by prepare_model (DDP), one intra-op thread per rank
(two ranks share the 2 cores): a light step, so the loaders' share of
the epoch shows.

Each run trains --epochs epochs; an epoch's time is the slowest rank's;
the figure is the median of the epochs after the first (warm), over
--rounds rounds that alternate the loaders (drift on a shared machine
hits all alike).  Also: main-thread CPU per batch in the training loop
(time.thread_time), and the ratio to PyTorch's DataLoader.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

LOADERS = ("torch", "loader.DataLoader", "ShmLoader", "torch, Ray's rebuild",
           "loader.DataLoader, Ray's rebuild")


class Images:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = np.empty((3, 64, 64), np.float32)
        x.fill(i % 251 / 251.0)  # a value per sample; the work is the 48 KiB to move
        return x, i % 10


def _file(kind: str, round_: int, rank: int) -> str:
    name = "".join(c if c.isalnum() or c == "." else "_" for c in kind)
    return f"{name}-{round_}-{rank}.json"


def _train(config):
    import ray.train
    import ray.train.torch as rtt
    import torch
    from torch.utils.data import DistributedSampler

    import loader

    ds = Images(config["samples"])
    kind, batch = config["loader"], config["batch"]
    if kind == "ShmLoader":
        dl = loader.ShmLoader(ds, batch_size=batch, shuffle=True, seed=0, reproducible=False,
                              num_workers=2, distributed=True, output="torch")
        dl = rtt.prepare_data_loader(dl)
    elif kind.endswith("Ray's rebuild"):  # Ray's idiom: it adds the DistributedSampler
        cls = torch.utils.data.DataLoader if kind.startswith("torch") else loader.DataLoader
        dl = rtt.prepare_data_loader(cls(ds, batch_size=batch, shuffle=True, num_workers=2,
                                         persistent_workers=True))
    else:
        cls = torch.utils.data.DataLoader if kind == "torch" else loader.DataLoader
        dl = cls(ds, batch_size=batch, sampler=DistributedSampler(ds, seed=0), num_workers=2,
                 persistent_workers=True)
        dl = rtt.prepare_data_loader(dl, add_dist_sampler=False)
    torch.set_num_threads(1)
    model = rtt.prepare_model(torch.nn.Sequential(torch.nn.Flatten(),
                                                  torch.nn.Linear(3 * 64 * 64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = getattr(getattr(dl, "_dataloader", dl), "sampler", None)
    epochs = []
    for epoch in range(config["epochs"]):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        t0, c0, n = time.perf_counter(), time.thread_time(), 0
        for x, y in dl:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += 1
        epochs.append({"s": time.perf_counter() - t0,
                       "cpu_ms_per_batch": (time.thread_time() - c0) * 1e3 / n, "batches": n})
    if hasattr(dl, "close"):
        dl.close()
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], _file(kind, config["round"], rank)), "w") as f:
        json.dump(epochs, f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=40_000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tempfile.mkdtemp(prefix="bench-ray-")
    load_before = os.getloadavg()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    fit_s = {k: [] for k in LOADERS}
    try:
        for r in range(args.rounds):
            for kind in LOADERS:
                config = {"loader": kind, "round": r, "out": out, "samples": args.samples,
                          "epochs": args.epochs, "batch": args.batch}
                t = time.monotonic()
                TorchTrainer(_train, train_loop_config=config,
                             scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                             run_config=RunConfig(storage_path=os.path.join(out, "results"),
                                                  name=_file(kind, r, 0)[:-7])).fit()
                fit_s[kind].append(time.monotonic() - t)
    finally:
        ray.shutdown()
    rows = {}
    for kind in LOADERS:
        warm, cpu, first = [], [], []
        for r in range(args.rounds):
            ranks = []
            for k in (0, 1):
                with open(os.path.join(out, _file(kind, r, k))) as f:
                    ranks.append(json.load(f))
            per_epoch = [max(rk[e]["s"] for rk in ranks) for e in range(args.epochs)]
            first.append(per_epoch[0])
            warm += per_epoch[1:]
            cpu += [rk[e]["cpu_ms_per_batch"] for rk in ranks for e in range(1, args.epochs)]
        rows[kind] = {"epoch_s": statistics.median(warm), "first_epoch_s": statistics.median(first),
                      "cpu_ms_per_batch": statistics.median(cpu),
                      "fit_s": statistics.median(fit_s[kind])}
    print(f"RAY: {args.samples} samples of (3, 64, 64) float32, batch {args.batch} per rank, "
          f"TorchTrainer 2 workers, {args.epochs} epochs x {args.rounds} rounds; "
          f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print("| loader | warm epoch (s) | first epoch (s) | main CPU / batch (ms) | fit() (s) "
          "| epoch speed vs torch, same idiom |")
    print("|---|---|---|---|---|---|")
    for kind, row in rows.items():
        peer = "torch, Ray's rebuild" if kind.endswith("Ray's rebuild") else "torch"
        print(f"| {kind} | {row['epoch_s']:.2f} | {row['first_epoch_s']:.2f} | "
              f"{row['cpu_ms_per_batch']:.2f} | {row['fit_s']:.1f} | "
              f"{rows[peer]['epoch_s'] / row['epoch_s']:.2f}x |")

if __name__ == "__main__":
    main()
