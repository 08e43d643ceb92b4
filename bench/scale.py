"""SCALE: an epoch's start-up and memory against the dataset's size
(issue 19; docs/benchmarks.md, table SCALE).

    python bench/scale.py [--sizes 1e6,1e8,2e9] [--batches 200] [--loaders ...]

Tiny samples (sample i is the int i), batch 256, 2 workers, shuffled, one
fresh process per (loader, size), so that each peak is its own:
- first batch: from creating the loader to holding its first batch;
- steady batches/s over the next --batches batches;
- peak memory: the most PSS (proportional set size: shared pages count
  once) of the loader's processes together, sampled every 20 ms, less the
  main process's PSS before the loader was made.
Loaders: ShmLoader(seed=) (the seeded order, computed per index; seed=
also seeds the generators before every sample, reproducible=True, which
the -norepro row leaves out),
ShmLoader(generator=) (torch's randperm, written out once), ShmLoader with
a custom lazy sampler (streamed) with len() and without it,
loader.DataLoader(shuffle=True) (RandomSampler drawn in one call) and
with the custom lazy sampler (streamed), PyTorch's DataLoader
(shuffle=True, and with the custom lazy sampler), and
Grain's DataLoader (IndexSampler: a lazy index_shuffle).  A size a loader
cannot hold in this machine's RAM is skipped and said so.

Also the seeded order's cost per index (SeededOrder.fill of 10,000,000
positions; target <= 0.2 us).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import machine  # noqa: E402

LOADERS = ["shm-seed", "shm-seed-norepro", "shm-generator", "shm-sampler", "shm-sampler-nolen",
           "dataloader", "dataloader-sampler", "torch", "torch-sampler", "grain"]

# bytes per sample a loader needs up front, to skip sizes beyond RAM: the
# written-out orders (torch: randperm, then a list of Python ints in main)
_BYTES_PER_SAMPLE = {"shm-seed": 0, "shm-seed-norepro": 0, "shm-generator": 16,
                     "shm-sampler": 0, "shm-sampler-nolen": 0, "dataloader": 16,
                     "dataloader-sampler": 0, "torch": 48, "torch-sampler": 0, "grain": 0}

def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:  # every thread's children (Grain starts its workers from a thread)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


class Tiny:
    """Sample i is the int i (at module level: Grain's spawned workers import it)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Lazy:
    """A custom sampler yielding its n indices one by one."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        n = self.n
        return ((i * 7919) % n for i in range(n))


class LazyNoLen:
    """A custom sampler yielding its n indices one by one, with no __len__
    (Grain's samplers are random access, RecordMetadata by record key: a
    generator of indices has no Grain equivalent to measure)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        n = self.n
        return ((i * 7919) % n for i in range(n))


def _make(which: str, n: int, B: int):
    from loader import ShmLoader

    if which == "shm-seed":  # seed= also seeds every sample (reproducible=True): ~7 us each
        return ShmLoader(Tiny(n), batch_size=B, shuffle=True, seed=1, num_workers=2)
    if which == "shm-seed-norepro":  # the seeded order alone, as the other rows load
        return ShmLoader(Tiny(n), batch_size=B, shuffle=True, seed=1, num_workers=2,
                         reproducible=False)
    if which == "shm-generator":
        import torch
        return ShmLoader(Tiny(n), batch_size=B, shuffle=True, num_workers=2,
                         generator=torch.Generator().manual_seed(1))
    if which == "shm-sampler":
        return ShmLoader(Tiny(n), batch_size=B, sampler=Lazy(n), num_workers=2)
    if which == "shm-sampler-nolen":  # its length learnt when it ends (an OPEN run)
        return ShmLoader(Tiny(n), batch_size=B, sampler=LazyNoLen(n), num_workers=2)
    if which == "dataloader":  # loader.DataLoader: torch's RandomSampler, drawn in one call
        import loader
        return loader.DataLoader(Tiny(n), batch_size=B, shuffle=True, num_workers=2)
    if which == "dataloader-sampler":  # loader.DataLoader: a user's sampler, streamed
        import loader
        return loader.DataLoader(Tiny(n), batch_size=B, sampler=Lazy(n), num_workers=2)
    if which == "torch":
        import torch
        return torch.utils.data.DataLoader(Tiny(n), batch_size=B, shuffle=True, num_workers=2)
    if which == "torch-sampler":  # PyTorch's DataLoader pulls a sampler lazily too
        import torch
        return torch.utils.data.DataLoader(Tiny(n), batch_size=B, sampler=Lazy(n), num_workers=2)
    import grain.python as pygrain
    sampler = pygrain.IndexSampler(num_records=n, shard_options=pygrain.NoSharding(),
                                   shuffle=True, num_epochs=1, seed=1)
    return pygrain.DataLoader(data_source=Tiny(n), sampler=sampler, worker_count=2,
                              operations=[pygrain.Batch(batch_size=B)])


def child(which: str, n: int, B: int, nb: int, result: str) -> None:
    """One measurement, in a process of its own; prints one JSON line."""
    import threading
    import time

    if which in ("shm-generator", "dataloader", "dataloader-sampler", "torch", "torch-sampler"):
        import torch  # noqa: F401  (imported before the baseline: not the loader's memory)
    if which == "grain":
        import grain.python  # noqa: F401
    import loader  # noqa: F401
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.02):
            peak[0] = max(peak[0], sum(_pss_kb(p) for p in _tree(os.getpid())))

    base = _pss_kb(os.getpid())
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    it = iter(_make(which, n, B))
    next(it)
    t1 = time.perf_counter()
    for _ in range(nb):
        next(it)
    t2 = time.perf_counter()
    stop.set()
    peak[0] = max(peak[0], sum(_pss_kb(p) for p in _tree(os.getpid())))
    with open(result, "w") as f:
        f.write(json.dumps({"first_batch_s": t1 - t0, "batches_per_s": nb / (t2 - t1),
                            "peak_mb": (peak[0] - base) / 1024}))
    if which != "grain":
        os._exit(0)  # no teardown in the figures
    # Grain: a normal exit, so that its workers and their shared memory go


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_one(which: str, n: int, batch: int, batches: int, timeout: float) -> dict:
    need = _BYTES_PER_SAMPLE[which] * n
    if need > ram_bytes() * 0.6:
        return {"skipped": f"needs ~{need / 2**30:.0f} GiB up front, the machine has "
                           f"{ram_bytes() / 2**30:.0f}"}
    if which == "grain":
        try:
            import grain.python  # noqa: F401
        except ImportError:
            return {"skipped": "not installed"}
    import signal
    import tempfile
    import time

    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", which, str(n), str(batch),
               str(batches), result.name]
        # a session of its own: workers a peer leaves behind (Grain's, after
        # os._exit) are ended with it, and never hold a pipe this waits on
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            child.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        # SIGTERM first: a peer's workers die, and the multiprocessing
        # resource tracker they leave then unlinks their /dev/shm entries
        # (psm_*, sem.mp-*) as it sees them go; SIGKILL only what is left
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            if grace:
                time.sleep(grace)
        child.wait()
        text = result.read().strip()
    if timed_out:
        return {"skipped": f"no first batch and {batches} more within {timeout:.0f} s"}
    if not text:
        return {"skipped": f"failed (exit {child.returncode})"}
    return json.loads(text)


