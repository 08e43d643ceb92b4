"""What the loader's processes share: the configuration every process reads
(one frozen object instead of a dozen positional arguments) and the shared
memory main creates before it forks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import shmq
from loader._control import Control
from loader._slabs import MAX_LEASES
from loader._table import BatchTable

# Ring capacities.  Samples never travel through a ring (NOTE [ Direct row
# writes ]): only layouts, non-numeric leaves, and samples of a batch whose
# dtypes differ.
TO_COLLATOR_BYTES = 8 << 20
TO_MAIN_BYTES = 4 << 20


@dataclass(frozen=True)
class LoaderConfig:
    dataset: Any
    batch_size: int
    num_workers: int
    prefetch: int
    drop_last: bool
    in_order: bool
    iterable: bool
    collate_fn: Callable | None
    worker_init_fn: Callable | None
    seed: int
    memory_cap_bytes: int
    parent_pid: int

    @property
    def per_batch(self) -> bool:
        """Workers load and collate whole batches (a collate_fn, as torch
        runs it) instead of placing samples in rows."""
        return self.collate_fn is not None

    @property
    def publish_window(self) -> int:
        """How many batches past those sent the collator lays out ahead:
        workers load units below main's limit, `prefetch` batches past what
        it has yielded, plus one claim each that waits; two more batches
        of slack let the next be ready as the window moves."""
        return self.prefetch + 2


class SharedState:
    """Shared memory and rings, made by main before it forks; every child
    inherits them.  Nothing here has a name."""

    def __init__(self, cfg: LoaderConfig):
        self.control = Control()
        self.table = BatchTable(max(64, 2 * cfg.publish_window))
        self.arena = shmq.shared_array(cfg.memory_cap_bytes, np.uint8)
        self.released = shmq.shared_array(MAX_LEASES, np.int64)
        self.hazards = shmq.shared_array(max(cfg.num_workers, 1), np.int64)
        self.order_fds: list[int] = []
        self.rings: list[shmq.Queue] = []
        try:
            # A user sampler's order for each run parity (NOTE [ Runs ]).
            for _ in range(2):
                self.order_fds.append(os.memfd_create("shmloader-order", os.MFD_CLOEXEC))
            self.rings.append(shmq.Queue(TO_COLLATOR_BYTES, multi_producer=True, anonymous=True))
            self.rings.append(shmq.Queue(TO_MAIN_BYTES, anonymous=True))
        except BaseException:
            self.close()
            raise
        self.to_collator, self.to_main = self.rings

    def write_order(self, run: int, order: np.ndarray) -> None:
        fd = self.order_fds[run % 2]
        data = memoryview(np.ascontiguousarray(order, np.int64)).cast("B")
        os.ftruncate(fd, len(data))
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)

    def read_order(self, run: int, n: int) -> np.ndarray:
        out = np.empty(n, np.int64)
        buf = memoryview(out).cast("B")
        done = 0
        while done < len(buf):
            got = os.preadv(self.order_fds[run % 2], [buf[done:]], done)
            if got == 0:
                raise RuntimeError(f"the run's order file holds {done} bytes, not {len(buf)}")
            done += got
        return out

    def close(self) -> None:
        for q in self.rings:
            q.close()
        for fd in self.order_fds:
            os.close(fd)
        self.rings, self.order_fds = [], []
