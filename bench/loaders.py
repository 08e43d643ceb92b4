"""ShmLoader side by side with PyTorch's DataLoader (tensor path and a
numpy collate) and Grain's DataLoader: workloads W1-W4, W7-W10 and AUTO of
docs/benchmarks.md, in one run on one machine.

    python bench/loaders.py [--workloads W1,...,AUTO,W11,W12,W13,KEEP] [--batches 12]
                            [--plot docs/ratios.png]

W11 (images), W12 (tokens), W13 (bytes and text) and KEEP (a loop that keeps
every label) are in realistic.py.  --plot draws every ratio the run printed
as one PNG (matplotlib).

Grain is measured when it is installed (the [bench] extra installs it).
Its DataLoader starts its worker processes for each pass, so its epochs
include that start-up; that is how Grain is used.

W2 and W4 (tiny samples; dict samples with a string) report batches per
second on a warm epoch.

W1: (1000, 150) float64 samples, batch 128, 2 workers, persistent workers;
each loader runs --warmup epochs, then three timed ones (the median is
reported), then one more for the memory figures.  Figures: GB/s and
batches/s delivered to the loop, time to the first batch of the timed
epoch, and two main-thread CPU figures from time.thread_time(): per batch
over the whole epoch (includes blocking waits, which this kind of VM
charges at ~0.1 ms each) and per *ready* batch (the loader's own work once
a batch is there, taken back to back from a filled pipeline).
W1 also reports the copy limit (np.copyto of the same bytes into touched
memory, one core), and the peak memory of the whole process tree: PSS
(proportional set size, so shared pages count once) and /dev/shm in use.
W3: the same samples plus a 3.125 ms sleep each, a 50 ms "train step" per
batch, 2/4/8 workers; mean time per batch of the second epoch against the
ideal max(step, 128 x 3.125 ms / workers).
W7: (100,) float32 samples, batch 32, 8 workers, a training loop that takes
1 s per batch: the CPU the loader's processes use meanwhile (all of them,
user + system, from /proc), as a percentage of one core.
W8: FileDataset over a directory of .npy files against PyTorch's DataLoader
with np.load; W9: ParquetDataset with a shuffle buffer against pyarrow's
own batch iteration feeding PyTorch's DataLoader; W10: zlib decompression
per sample on thread workers, process workers and PyTorch's DataLoader;
AUTO: num_workers="auto" against the best fixed count, on a sleeping
(IO-bound) and a computing dataset.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ipc  # noqa: E402
from loader import ShmLoader  # noqa: E402
from peer_noise import (PeerStderr, QuietStart, resource_tracker_note,  # noqa: E402
                        start_resource_tracker)
from report import RATIOS, machine, record_ratio  # noqa: E402

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


# main(): where Grain's processes write their stderr (bench/peer_noise.py)
PEER_STDERR: PeerStderr | None = None


def grain_available():
    # Grain looks for JAX's profiler and logs "Failed to load jax profiler" where
    # JAX is not installed: noise of the peer's (here; its workers' own: PEER_STDERR)
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        import grain.python  # noqa: F401
    except ImportError:
        return False
    # Grain reads absl flags (worker profiling) that only an absl app parses;
    # with JAX installed it reads them here and raises UnparsedFlagAccessError
    # unless they are marked parsed: their defaults, as in a plain program
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return True


def kinds(extra=False):
    """The loaders compared; extra: also ShmLoader with reproducible=True
    (per-sample seeding) and loader.DataLoader (the torch drop-in)."""
    ours = ["ShmLoader"] + (["ShmLoader, reproducible", "loader.DataLoader"] if extra else [])
    return ours + ["PyTorch tensor path", "PyTorch numpy collate"] + (
        ["Grain"] if grain_available() else [])


def make(kind, dataset_kwargs, workers, dataset=W1, batch_size=BATCH):
    if kind == "Grain":
        import grain.python as pygrain

        source = dataset(**dataset_kwargs)
        sampler = pygrain.IndexSampler(num_records=len(source), shard_options=pygrain.NoSharding(),
                                       shuffle=False, num_epochs=1, seed=0)
        grain = pygrain.DataLoader(data_source=source, sampler=sampler, worker_count=workers,
                                   operations=[pygrain.Batch(batch_size=batch_size)])
        return grain if PEER_STDERR is None else QuietStart(grain, PEER_STDERR)
    if kind.startswith("ShmLoader"):
        return ShmLoader(dataset(**dataset_kwargs), batch_size=batch_size, num_workers=workers,
                         memory_cap_bytes=4 << 30, seed=0,
                         reproducible=kind == "ShmLoader, reproducible")
    import torch.utils.data as tud

    if kind == "loader.DataLoader":
        from loader import DataLoader

        return DataLoader(dataset(as_torch=True, **dataset_kwargs), batch_size=batch_size,
                          num_workers=workers, persistent_workers=True, prefetch_factor=2)
    as_torch = kind == "PyTorch tensor path"
    return tud.DataLoader(dataset(as_torch=as_torch, **dataset_kwargs), batch_size=batch_size,
                          num_workers=workers, persistent_workers=True, prefetch_factor=2,
                          collate_fn=None if as_torch else numpy_collate)


def seeding_cost_us(repeats=20000):
    """What reproducible=True adds per sample, in one process: seeding
    random, numpy's global generator and torch's from (seed, epoch, index)."""
    from loader.worker.seeding import SampleSeeder

    seeder = SampleSeeder(0)
    t0 = time.perf_counter()
    for i in range(repeats):
        seeder(1, 0, i)
    return (time.perf_counter() - t0) / repeats * 1e6


def nbytes(batch):
    if isinstance(batch, dict):
        return sum(nbytes(v) for k, v in batch.items() if k != "path")
    if isinstance(batch, np.generic):
        return batch.nbytes
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


class PeakMemory:
    """Samples, every 50 ms in a thread, the PSS of this process and all
    its descendants (shared pages divided among their users, so a slab or
    segment counts once) and the bytes in use in /dev/shm."""

    def __enter__(self):
        self.pss = self.shm = 0
        self.shm_base = self._shm_used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()  # an epoch shorter than the sampling interval is still measured

    def _run(self):
        while not self._stop.wait(0.05):
            self._sample()

    def _sample(self):
        self.pss = max(self.pss, sum(_pss(pid) for pid in _tree(os.getpid())))
        self.shm = max(self.shm, self._shm_used() - self.shm_base)

    @staticmethod
    def _shm_used():
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize


def _tree(pid):
    pids, i = [pid], 0
    while i < len(pids):
        try:
            with open(f"/proc/{pids[i]}/task/{pids[i]}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except OSError:
            pass
        i += 1
    return pids


def _pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


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
    right after 0.2 s of other activity, whatever runs."""
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
    for kind in kinds():
        loader = make(kind, {"batches": batches}, 2)
        try:
            for _ in range(warmup):  # workers started, batch memory touched
                epoch_w1(loader)
            # the median of three timed epochs: one lasts ~0.1 s for ShmLoader,
            # where one descheduling of a worker moves the figure by a third
            timed = sorted((epoch_w1(loader) for _ in range(3)), key=lambda r: r[0])
            wall, cpu, first, total, count = timed[1]
            # Memory in an epoch of its own: reading smaps_rollup walks the
            # page tables of every mapping (gigabytes of slabs here) and
            # slowed the timed epoch it sampled by up to 6x.
            with PeakMemory() as peak:
                epoch_w1(loader)
            ready = ready_batch_cpu(loader)
        finally:
            close(loader)
        rows[kind] = (total / wall / 1e9, count / wall, first, cpu / count * 1e3, ready * 1e3,
                      peak.pss / 1e9, peak.shm / 1e9)
        print(f"  measured {kind}", flush=True)
    limit = 1_200_000 * batches * BATCH / ipc.copy_limit_seconds(1_200_000, batches * BATCH) / 1e9
    print(f"\nW1: {batches} batches of 128 x (1000, 150) float64 (153.6 MB) per epoch, 2 workers, "
          f"median of 3 timed epochs after {warmup} warm-up epoch(s); copy limit {limit:.1f} GB/s")
    print(f"{'loader':<22} {'GB/s':>6} {'batch/s':>7} {'first batch':>11} {'main CPU/batch':>14} "
          f"{'ready batch':>11} {'peak PSS':>8} {'/dev/shm':>8} {'ShmLoader is':>12}")
    ours = rows["ShmLoader"][0]
    for kind, (gbs, bps, first, cpu, ready, pss, shm) in rows.items():
        if kind != "ShmLoader":
            record_ratio("W1", kind, ours / gbs)
        print(f"{kind:<22} {gbs:>6.2f} {bps:>7.1f} {first * 1e3:>8.0f} ms {cpu:>11.2f} ms "
              f"{ready:>8.3f} ms {pss:>6.2f} GB {shm:>5.2f} GB {ours / gbs:>11.2f}x")
    print(f"{'copy limit (1 core)':<22} {limit:>6.2f}{'':>68} {ours / limit:>11.2f}x")
    record_ratio("W1", "copy limit", ours / limit)
    run_w1_new_loader(batches)


