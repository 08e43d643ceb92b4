"""Headline demo: one producer process sends (1000, 150) float64 arrays
(1.2 MB) to this process through shmq, multiprocessing.Queue and
faster-fifo; prints throughput and ratios (workload W5 of docs/benchmarks.md).

    python bench/demo.py [--count 600] [--repeats 3]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ipc  # noqa: E402
from report import RESULTS, format_table, machine, record  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=600, help="messages per round")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median), after a warm-up")
    args = parser.parse_args(argv)
    nbytes = 1_200_000
    print(f"W5: 1 producer -> 1 consumer, {args.count} arrays of (1000, 150) float64 per round")
    print(machine())
    for t in ipc.TRANSPORTS:
        seconds = ipc.timed(t, nbytes, args.count, 1, args.repeats)
        record("W5 1.2 MB", t.name, nbytes, args.count, seconds)
        print(f"  measured {t.name}", flush=True)
    record("W5 1.2 MB", "np.copyto (copy limit)", nbytes, args.count,
           ipc.copy_limit_seconds(nbytes, args.count))
    print()
    print("\n".join(format_table(RESULTS)))


if __name__ == "__main__":
    main()
