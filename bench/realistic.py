"""The workloads users actually run (W11 images, W12 tokens, W13 bytes and
text) and the keep-the-labels loop (KEEP), side by side with their peers
in one run; called from bench/loaders.py (--workloads W11,W12,W13,KEEP).

Every dataset object is shared as is by all the loaders of a workload
(numpy leaves: PyTorch's default collate turns them into tensors), and the
training loop touches nothing, so the figures are the loaders' own.  All
the loaders of a workload are alive at once: one warm-up epoch each, then
ROUNDS rounds of one timed epoch each, in turn, so that every loader sees
the same load from the rest of the machine (2 shared cores); each loader's
median epoch gives samples/s, batches/s and main-thread CPU per batch
(time.thread_time()).  Peak memory is measured afterwards, one loader
alive at a time (a warm-up epoch, then one sampled by PeakMemory: PSS of
the process tree + /dev/shm growth; loaders.py says why it is kept out of
the timed epochs).

Generated data (JPEGs, the token file) lives in the temp directory and is
reused by later runs: $TMPDIR/shmq-bench-*.
"""

from __future__ import annotations

import gc
import math
import os
import random
import tempfile
import time

import numpy as np

from loader import ShmLoader
from loaders import PeakMemory, _pss, _tree, busy, close
from report import record_ratio

OURS = "ShmLoader"


def _torch_loader(dataset, batch_size, workers, **kw):
    import torch.utils.data as tud

    return tud.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                          persistent_workers=True, prefetch_factor=2, **kw)


def _drop_in(dataset, batch_size, workers):
    from loader import DataLoader

    return DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                      persistent_workers=True, prefetch_factor=2)


def _epoch(loader):
    t0, c0, n = time.perf_counter(), time.thread_time(), 0
    for b in loader:
        n += 1
        del b
    return time.perf_counter() - t0, time.thread_time() - c0, n


ROUNDS = 3


def _side_by_side(makers, samples):
    """kind -> (samples/s, batches/s, main CPU ms per batch, peak PSS GB,
    /dev/shm GB, stats() of the last timed epoch or None); makers: kind ->
    a function making that loader."""
    loaders, timed, stats = {}, {kind: [] for kind in makers}, {}
    try:
        for kind, make in makers.items():
            loaders[kind] = make()
            _epoch(loaders[kind])  # workers started, memory touched
        for _ in range(ROUNDS):
            for kind, loader in loaders.items():
                timed[kind].append(_epoch(loader))
        for kind, loader in loaders.items():
            stats[kind] = loader.stats() if hasattr(loader, "stats") else None
    finally:
        for loader in loaders.values():
            close(loader)
    rows = {}
    for kind, make in makers.items():
        loader = make()
        try:
            _epoch(loader)
            with PeakMemory() as peak:
                _epoch(loader)
        finally:
            close(loader)
        wall, cpu, n = sorted(timed[kind])[ROUNDS // 2]
        rows[kind] = (samples / wall, n / wall, cpu / n * 1e3, peak.pss / 1e9, peak.shm / 1e9,
                      stats[kind])
    return rows


def _table(workload, title, rows, unit="samples/s"):
    print(f"\n{workload} {title}")
    print(f"{'loader':<30} {unit:>10} {'batch/s':>8} {'main CPU/batch':>15} {'peak PSS':>9} "
          f"{'/dev/shm':>8} {'ShmLoader is':>13}")
    ours = rows[OURS][0]
    for kind, (sps, bps, cpu, pss, shm, _) in rows.items():
        print(f"{kind:<30} {sps:>10.1f} {bps:>8.1f} {cpu:>12.3f} ms {pss:>6.2f} GB {shm:>5.2f} GB "
              f"{ours / sps:>12.2f}x", flush=True)
        if kind != OURS:
            record_ratio(workload, kind, ours / sps)
    if rows[OURS][5]:
        print(f"  ShmLoader stats(): {rows[OURS][5].get('summary')}")


def _cache_dir(name):
    return os.path.join(tempfile.gettempdir(), f"shmq-bench-{name}")


# --- W13: bytes and text -----------------------------------------------------------------


class RawJpegs:
    """(bytes of 100-200 KB, label): encoded images read whole for GPU
    decoding.  Each sample is a fresh bytes object (a slice copies), as a
    file read would be."""

    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.n = n
        self.blob = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() * 2
        self.sizes = rng.integers(100_000, 200_001, n)
        self.starts = rng.integers(0, 1 << 20, n)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = int(self.starts[i])
        return self.blob[s:s + int(self.sizes[i])], i % 1000


class Documents(RawJpegs):
    """(str of 1 MB, label): ASCII text, a fresh str per sample."""

    def __init__(self, n):
        rng = np.random.default_rng(1)
        self.n = n
        words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), k)) for k in
                 rng.integers(2, 10, 4096)]
        text = " ".join(words)
        self.blob = (text * (-(-(2 << 20) // len(text))))[:2 << 20]
        self.sizes = np.full(n, 1 << 20)
        self.starts = rng.integers(0, 1 << 20, n)


def run_w13(batches):
    for name, cls, batch_size in (("W13 bytes", RawJpegs, 256), ("W13 text", Documents, 64)):
        samples = batches * batch_size
        dataset = cls(samples)
        rows = _side_by_side({
            OURS: lambda: ShmLoader(dataset, batch_size=batch_size, num_workers=2, seed=0),
            "loader.DataLoader": lambda: _drop_in(dataset, batch_size, 2),
            "PyTorch DataLoader": lambda: _torch_loader(dataset, batch_size, 2),
        }, samples)
        what = ("raw JPEG bytes of 100-200 KB" if cls is RawJpegs else "1 MB str documents")
        _table(name, f"{batches} batches of {batch_size} x ({what}, label), 2 workers, median "
                     f"of {ROUNDS} epochs", rows)


# --- W11: JPEG decode + RandomResizedCrop + flip ------------------------------------------


def make_jpegs(n, size=(500, 375), quality=90):
    """n photo-like JPEGs (smooth colour fields, edges and sensor noise, so
    they compress as photos do: ~90 KB at q90), made once."""
    from PIL import Image

    root = _cache_dir(f"w11-{n}-{size[0]}x{size[1]}-q{quality}")
    done = os.path.join(root, "done")
    if not os.path.exists(done):
        os.makedirs(root, exist_ok=True)
        rng = np.random.default_rng(0)
        w, h = size
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(n):
            coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
            mid = rng.integers(0, 256, (47, 63, 3), dtype=np.uint8)
            field = (0.6 * np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC),
                                      np.float32)
                     + 0.4 * np.asarray(Image.fromarray(mid).resize((w, h), Image.BICUBIC),
                                        np.float32))
            for _ in range(3):
                cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(20, 120)
                disk = ((xx - cx) ** 2 + (yy - cy) ** 2 < r * r)[..., None]
                field = np.where(disk, field * 0.5 + rng.uniform(0, 128, 3), field)
            field += rng.normal(0, 12, field.shape)
            img = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8))
            img.save(os.path.join(root, f"{i:05d}.jpg"), quality=quality)
        open(done, "w").close()
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".jpg"))