def run_w1_new_loader(batches, repeats=3, steady_epochs=3):
    """W1's "new loader, first 3 epochs" row (warm-up, issue 16): GB/s of
    epochs 1, 2, 3 of a loader made for the purpose, then `steady_epochs`
    more whose median is its steady figure; each loader kind `repeats`
    times in turn, the median per epoch reported.  Also the CPU time of
    the whole process tree per epoch (schedstat): on a shared machine the
    wall-clock figures move with the load, the work done does not."""
    kinds_compared = ["ShmLoader", "PyTorch tensor path"]
    runs = {k: [] for k in kinds_compared}
    for _ in range(repeats):
        for kind in kinds_compared:
            loader = make(kind, {"batches": batches}, 2)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a stalled first epoch is the point here
                    figures = []
                    cpu0 = _cpu_seconds(_tree(os.getpid()))
                    for _ in range(3 + steady_epochs):
                        wall, _, _, total, _ = epoch_w1(loader)
                        cpu1 = _cpu_seconds(_tree(os.getpid()))
                        figures.append((total / wall / 1e9, cpu1 - cpu0))
                        cpu0 = cpu1
            finally:
                close(loader)
            runs[kind].append(figures)
    rows = {k: np.median(np.array(v), axis=0) for k, v in runs.items()}  # epoch -> (GB/s, CPU)
    print(f"\nW1, new loader, first 3 epochs: GB/s (CPU seconds of all its processes); steady: "
          f"median of epochs 4-{3 + steady_epochs}; median of {repeats} new loaders each; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'loader':<22} {'epoch 1':>13} {'epoch 2':>13} {'epoch 3':>13} {'steady':>13} "
          f"{'2nd/steady':>10} {'1st vs PyTorch 1st':>18}")
    torch_first = rows["PyTorch tensor path"][0][0]
    for kind, f in rows.items():
        steady = np.median(f[3:], axis=0)
        cells = " ".join(f"{g:>6.2f} ({c:.2f})" for g, c in list(f[:3]) + [steady])
        print(f"{kind:<22} {cells} {f[1][0] / steady[0]:>10.2f} {f[0][0] / torch_first:>17.2f}x")
    ours = rows["ShmLoader"]
    steady = np.median(ours[3:], axis=0)
    second, second_cpu = ours[1][0] / steady[0], steady[1] / ours[1][1]
    first = ours[0][0] / torch_first
    record_ratio("W1 warm-up", "PyTorch's first epoch", first)
    print(f"targets: 2nd epoch >= 0.9 of steady: {second:.2f} of its GB/s, {second_cpu:.2f} by "
          f"CPU time ({'met' if min(second, second_cpu) >= 0.9 else 'missed'}); 1st epoch >= "
          f"2.5x PyTorch's first: {first:.2f}x ({'met' if first >= 2.5 else 'missed'})")