def per_index_ns() -> dict:
    import time

    import numpy as np

    from loader._native import SeededOrder

    out = np.empty(10_000_000, np.int64)
    figures = {}
    for n in (10**6, 2 * 10**9, (1 << 31) + 11, (1 << 33) + 7):
        o = SeededOrder(n, 1, 1, True)
        best = min(_timed(lambda: o.fill(out[:min(n, len(out))], 0), time) for _ in range(3))
        figures[n] = best / min(n, len(out)) * 1e9
    return figures


def _timed(fn, time) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        which, n, B, nb = argv[1], *(int(v) for v in argv[2:5])
        return child(which, n, B, nb, argv[5])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e6,1e8,2e9")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    print(f"SCALE on {machine()}; load {os.getloadavg()[0]:.2f}")
    for n, ns in per_index_ns().items():
        print(f"  seeded order, n={n:,}: {ns:.1f} ns per index")
    print(f"{'loader':<15} {'samples':>14} {'first batch s':>14} {'batches/s':>10} "
          f"{'peak MB':>9}")
    for which in args.loaders.split(","):
        for n in sizes:
            r = run_one(which, n, args.batch, args.batches, args.timeout)
            if "skipped" in r:
                print(f"{which:<15} {n:>14,} {'-':>14} {'-':>10} {'-':>9}  {r['skipped']}")
            else:
                print(f"{which:<15} {n:>14,} {r['first_batch_s']:>14.3f} "
                      f"{r['batches_per_s']:>10.0f} {r['peak_mb']:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