def random_resized_crop_box(w, h, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, on Python's random."""
    area = w * h
    for _ in range(10):
        target = area * random.uniform(*scale)
        aspect = math.exp(random.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = random.randint(0, w - cw), random.randint(0, h - ch)
            return x, y, x + cw, y + ch
    in_ratio = w / h  # torchvision's fallback: a centre crop
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        cw, ch = int(round(h * ratio[1])), h
    else:
        cw, ch = w, h
    x, y = (w - cw) // 2, (h - ch) // 2
    return x, y, x + cw, y + ch


class Jpegs:
    """The ImageNet training recipe with Pillow: decode, RandomResizedCrop(224)
    (crop and bilinear resize in one), RandomHorizontalFlip, uint8 CHW out
    (normalisation is the training side's)."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
        box = random_resized_crop_box(*im.size)
        im = im.resize((224, 224), Image.BILINEAR, box=box)
        if random.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return np.ascontiguousarray(np.asarray(im).transpose(2, 0, 1)), i % 1000


class SpdlImages:
    """SPDL 0.8's pipeline on the same per-sample function: a source of
    indices, the decode stage on 2 threads (Pillow releases the GIL while
    it decodes and resizes), batches of 64 stacked in numpy.  A pipeline
    per epoch, as it is used."""

    def __init__(self, dataset, batch_size, threads):
        self.dataset, self.batch_size, self.threads = dataset, batch_size, threads

    def _collate(self, samples):
        return np.stack([s[0] for s in samples]), np.array([s[1] for s in samples])

    def __iter__(self):
        from spdl.pipeline import PipelineBuilder

        pipeline = (PipelineBuilder()
                    .add_source(range(len(self.dataset)))
                    .pipe(self.dataset.__getitem__, concurrency=self.threads)
                    .aggregate(self.batch_size)
                    .pipe(self._collate)
                    .add_sink(3)
                    .build(num_threads=self.threads + 2))
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=60)


def spdl_status():
    """None if SPDL's pipeline imports, else the reason it is skipped."""
    try:
        import spdl.pipeline  # noqa: F401
    except ImportError as exc:
        return f"SPDL skipped: {exc} (pip install spdl==0.8.0)"
    return None


def run_w11(nfiles):
    t0 = time.perf_counter()
    files = make_jpegs(nfiles)
    made_s = time.perf_counter() - t0
    kb = sum(os.path.getsize(f) for f in files) / len(files) / 1e3
    dataset = Jpegs(files)
    makers = {
        OURS: lambda: ShmLoader(dataset, batch_size=64, num_workers=2, seed=0),
        "ShmLoader, thread workers": lambda: ShmLoader(dataset, batch_size=64, num_workers=2,
                                                       seed=0, worker_mode="thread"),
        "PyTorch DataLoader": lambda: _torch_loader(dataset, 64, 2),
    }
    skipped = spdl_status()
    if skipped is None:
        makers["SPDL pipeline, 2 threads"] = lambda: SpdlImages(dataset, 64, 2)
    rows = _side_by_side(makers, len(dataset))
    _table("W11", f"images: {len(files)} JPEGs 500x375 q90 (mean {kb:.0f} KB; made or found in "
                  f"{made_s:.0f} s), Pillow decode + RandomResizedCrop(224) + "
                  f"flip, uint8 (3, 224, 224) + label, batch 64, 2 workers, median of {ROUNDS} "
                  f"epochs", rows)
    if skipped:
        print(f"  {skipped}")
    one = sorted(_decode_ms(dataset) for _ in range(3))[1]
    print(f"  one sample in one process: {one:.2f} ms (decode-bound ceiling on 2 cores: "
          f"{2000 / one:.0f} samples/s)")


def _decode_ms(dataset, n=100):
    t0 = time.perf_counter()
    for i in range(n):
        dataset[i]
    return (time.perf_counter() - t0) / n * 1e3


# --- W12: token windows -------------------------------------------------------------------


def make_tokens(nbytes=1 << 30, vocab=50257):
    path = _cache_dir(f"w12-{nbytes}.bin")
    if not os.path.exists(path) or os.path.getsize(path) != nbytes:
        rng = np.random.default_rng(0)
        with open(path + ".part", "wb") as f:
            for _ in range(nbytes // (64 << 20)):
                f.write(rng.integers(0, vocab, 32 << 20, dtype=np.uint16).tobytes())
        os.replace(path + ".part", path)
    return path


class TokenWindows:
    """Random windows of block + 1 tokens of a uint16 memmap -> (x, y) int64
    (block,), as nanoGPT-style pretraining cuts them.  The memmap is opened
    in each process on first use (never inherited across a fork)."""

    def __init__(self, path, n, block=1024):
        self.path, self.n, self.block = path, n, block
        ntok = os.path.getsize(path) // 2
        self.starts = np.random.default_rng(0).integers(0, ntok - block - 1, n)
        self._data, self._pid = None, None

    def __len__(self):
        return self.n

    def _tokens(self):
        if self._pid != os.getpid():
            self._data, self._pid = np.memmap(self.path, np.uint16, "r"), os.getpid()
        return self._data

    def __getitem__(self, i):
        s = int(self.starts[i])
        w = self._tokens()[s:s + self.block + 1].astype(np.int64)
        return w[:-1], w[1:]


class TokenWindowsBatched(TokenWindows):
    """TokenWindows with __getitems__ (issue 18): the batch's windows in one
    vectorised gather (a (B, block + 1) fancy index of the memmap, one
    astype), then split into the list of (x, y) samples torch's contract
    asks for; each sample is a pair of views into that one array."""

    def __getitems__(self, indices):
        offsets = np.arange(self.block + 1)
        w = self._tokens()[self.starts[indices][:, None] + offsets].astype(np.int64)
        return list(zip(w[:, :-1], w[:, 1:]))


class GetBatch:
    """nanoGPT's train.py get_batch, in the training process: a new memmap
    per call, torch.randint offsets, a stack of int64 slices."""

    def __init__(self, path, batches, batch_size=32, block=1024):
        self.path, self.batches, self.batch_size, self.block = path, batches, batch_size, block

    def get_batch(self):
        import torch

        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - self.block, (self.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + self.block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + self.block].astype(np.int64))
                         for i in ix])
        return x, y

    def __iter__(self):
        for _ in range(self.batches):
            yield self.get_batch()