def run_small(name, dataset, batch_size, batches):
    """W2 / W4: batches per second on a warm (second) epoch."""
    rows = {}
    for kind in kinds(extra=True):
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
        if kind != "ShmLoader":
            record_ratio(name.split()[0], kind, rows["ShmLoader"][0] / bps)
    torch_bps = rows["PyTorch tensor path"][0]
    print(f"loader.DataLoader is {rows['loader.DataLoader'][0] / torch_bps:.2f}x PyTorch's "
          f"DataLoader; reproducible=True costs "
          f"{1 - rows['ShmLoader, reproducible'][0] / rows['ShmLoader'][0]:.0%} of ShmLoader's "
          f"batches/s here ({seeding_cost_us():.1f} us of seeding per sample, in one process)")


def run_w3(batches):
    print(f"\nW3: W1 samples + 3.125 ms sleep each, 50 ms train step, {batches} batches; time to "
          f"the first batch of a new loader, and mean time per batch of the second epoch")
    print(f"{'loader':<24} {'workers':>7} {'first batch':>11} {'ideal':>9} {'mean/batch':>11} "
          f"{'vs ideal':>9}")
    for workers in (2, 4, 8):
        ideal = max(0.050, BATCH * 0.003125 / workers)
        means = {}
        for kind in kinds():
            if kind == "PyTorch numpy collate":
                continue  # W1 measures the collate path; W3 is about prefetching
            t0 = time.perf_counter()
            loader = make(kind, {"batches": batches, "sleep_s": 0.003125}, workers)
            try:
                for epoch in range(2):  # the first epoch warms up; the second is timed
                    t1 = time.perf_counter()
                    n = 0
                    for b in loader:
                        if n == 0 and epoch == 0:
                            first = time.perf_counter() - t0
                        time.sleep(0.050)  # the train step
                        n += 1
                        del b
                    mean = (time.perf_counter() - t1) / n
            finally:
                close(loader)
            print(f"{kind:<24} {workers:>7} {first * 1e3:>8.0f} ms {ideal * 1e3:>6.0f} ms "
                  f"{mean * 1e3:>8.0f} ms {mean / ideal:>8.2f}x", flush=True)
            means[kind] = mean
        for kind, mean in means.items():
            if kind != "ShmLoader":
                record_ratio(f"W3 {workers} workers", kind, mean / means["ShmLoader"])


