"""What ShmLoader(trace=PATH) costs: the same workload with the trace on
and off, side by side in one run (issue 16).

    python bench/trace_cost.py [--rounds 5]

Workloads: W1-like (1000, 150) float64 samples, batch 128, 12 batches per
epoch, and W2-like (10, 150) float64 samples, batch 128, 60 batches per
epoch; 2 workers each.  Both loaders of a workload are alive at once: one
warm-up epoch each, then --rounds rounds of one timed epoch each, in turn,
so both see the same load from the rest of the machine; the median epoch
of each is compared.  Also: one trace record in one process (us), and what
close() spends writing the JSON and its size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from loader import ShmLoader  # noqa: E402
from loader.shared.trace import TraceLog  # noqa: E402
from report import machine  # noqa: E402


class Full:
    """np.full(shape, i, float64)."""

    def __init__(self, n, shape):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(self.shape, i, np.float64)


def epoch_seconds(loader) -> float:
    t0 = time.perf_counter()
    for b in loader:
        del b
    return time.perf_counter() - t0


def record_us(repeats=200_000) -> float:
    with tempfile.TemporaryDirectory() as d:
        log = TraceLog(os.path.join(d, "t.json"), capacity=repeats + 8)
        tracer = log.tracer(0)
        t0 = time.perf_counter()
        for i in range(repeats):
            tracer.load(i, i, index=i, position=i, samples=1, epoch=1)
        return (time.perf_counter() - t0) / repeats * 1e6


def compare(name, shape, batches, rounds):
    samples = batches * 128
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        loaders = {"off": ShmLoader(Full(samples, shape), batch_size=128, num_workers=2, seed=0),
                   "on": ShmLoader(Full(samples, shape), batch_size=128, num_workers=2, seed=0,
                                   trace=path)}
        times = {k: [] for k in loaders}
        try:
            for ld in loaders.values():
                epoch_seconds(ld)  # workers started, slabs touched
            for _ in range(rounds):
                for k, ld in loaders.items():
                    times[k].append(epoch_seconds(ld))
        finally:
            loaders["off"].close()
            t0 = time.perf_counter()
            loaders["on"].close()
            write_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        with open(path) as f:
            events = len(json.load(f)["traceEvents"])
    off, on = (float(np.median(times[k])) for k in ("off", "on"))
    nbytes = samples * int(np.prod(shape)) * 8
    per_sample_us = (on - off) / samples * 1e6
    print(f"{name:<34} {nbytes / off / 1e9:>9.2f} {nbytes / on / 1e9:>9.2f} {on / off:>8.3f} "
          f"{per_sample_us:>+12.2f} {write_s:>8.2f} s {size / 1e6:>7.1f} MB {events:>8}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{machine()}; load average {os.getloadavg()[0]:.2f}")
    print(f"one trace record in one process: {record_us():.2f} us")
    print(f"\n{'workload (2 workers, batch 128)':<34} {'off GB/s':>9} {'on GB/s':>9} "
          f"{'on/off':>8} {'us/sample':>12} {'close()':>10} {'JSON':>10} {'events':>8}")
    compare("W1-like (1000, 150) f8, 12 batches", (1000, 150), 12, args.rounds)
    compare("W2-like (10, 150) f8, 60 batches", (10, 150), 60, args.rounds)
    print(f"(median of {args.rounds} epochs each, all epochs of a loader in one trace; "
          f"on/off is the epoch time ratio)")


if __name__ == "__main__":
    main()