GETITEMS = "ShmLoader + __getitems__"


def run_w12(batches):
    path = make_tokens()
    dataset = TokenWindows(path, batches * 32)
    batched = TokenWindowsBatched(path, batches * 32)  # the same windows, one call per batch
    rows = _side_by_side({
        OURS: lambda: ShmLoader(dataset, batch_size=32, num_workers=2, seed=0, output="torch"),
        GETITEMS: lambda: ShmLoader(batched, batch_size=32, num_workers=2, seed=0,
                                    output="torch"),
        "PyTorch DataLoader": lambda: _torch_loader(dataset, 32, 2),
        "nanoGPT get_batch, in-process": lambda: GetBatch(path, batches),
    }, batches)
    _table("W12", f"tokens: 1 GB uint16 memmap, random windows of 1,025 -> (x, y) int64 "
                  f"(32, 1024), {batches} batches, 2 workers, median of {ROUNDS} epochs", rows,
           unit="batch/s")
    ours, gi = rows[OURS], rows[GETITEMS]
    nano = rows["nanoGPT get_batch, in-process"]
    print(f"  training-loop time per batch: ShmLoader {1e3 / ours[1]:.3f} ms wall, "
          f"{ours[2]:.3f} ms main CPU; {GETITEMS} {1e3 / gi[1]:.3f} ms wall, {gi[2]:.3f} ms "
          f"main CPU; in-process get_batch {1e3 / nano[1]:.3f} ms wall, "
          f"{nano[2]:.3f} ms main CPU")
    print(f"  {GETITEMS} vs in-process get_batch: {gi[1] / nano[1]:.2f}x batches/s "
          f"(target >= 1x), {gi[2]:.3f} ms main CPU per batch (target <= 0.05 ms); "
          f"stats(): {gi[5].get('summary') if gi[5] else None}")