class W7Samples:
    def __init__(self, as_torch=False):
        self.as_torch = as_torch

    def __len__(self):
        return 10 ** 6

    def __getitem__(self, i):
        a = np.full(100, i, np.float32)
        if self.as_torch:
            import torch

            return torch.from_numpy(a)
        return a


def _cpu_seconds(pids):
    """CPU time of these processes, every thread, from /proc/<pid>/task/*/schedstat
    (nanoseconds on a CPU: clock-tick counts are too coarse for an idle loader)."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, IndexError, ValueError):
                pass
    return total / 1e9


def run_w7(steps):
    print(f"\nW7 idle: (100,) float32, batch 32, 8 workers, a 1 s training step, {steps} steps: "
          f"CPU of the loader's processes while the loop trains")
    print(f"{'loader':<24} {'% of one core':>14} {'ShmLoader uses':>15}")
    rows = {}
    # Only the loader's own processes count: anything an earlier workload
    # left running under this process (a peer's helper) is not the loader's.
    before = set(_tree(os.getpid()))
    for kind in ("ShmLoader", "PyTorch tensor path"):
        if kind == "ShmLoader":
            loader = ShmLoader(W7Samples(), batch_size=32, num_workers=8)
        else:
            import torch.utils.data as tud

            loader = tud.DataLoader(W7Samples(as_torch=True), batch_size=32, num_workers=8,
                                    persistent_workers=True, prefetch_factor=2)
        try:
            it = iter(loader)
            next(it)
            time.sleep(1.0)  # prefetch full: from here on the loader only waits
            kids = [pid for pid in _tree(os.getpid()) if pid not in before]
            c0, t0 = _cpu_seconds(kids), time.perf_counter()
            for _ in range(steps):
                next(it)
                time.sleep(1.0)  # the training step
            used = (_cpu_seconds(kids) - c0) / (time.perf_counter() - t0)
        finally:
            del it
            close(loader)
        rows[kind] = used
    for kind, used in rows.items():
        ratio = rows["ShmLoader"] / used if used else float("inf")
        print(f"{kind:<24} {100 * used:>13.2f}% {ratio:>14.2f}x")
        if kind != "ShmLoader" and rows["ShmLoader"]:
            record_ratio("W7 idle CPU", kind, used / rows["ShmLoader"])


class TorchFiles:
    """PyTorch's way over the same files: np.load in dataset[i]."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import torch

        return torch.from_numpy(np.load(self.files[i]))


