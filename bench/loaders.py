"""ShmLoader side by side with PyTorch's DataLoader (workloads W1 and W3
of BENCHMARKS.md), in one run on one machine.

    python bench/loaders.py [--batches 12] [--w3-batches 8]

W2 and W4 (tiny samples; dict samples with a string) report batches per
second on a warm epoch.

W1: (1000, 150) float64 samples, batch 128, 2 workers, persistent workers;
each loader runs --warmup epochs, then a timed one.  Figures: GB/s and
batches/s delivered to the loop, time to the first batch of the timed
epoch, and two main-thread CPU figures from time.thread_time(): per batch
over the whole epoch (includes blocking waits, which this kind of VM
charges at ~0.1 ms each) and per *ready* batch (the loader's own work once
a batch is there, taken back to back from a filled pipeline).
W3: the same samples plus a 3.125 ms sleep each, a 50 ms "train step" per
batch, 2/4/8 workers; mean time per batch of the second epoch against the
ideal max(step, 128 x 3.125 ms / workers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loader import ShmLoader  # noqa: E402

BATCH = 128


class W1:
    """np.full(shape, i, float64) samples, optionally after a sleep (W3);
    (1000, 150) by default, (10, 150) for W2."""

    def __init__(self, batches, sleep_s=0.0, as_torch=False, shape=(1000, 150)):
        self.n, self.sleep_s, self.as_torch, self.shape = batches * BATCH, sleep_s, as_torch, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        a = np.full(self.shape, i, np.float64)
        if self.as_torch:
            import torch

            return torch.from_numpy(a)
        return a


def W2(batches, as_torch=False):
    """Tiny (10, 150) samples: per-sample overhead."""
    return W1(batches, as_torch=as_torch, shape=(10, 150))


class W4:
    """A dict of an image, a label and a path: mixed trees, strings."""

    def __init__(self, batches, as_torch=False):
        self.n, self.as_torch = batches * 64, as_torch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = np.full((3, 64, 64), i % 256, np.uint8)
        if self.as_torch:
            import torch

            x = torch.from_numpy(x)
        return {"x": x, "y": np.int64(i % 10), "path": f"img/{i}.png"}


def numpy_collate(samples):
    if isinstance(samples[0], dict):
        return {k: (np.stack([s[k] for s in samples]) if k != "path" else [s[k] for s in samples])
                for k in samples[0]}
    return np.stack(samples)


def make(kind, dataset_kwargs, workers, dataset=W1, batch_size=BATCH):
    if kind == "ShmLoader":
        return ShmLoader(dataset(**dataset_kwargs), batch_size=batch_size, num_workers=workers,
                         memory_cap_bytes=4 << 30)
    import torch.utils.data as tud

    as_torch = kind == "PyTorch tensor path"
    return tud.DataLoader(dataset(as_torch=as_torch, **dataset_kwargs), batch_size=batch_size,
                          num_workers=workers, persistent_workers=True, prefetch_factor=2,
                          collate_fn=None if as_torch else numpy_collate)


def nbytes(batch):
    if isinstance(batch, dict):
        return sum(nbytes(v) for v in batch.values() if not isinstance(v, list))
    return batch.nbytes if isinstance(batch, np.ndarray) else batch.numel() * batch.element_size()


def epoch_w1(loader):
    t0, c0 = time.perf_counter(), time.thread_time()
    first, total, count = None, 0, 0
    for b in loader:
        first = first if first is not None else time.perf_counter() - t0
        total += nbytes(b)
        count += 1
        del b
    return time.perf_counter() - t0, time.thread_time() - c0, first, total, count


def busy(seconds):
    """A stand-in for a train step that keeps the core busy (a sleeping
    core comes back with cold caches and clock, which is not what a
    training loop sees)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def ready_batch_cpu(loader, rounds=3, per_round=3):
    """Main-thread CPU to take a batch that is already waiting, measured
    warm: the pipeline fills during a busy pause, then `per_round` batches
    are taken back to back (both loaders keep at least 3 in flight).  Warm,
    because on this kind of VM any ~20 us of Python work costs 100-300 us
    right after 0.2 s of other activity (see the README), whatever runs."""
    cpu = []
    it = iter(loader)
    for _ in range(rounds):
        busy(0.5)
        for _ in range(per_round):
            c0 = time.thread_time()
            b = next(it)
            cpu.append(time.thread_time() - c0)
            del b
    for _ in it:
        pass
    return float(np.median(cpu))