# --- KEEP: targets.append(y) over an epoch 4x memory_cap_bytes -----------------------------


class Labelled:
    """(48 KiB image, label), the reproduction's dataset."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.zeros((3, 64, 64), np.float32), i


def _tree_bytes(base_shm):
    pss = sum(_pss(pid) for pid in _tree(os.getpid()))
    return pss + PeakMemory._shm_used() - base_shm


def run_keep(cap_mb):
    cap = cap_mb << 20
    n = 4 * cap // (3 * 64 * 64 * 4) // 100 * 100 + 100  # an epoch just over 4x the cap
    print(f"\nKEEP: every label kept (targets.append(y)), a 10 ms step, {n} samples of 48 KiB + "
          f"label, batch 100, 2 workers, epoch of {n * 48 / 1024:.0f} MiB = "
          f"{n * 3 * 64 * 64 * 4 / cap:.1f}x memory_cap_bytes ({cap_mb} MiB), torch out")
    print(f"{'loader':<22} {'exact':>9} {'seconds':>8} {'peak over warm':>15} "
          f"{'kept labels cost':>17} {'slabs moved out':>16} {'kept bytes':>11}")
    dataset, rows = Labelled(n), {}
    for kind in (OURS, "PyTorch DataLoader"):
        if kind == OURS:
            loader = ShmLoader(dataset, batch_size=100, num_workers=2, output="torch",
                               memory_cap_bytes=cap, timeout=60)
        else:
            loader = _torch_loader(dataset, 100, 2)
        try:
            _epoch(loader)  # warm: workers up, the pool (ShmLoader) faulted in
            gc.collect()
            shm0 = PeakMemory._shm_used()
            warm = _tree_bytes(shm0)
            targets, t0, done = [], time.perf_counter(), False
            with PeakMemory() as peak:
                for _, y in loader:
                    targets.append(y)
                    busy(0.01)  # an evaluation step: PeakMemory samples every 50 ms
                done = True
            secs = time.perf_counter() - t0
            held = _tree_bytes(shm0)
            # every label, in order, with its value: what the loop kept is intact
            labels = len(targets) and int((np.concatenate([np.asarray(t) for t in targets])
                                           == np.arange(n)).sum())
            del targets, y
            gc.collect()
            freed = _tree_bytes(shm0)
            book = getattr(loader, "_leases", None)  # see the report: no public counter yet
            moved = (book.evicted_slabs, book.kept_bytes) if book is not None else (None, None)
        finally:
            close(loader)
        grown = peak.pss + peak.shm - warm
        rows[kind] = grown
        print(f"{kind:<22} {str(done and labels == n):>9} {secs:>8.2f} {grown / 1e6:>12.1f} MB "
              f"{(held - freed) / 1e6:>14.2f} MB {str(moved[0]):>16} "
              f"{'-' if moved[1] is None else f'{moved[1] / 1e6:.2f} MB':>11}", flush=True)
    torch_grown = rows["PyTorch DataLoader"]
    ratio = rows[OURS] / torch_grown if torch_grown > 0 else float("inf")
    print(f"  peak memory over the warmed-up loader: ShmLoader {ratio:.2f}x PyTorch's "
          f"(target <= 1.10)")
    if ratio > 0:  # a growth within the sampler's noise can read as a fall
        record_ratio("KEEP", "PyTorch DataLoader (memory)", 1 / ratio)
