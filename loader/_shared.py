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
    """What every process of one loader knows from the start."""
    dataset: Any
    batch_size: int | None       # None: samples one by one, unbatched
    num_workers: int
    prefetch: int                # batches loaded ahead of main (per worker: iterable datasets)
    drop_last: bool
    in_order: bool
    iterable: bool
    collate_fn: Callable | None
    worker_init_fn: Callable | None
    seed: int
    reproducible: bool           # seed the generators before every sample
    torch_seeding: bool          # seed workers exactly as torch's DataLoader does
    memory_cap_bytes: int
    parent_pid: int
    rank: int = 0                # distributed=True: this process's share of each epoch
    world: int = 1
    static_batches: bool = False  # worker w loads batches w, w + W, ... (torch's assignment)

    @property
    def per_batch(self) -> bool:
        """Workers load and collate whole batches (a collate_fn, as torch
        runs it, or batch_size=None) instead of placing samples in rows."""
        return self.collate_fn is not None or self.batch_size is None

    @property
    def claims_batches(self) -> bool:
        """A run's units are batches, not positions."""
        return self.per_batch or self.static_batches

    @property
    def rows_per_batch(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    @property
    def worker_prefetch(self) -> int:
        """Iterable datasets: batches each worker may fill ahead of main."""
        return max(1, -(-self.prefetch // max(self.num_workers, 1)))

    @property
    def publish_window(self) -> int:
        """How many batches past those sent the collator lays out ahead:
        workers load units below main's limit, `prefetch` batches past what
        it has yielded, plus one claim each that waits; two more batches
        of slack let the next be ready as the window moves.  (Iterable
        datasets: per worker, past that worker's batches sent.)"""
        return (self.worker_prefetch if self.iterable else self.prefetch) + 2

    @property
    def table_per_run(self) -> int:
        """Batch table entries per run.  A multiple of the worker count, so
        that the batches of an iterable run's workers (ids j * W + w) never
        share an entry across workers, and large enough for the batches in
        flight (see NOTE [ Runs ])."""
        w = max(self.num_workers, 1)
        return w * max(-(-64 // w), -(-2 * self.publish_window // w), self.worker_prefetch + 3)


class SharedState:
    """Shared memory and rings, made by main before it forks; every child
    inherits them.  Nothing here has a name."""

    def __init__(self, cfg: LoaderConfig):
        self.control = Control(cfg.num_workers)
        self.table = BatchTable(cfg.table_per_run)
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

    def write_order(self, run: int, order: np.ndarray, offsets: np.ndarray | None) -> None:
        """The run's order (and a batch sampler's offsets), for the workers
        and the collator: see SHIPPED in NOTE [ Runs ]."""
        fd = self.order_fds[run % 2]
        parts = [order] if offsets is None else [order, offsets]
        data = memoryview(np.concatenate([np.asarray(p, np.int64) for p in parts])).cast("B")
        os.ftruncate(fd, len(data))
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)

    def read_order(self, run: int, kept: int, nbatches: int, with_offsets: bool):
        """(order, offsets or None) as write_order wrote them."""
        n = kept + (nbatches + 1 if with_offsets else 0)
        out = np.empty(n, np.int64)
        buf = memoryview(out).cast("B")
        done = 0
        while done < len(buf):
            got = os.preadv(self.order_fds[run % 2], [buf[done:]], done)
            if got == 0:
                raise RuntimeError(f"the run's order file holds {done} bytes, not {len(buf)}")
            done += got
        return (out[:kept], out[kept:]) if with_offsets else (out, None)

    def close(self) -> None:
        for q in self.rings:
            q.close()
        for fd in self.order_fds:
            os.close(fd)
        self.rings, self.order_fds = [], []
