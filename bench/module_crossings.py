"""How many loader modules main enters: per batch, and for a state round trip.

Issue 27's measure of main's coupling: a `next()` of an epoch iterator in
steady state (ShmLoader, a map-style dataset, in_order=True, two workers),
and a `state_dict()` -> `load_state_dict()` round trip (mid-epoch, into a
new loader of the same arguments).  An *entry* is a call into a module of
loader/ from a frame of another module (the training loop, another loader
module, the standard library); calls within one module are not entries,
and neither are returns.  Compiled code (loader/_native, shmq) is not seen:
sys.setprofile reports no call into a Cython function, so the count is of
loader's Python modules.  Only main's thread is watched (the workers are
other processes).

    PYTHONPATH=$PWD python bench/module_crossings.py [--batches N] [--detail]

prints, for each of the two, the entries and the distinct modules entered
(the batch's are the most common count over N steady-state batches), and
the Python-level calls made meanwhile, of any module.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

import loader
from loader import ShmLoader

LOADER_DIR = os.path.dirname(os.path.abspath(loader.__file__))


def module_of(filename: str) -> str | None:
    """The loader module a code object's file is (e.g. "main/runs"), else None."""
    if not filename.startswith(LOADER_DIR + os.sep):
        return None
    return os.path.splitext(os.path.relpath(filename, LOADER_DIR))[0]


class Crossings:
    """Counts the entries into loader modules while it is on (a context manager)."""

    def __init__(self):
        self.entries: collections.Counter = collections.Counter()
        self.calls = 0  # Python-level calls of any module (the cost W12 counts)

    def _profile(self, frame, event, arg):
        if event == "call":
            self.calls += 1
            callee = module_of(frame.f_code.co_filename)
            if callee is None:
                return
            caller = frame.f_back
            if caller is None or module_of(caller.f_code.co_filename) != callee:
                self.entries[callee] += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    @property
    def total(self) -> int:
        return sum(self.entries.values())


class Squares:
    """A small map-style dataset: each sample a (4,) float32 array."""

    def __len__(self):
        return 20_000

    def __getitem__(self, i):
        return np.full(4, i, np.float32)


def make_loader() -> ShmLoader:
    return ShmLoader(Squares(), batch_size=10, num_workers=2, in_order=True, seed=0)


def per_batch(batches: int) -> list[Crossings]:
    """The entries of `batches` steady-state next() calls, each with its batch here."""
    out = []
    with make_loader() as ld:
        it = iter(ld)
        for _ in range(20):  # past the first batches: the run is started, the slabs laid out
            next(it)
        for _ in range(batches):
            time.sleep(0.005)  # the batch is ready: next() receives without waiting
            with Crossings() as c:
                next(it)
            out.append(c)
    return out


def state_round_trip() -> Crossings:
    """The entries of state_dict() mid-epoch and load_state_dict() into a new loader."""
    with make_loader() as ld, make_loader() as fresh:
        it = iter(ld)
        for _ in range(25):
            next(it)
        with Crossings() as c:
            fresh.load_state_dict(ld.state_dict())
        return c


def show(title: str, c: Crossings, detail: bool) -> None:
    print(f"{title}: {c.total} module entries, {len(c.entries)} modules "
          f"({c.calls} Python calls)")
    if detail:
        for name, n in sorted(c.entries.items()):
            print(f"    {name}: {n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--detail", action="store_true", help="entries per module")
    args = parser.parse_args()
    print(f"loader: {LOADER_DIR}")
    batches = per_batch(args.batches)
    common, times = collections.Counter(c.total for c in batches).most_common(1)[0]
    typical = next(c for c in batches if c.total == common)
    show(f"a batch (the most common, {times} of {len(batches)})", typical, args.detail)
    show("a state_dict() -> load_state_dict() round trip", state_round_trip(), args.detail)


if __name__ == "__main__":
    main()
