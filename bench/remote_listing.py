"""What a listing of many objects costs an epoch boundary (issue 26: "a
prefix of a million objects must not stall an epoch boundary by more than
1 s").

Listing itself runs in the background (the fetcher's "listing" thread, as
an epoch starts, for the epoch after).  What main waits for at the
boundary is the fetcher's adoption of the new listing: every object's
cache id looked up and the complete ones pinned for the epoch
(`ObjectCache.pin_epoch`).  This times that on a cache index holding
`--cached` complete objects, for a listing of `--objects`, three times
(two slots, then the first again, as epochs alternate), and the rest of
the adoption the fetcher does in Python (urls, board state), without a
server: the index and the board are the whole cost.

    python bench/remote_listing.py --objects 1000000 --cached 200000
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from loader.datasets.remote.cache import COMPLETE, ObjectCache
from report import cpu_model  # bench/


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--cached", type=int, default=200_000)
    ap.add_argument("--dir", default=None, help="where the cache index goes (default: a temp dir)")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; load {os.getloadavg()[0]:.1f}")
    top = tempfile.mkdtemp(prefix="shmq-listing-", dir=args.dir)
    try:
        cache = ObjectCache(top, 1 << 50)
        keys = [f"sims/{i:08d}.npy" for i in range(args.objects)]
        etags = [f'"{i:032x}"' for i in range(args.objects)]
        root = "s3://bucket"
        cached = np.random.default_rng(0).choice(args.objects, args.cached, replace=False)
        cache.db.execute("BEGIN")
        cache.db.executemany(
            "INSERT INTO objects (url, etag, size, state, fetched_at) VALUES (?, ?, 1, ?, 0)",
            ((f"{root}/{keys[i]}", etags[i], COMPLETE) for i in cached.tolist()))
        cache.db.execute("COMMIT")
        for slot in (0, 1, 0):
            t0 = time.perf_counter()
            urls = [f"{root}/{k}" for k in keys]          # what the fetcher's _adopt does
            ids = cache.pin_epoch(slot, list(zip(urls, etags)))
            state = np.where(ids >= 0, 1, 0).astype(np.int32)
            took = time.perf_counter() - t0
            print(f"adopt {args.objects:,} objects ({int((state == 1).sum()):,} complete) "
                  f"into slot {slot}: {took:.2f} s")
        cache.close()
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