def close(loader):
    if hasattr(loader, "close"):
        loader.close()
    elif getattr(loader, "_iterator", None) is not None:
        loader._iterator._shutdown_workers()


def run_w1(batches, warmup):
    rows = {}
    for kind in ("ShmLoader", "PyTorch tensor path", "PyTorch numpy collate"):
        loader = make(kind, {"batches": batches}, 2)
        try:
            for _ in range(warmup):  # workers started, batch memory touched
                epoch_w1(loader)
            wall, cpu, first, total, count = epoch_w1(loader)
            ready = ready_batch_cpu(loader)
        finally:
            close(loader)
        rows[kind] = (total / wall / 1e9, count / wall, first, cpu / count * 1e3, ready * 1e3)
        print(f"  measured {kind}", flush=True)
    print(f"\nW1: {batches} batches of 128 x (1000, 150) float64 (153.6 MB) per epoch, 2 workers, "
          f"timed epoch after {warmup} warm-up epoch(s)")
    print(f"{'loader':<24} {'GB/s':>7} {'batch/s':>8} {'first batch':>12} {'main CPU/batch':>15} "
          f"{'ready batch':>12} {'ShmLoader is':>13}")
    ours = rows["ShmLoader"][0]
    for kind, (gbs, bps, first, cpu, ready) in rows.items():
        print(f"{kind:<24} {gbs:>7.2f} {bps:>8.2f} {first * 1e3:>9.0f} ms {cpu:>12.2f} ms "
              f"{ready:>9.3f} ms {ours / gbs:>12.2f}x")


def run_small(name, dataset, batch_size, batches):
    """W2 / W4: batches per second on a warm (second) epoch."""
    rows = {}
    for kind in ("ShmLoader", "PyTorch tensor path", "PyTorch numpy collate"):
        loader = make(kind, {"batches": batches}, 2, dataset, batch_size)
        try:
            epoch_w1(loader)
            wall, cpu, first, total, count = epoch_w1(loader)
        finally:
            close(loader)
        rows[kind] = (count / wall, cpu / count * 1e3)
    print(f"\n{name}: {batches} batches of {batch_size}, 2 workers, second epoch")
    print(f"{'loader':<24} {'batch/s':>9} {'main CPU/batch':>15} {'ShmLoader is':>13}")
    for kind, (bps, cpu) in rows.items():
        print(f"{kind:<24} {bps:>9.1f} {cpu:>12.2f} ms {rows['ShmLoader'][0] / bps:>12.2f}x")


def run_w3(batches):
    print(f"\nW3: W1 samples + 3.125 ms sleep each, 50 ms train step, {batches} batches, "
          f"second epoch")
    print(f"{'loader':<24} {'workers':>7} {'ideal':>9} {'mean/batch':>11} {'vs ideal':>9}")
    for workers in (2, 4, 8):
        ideal = max(0.050, BATCH * 0.003125 / workers)
        for kind in ("ShmLoader", "PyTorch tensor path"):
            loader = make(kind, {"batches": batches, "sleep_s": 0.003125}, workers)
            try:
                for epoch in range(2):  # the first epoch warms up; the second is timed
                    t0 = time.perf_counter()
                    n = 0
                    for b in loader:
                        time.sleep(0.050)  # the train step
                        n += 1
                        del b
                    mean = (time.perf_counter() - t0) / n
            finally:
                close(loader)
            print(f"{kind:<24} {workers:>7} {ideal * 1e3:>6.0f} ms {mean * 1e3:>8.0f} ms "
                  f"{mean / ideal:>8.2f}x", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--w3-batches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="W1 epochs before the timed one")
    args = parser.parse_args(argv)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    run_w1(args.batches, args.warmup)
    run_small("W2 tiny (10, 150) float64", W2, BATCH, 60)
    run_small("W4 dict {x: (3, 64, 64) uint8, y, path}", W4, 64, 60)
    run_w3(args.w3_batches)


if __name__ == "__main__":
    main()