def run_w8(file_mb, nfiles, workers_list):
    """W8: a directory of .npy files read by FileDataset, MB/s into the loop
    (page cache warm: a warm-up epoch first), beside PyTorch's DataLoader
    calling np.load in dataset[i]."""
    import shutil
    import tempfile

    from loader import FileDataset

    tmp = tempfile.mkdtemp(prefix="w8-")
    try:
        shape = (file_mb * (1 << 20) // 4 // 1024, 1024)
        for i in range(nfiles):
            np.save(os.path.join(tmp, f"s{i:05d}.npy"), np.full(shape, i, np.float32))
        files = sorted(os.path.join(tmp, f) for f in os.listdir(tmp))
        total_mb = nfiles * file_mb
        print(f"\nW8 files: {nfiles} .npy files of {file_mb} MB ({total_mb / 1024:.1f} GB), "
              f"batch 32, page cache warm, third epoch (two to warm up: page cache, slabs)")
        print(f"{'loader':<28} {'workers':>7} {'MB/s':>8} {'main CPU/batch':>15} "
              f"{'ShmLoader is':>13}")
        import torch.utils.data as tud

        for workers in workers_list:
            rows = {}
            for kind in ("ShmLoader + FileDataset", "PyTorch DataLoader + np.load"):
                if kind.startswith("ShmLoader"):
                    loader = ShmLoader(FileDataset(os.path.join(tmp, "*.npy")), batch_size=32,
                                       num_workers=workers, output="torch")
                else:
                    loader = tud.DataLoader(TorchFiles(files), batch_size=32, num_workers=workers,
                                            persistent_workers=True, prefetch_factor=2)
                try:
                    epoch_w1(loader)
                    epoch_w1(loader)
                    wall, cpu, first, total, count = epoch_w1(loader)
                finally:
                    close(loader)
                rows[kind] = (total / wall / 1e6, cpu / count * 1e3)
            ours = rows["ShmLoader + FileDataset"][0]
            for kind, (mbs, cpu) in rows.items():
                print(f"{kind:<28} {workers:>7} {mbs:>8.0f} {cpu:>12.2f} ms {ours / mbs:>12.2f}x",
                      flush=True)
                if not kind.startswith("ShmLoader"):
                    record_ratio(f"W8 {workers} workers", kind, ours / mbs)
    finally:
        shutil.rmtree(tmp)


class TorchParquetStream:
    """What a PyTorch user writes for Parquet: an IterableDataset reading
    its workers' share of the row groups with pyarrow, rows as dicts, a
    shuffle buffer per worker (a list; a random row out for each row in)."""

    def __init__(self, files, buffer):
        self.files, self.buffer = files, buffer

    def __iter__(self):
        import random

        import pyarrow.parquet as pq
        import torch.utils.data as tud

        info = tud.get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        groups = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        rng, buf = random.Random(w), []
        for f, g in groups[w::k]:
            t = pq.ParquetFile(f).read_row_group(g)
            x = t.column("x").combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)
            ids, labels = t.column("id").to_numpy(), t.column("label").to_numpy()
            for r in range(t.num_rows):
                row = {"x": x[r], "id": ids[r], "label": labels[r]}
                if len(buf) < self.buffer:
                    buf.append(row)
                    continue
                i = rng.randrange(len(buf))
                buf[i], row = row, buf[i]
                yield row
        rng.shuffle(buf)
        yield from buf


def run_w9(rows, files, batch_size, buffer):
    """W9: Parquet rows (a 64-float fixed-size list, an id and a label per
    row) read with a shuffle buffer, 2 workers: ShmLoader + ParquetDataset
    beside pyarrow + PyTorch's DataLoader, rows/s into the loop."""
    import shutil
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch.utils.data as tud

    from loader import ParquetDataset

    tmp = tempfile.mkdtemp(prefix="w9-")
    try:
        per = rows // files
        for f in range(files):
            ids = np.arange(f * per, (f + 1) * per)
            x = pa.FixedSizeListArray.from_arrays(pa.array(
                np.repeat(ids, 64).astype(np.float32)), 64)
            pq.write_table(pa.table({"x": x, "id": pa.array(ids), "label": pa.array(ids % 1000)}),
                           os.path.join(tmp, f"part{f}.parquet"), row_group_size=8192)
        paths = sorted(os.path.join(tmp, p) for p in os.listdir(tmp))
        print(f"\nW9 parquet: {rows} rows ({rows * 272 / 1e6:.0f} MB) in {files} files, row groups "
              f"of 8192, batch {batch_size}, shuffle buffer {buffer}, 2 workers, second epoch")
        print(f"{'loader':<34} {'rows/s':>10} {'MB/s':>8} {'main CPU/batch':>15} {'ShmLoader is':>13}")
        results = {}
        for kind in ("ShmLoader + ParquetDataset", "pyarrow + PyTorch DataLoader"):
            if kind.startswith("ShmLoader"):
                # reproducible=False: nothing here draws random numbers per row (the
                # shuffle buffer is seeded all the same)
                loader = ShmLoader(ParquetDataset(paths), batch_size=batch_size, num_workers=2,
                                   shuffle_buffer=buffer, seed=0, reproducible=False,
                                   output="torch")
            else:
                class Stream(TorchParquetStream, tud.IterableDataset):
                    __iter__ = TorchParquetStream.__iter__

                loader = tud.DataLoader(Stream(paths, buffer // 2),
                                        batch_size=batch_size, num_workers=2,
                                        persistent_workers=True, prefetch_factor=2)
            try:
                epoch_w1(loader)
                wall, cpu, first, total, count = epoch_w1(loader)
            finally:
                close(loader)
            results[kind] = (rows / wall, total / wall / 1e6, cpu / count * 1e3)
        ours = results["ShmLoader + ParquetDataset"][0]
        for kind, (rps, mbs, cpu) in results.items():
            print(f"{kind:<34} {rps:>10.0f} {mbs:>8.0f} {cpu:>12.2f} ms {ours / rps:>12.2f}x")
            if not kind.startswith("ShmLoader"):
                record_ratio("W9", kind, ours / rps)
    finally:
        shutil.rmtree(tmp)


class Compressed:
    """W10: each sample is zlib-decompressed (zlib releases the GIL), 4 MB
    out, as a decoder would."""

    def __init__(self, n, as_torch=False):
        import zlib

        self.n, self.as_torch = n, as_torch
        raw = (np.arange(1 << 20, dtype=np.uint32) % 251).astype(np.uint32).tobytes()
        self.blob = zlib.compress(raw, 1)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import zlib

        a = np.frombuffer(zlib.decompress(self.blob), np.uint32)
        if self.as_torch:
            import torch

            return torch.from_numpy(a.copy())
        return a


def run_w10(samples, workers):
    """W10: GIL-releasing work per sample, thread workers beside process
    workers (and PyTorch's DataLoader), samples/s and peak PSS."""
    import torch.utils.data as tud

    print(f"\nW10 GIL-free: zlib-decompress 4 MB per sample, {samples} samples, batch 16, "
          f"{workers} workers, second epoch")
    print(f"{'loader':<30} {'samples/s':>10} {'GB/s':>6} {'peak PSS':>9} {'threads are':>12}")
    rows = {}
    for kind in ("ShmLoader, thread workers", "ShmLoader, process workers", "PyTorch tensor path"):
        if kind.startswith("ShmLoader"):
            loader = ShmLoader(Compressed(samples), batch_size=16, num_workers=workers,
                               worker_mode="thread" if "thread" in kind else "process")
        else:
            loader = tud.DataLoader(Compressed(samples, as_torch=True), batch_size=16,
                                    num_workers=workers, persistent_workers=True)
        try:
            epoch_w1(loader)
            wall, cpu, first, total, count = epoch_w1(loader)
            with PeakMemory() as peak:  # apart from the timed epoch (see run_w1)
                epoch_w1(loader)
        finally:
            close(loader)
        rows[kind] = (samples / wall, total / wall / 1e9, peak.pss / 1e9)
    ours = rows["ShmLoader, thread workers"][0]
    for kind, (sps, gbs, pss) in rows.items():
        print(f"{kind:<30} {sps:>10.0f} {gbs:>6.2f} {pss:>6.2f} GB {ours / sps:>11.2f}x")
        if kind != "ShmLoader, thread workers":
            record_ratio("W10 (thread workers)", kind, ours / sps)


class SleepySamples:
    """IO-bound: 4 ms of waiting per sample."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.004)
        return np.full(256, i, np.float32)


class BusySamples(SleepySamples):
    """Compute-bound: about 1 ms of a CPU per sample."""

    def __getitem__(self, i):
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        return np.full(256, i, np.float32)


def run_auto(samples, epochs):
    """num_workers="auto" beside fixed pools, on an IO-bound and on a
    compute-bound workload: batches/s over the whole run (adaptation
    included) and over its last epoch."""
    print(f"\nAuto: {epochs} epochs of {samples} samples, batch 32, prefetch 16 batches; "
          f"batches/s over the whole run and its last epoch")
    print(f"{'workload':<14} {'workers':>8} {'run':>8} {'last':>8} {'chosen':>7}  worker counts")
    for name, cls in (("IO-bound", SleepySamples), ("compute-bound", BusySamples)):
        rates = {}
        for workers in (2, 4, 8, 16, 32, "auto"):
            with ShmLoader(cls(samples), batch_size=32, num_workers=workers, prefetch=16) as ld:
                t0, n = time.perf_counter(), 0
                for _ in range(epochs):
                    t1 = time.perf_counter()
                    k = sum(1 for _ in ld)
                    last = k / (time.perf_counter() - t1)
                    n += k
                rates[workers] = (n / (time.perf_counter() - t0), last)
                stats = ld.stats()
            counts = stats.get("worker_counts", "")
            print(f"{name:<14} {str(workers):>8} {rates[workers][0]:>8.1f} {last:>8.1f} "
                  f"{stats['workers']:>7}  {counts}", flush=True)
        best = max(v[0] for k, v in rates.items() if k != "auto")
        best_last = max(v[1] for k, v in rates.items() if k != "auto")
        print(f"{name}: auto is {rates['auto'][0] / best:.2f} of the best fixed pool over the "
              f"run, {rates['auto'][1] / best_last:.2f} over the last epoch")


def _token_table(rows, tokens, path):
    """W14's dataset: rows x tokens int32 ids in an Arrow stream file on
    disk (written in chunks, so the table never has to fit in memory),
    memory-mapped by datasets as any saved dataset is."""
    import datasets
    import pyarrow as pa

    schema = pa.schema([("ids", pa.list_(pa.int32(), tokens))])
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as out:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            flat = (np.arange(n * tokens, dtype=np.int64) + start * tokens) % 50_257
            out.write_batch(pa.record_batch([pa.FixedSizeListArray.from_arrays(
                pa.array(flat.astype(np.int32)), tokens)], schema=schema))
    return datasets.Dataset.from_file(path)


def _timed_batches(loader, n, warmup=20):
    """(batches/s, main-thread CPU ms per batch) over n batches after
    `warmup` (workers started, memory touched), across epoch ends."""
    it, taken = iter(loader), 0

    def take():
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(loader)
            return next(it)

    for _ in range(warmup):
        take()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        b = take()
        taken += 1
        del b
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    del it
    return taken / wall, cpu / taken * 1e3


def run_w14(rows, batches, tokens=1024, batch_size=32, workers=2):
    """W14: a Hugging Face datasets.Dataset of token ids read through its
    __getitems__ (one Arrow slice per batch), shuffled, 2 workers."""
    import tempfile

    import torch.utils.data as tud

    from loader import DataLoader

    with tempfile.TemporaryDirectory() as tmp:
        # one format for all: "torch" converts row by row inside datasets, which
        # then costs the same in every loader and hides what the loaders do
        ds = _token_table(rows, tokens, os.path.join(tmp, "tokens.arrow")).with_format("numpy")
        makers = {
            "ShmLoader": lambda: ShmLoader(ds, batch_size=batch_size, shuffle=True,
                                           num_workers=workers, seed=0),
            "loader.DataLoader": lambda: DataLoader(
                ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                persistent_workers=True),
            "PyTorch DataLoader": lambda: tud.DataLoader(
                ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                persistent_workers=True),
        }
        results = {}
        for kind, new in makers.items():
            loader = new()
            try:
                results[kind] = _timed_batches(loader, batches)
            finally:
                close(loader)
        del ds
    gb = rows * tokens * 4 / 1e9
    print(f"\nW14 datasets.Dataset: {rows} rows x {tokens} int32 ({gb:.2f} GB of Arrow), batch "
          f"{batch_size}, shuffled, {workers} workers, {batches} batches after 20")
    print(f"{'loader':<20} {'batch/s':>9} {'main CPU/batch':>15} {'vs PyTorch':>11}")
    torch_bps = results["PyTorch DataLoader"][0]
    for kind, (bps, cpu) in results.items():
        print(f"{kind:<20} {bps:>9.1f} {cpu:>12.3f} ms {bps / torch_bps:>10.2f}x")


WORKLOADS = {
    "W1": lambda args: run_w1(args.batches, args.warmup),
    "W2": lambda args: run_small("W2 tiny (10, 150) float64", W2, BATCH, 60),
    "W3": lambda args: run_w3(args.w3_batches),
    "W4": lambda args: run_small("W4 dict {x: (3, 64, 64) uint8, y, path}", W4, 64, 60),
    "W7": lambda args: run_w7(args.w7_steps),
    "W8": lambda args: run_w8(4, 256, (2, 4)),  # 1 GB of files
    "W9": lambda args: run_w9(400_000, 4, 256, 8192),
    "W10": lambda args: run_w10(512, 4),
    "AUTO": lambda args: run_auto(3000, 6),
    "W14": lambda args: run_w14(200_000, 600),  # 0.8 GB of Arrow in a temporary directory
    "W11": lambda args: _realistic().run_w11(2000),
    "W12": lambda args: _realistic().run_w12(args.w12_batches),
    "W13": lambda args: _realistic().run_w13(24),
    "KEEP": lambda args: _realistic().run_keep(64),
}


def _realistic():
    import realistic  # imports this module's helpers back: loaded only when asked for

    return realistic


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="W1,W2,W3,W4,W7,W8,W9,W10,AUTO,W11,W12,W13,KEEP",
                        help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--w3-batches", type=int, default=8)
    parser.add_argument("--w7-steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="W1 epochs before the timed one")
    parser.add_argument("--w12-batches", type=int, default=600)
    parser.add_argument("--plot", metavar="PATH",
                        help="draw the side-by-side ratios of every workload run as one PNG")
    args = parser.parse_args(argv)
    chosen = [w.strip().upper() for w in args.workloads.split(",")]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")  # PyTorch, 8 workers
    # Once torch is imported its idle thread pool exists; ShmLoader's fork
    # warning is right in general but says nothing about this benchmark.
    warnings.filterwarnings("ignore", message="ShmLoader forks")
    # W9's PyTorch peer collates pyarrow's read-only arrays; torch says so once per worker
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    print(f"{machine()}; peers: {', '.join(kinds()[1:])}")
    global PEER_STDERR
    if grain_available():
        PEER_STDERR = PeerStderr()
        start_resource_tracker()
    for w in chosen:
        WORKLOADS[w](args)
    if PEER_STDERR is not None:
        said = PEER_STDERR.report()
        print("\n" + (said + "\n" if said else "") + resource_tracker_note())
    if args.plot:
        from plot import plot_ratios

        plot_ratios(RATIOS, args.plot, f"ShmLoader side by side: {', '.join(chosen)}, "
                                       f"{time.strftime('%Y-%m-%d')}\n{machine()}")
        print(f"\nratios drawn in {args.plot}")


if __name__ == "__main__":
    main()
