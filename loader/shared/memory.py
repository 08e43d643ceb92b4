"""What the loader's processes share: the shared memory main creates before
it forks (what every process knows from the start is the loader's spec,
shared/spec.py)."""

from __future__ import annotations

import mmap
import os
import pickle

import numpy as np

import shmq
from loader.shared import messages as _protocol
from loader.shared import passable as passable_memory
from loader.shared.control import Control
from loader.shared.passable import shared_array
from loader.shared.spec import LoaderSpec
from loader._native import arena_array
from loader.batcher.slabs import MAX_LEASES, Slab
from loader.shared.layout import ArrayLeaf, Spec, Value, with_values
from loader.shared.spill import Spilled, SpillHeap, SpillWriter
from loader.main.stats import start_idle
from loader.shared.table import BatchTable
from loader.main.threads import ThreadRing

# Ring capacities.  Samples never travel through a ring (NOTE [ Direct row
# writes ]), and a message over SPILL_BYTES (64 KiB) travels in the spill
# heap (NOTE [ Spilled messages ]): the rings carry small records only.
# Every page of a ring is in use once its positions have gone round it
# (docs/benchmarks.md, "W12's memory"), so a ring is sized for a burst of
# small records, not for its largest possible message.
TO_BATCHER_BYTES = 1 << 20
TO_MAIN_BYTES = 1 << 20


class SharedState:
    """Shared memory and rings, made by main before it forks; every child
    inherits them (or, started clean, opens them by descriptor: NOTE
    [ Starting clean ] in shared/passable.py).  Nothing here has a name."""

    def __init__(self, spec: LoaderSpec):
        passable = spec.passable
        self.control = Control(spec.num_workers, passable)
        self.table = BatchTable(spec.table_per_run, passable)
        # The batch memory, in a memfd: main maps it again to view slabs, and
        # again after moving kept batches out of it (NOTE [ Kept batch memory ]).
        self.arena_fd = os.memfd_create("shmloader-arena", os.MFD_CLOEXEC)
        self.warm_fd = -1  # the batcher's, to allocate pages ahead (NOTE [ Warming the arena ])
        self.spill = None
        self.order_fds: list[int] = []
        self.snapshot_fds: list[int] = []
        self.rings: list[shmq.Queue] = []
        try:  # (whatever fails, close() closes what was made: at a low `ulimit -n` any may)
            os.ftruncate(self.arena_fd, spec.memory_cap_bytes)
            self.arena = arena_array(self.arena_fd, spec.memory_cap_bytes)
            if passable:
                passable_memory.register(self.arena, os.dup(self.arena_fd))
            self.warm_fd = os.dup(self.arena_fd)
            self.released = shared_array(MAX_LEASES, np.int64, passable)
            workers = max(spec.num_workers, spec.max_workers, 1)  # ids of workers added later too
            self.hazards = shared_array(workers, np.int64, passable)
            # wait clocks, one per worker id and the batcher's last (NOTE [ Wait clocks ]
            # in main/stats.py): for stats() and num_workers="auto"
            self.waited = shared_array(workers + 1, np.int64, passable)
            start_idle(self.waited)
            # Process mode: a spill region per worker id, and the batcher's last.
            self.spill = None if spec.threads else SpillHeap(workers + 1, passable=passable)
            self.batcher_region = workers
            # Per run parity (NOTE [ Runs ]): the order shipped to the
            # workers, and the dataset's snapshot of the epoch.
            for _ in range(2):
                self.order_fds.append(os.memfd_create("shmloader-order", os.MFD_CLOEXEC))
                self.snapshot_fds.append(os.memfd_create("shmloader-snapshot", os.MFD_CLOEXEC))
            if spec.threads:  # in one process: queues with the rings' interface
                self.rings += [ThreadRing(), ThreadRing()]
            else:
                self.rings.append(shmq.Queue(TO_BATCHER_BYTES, multi_producer=True,
                                             anonymous=True, keep_fd=passable))
                self.rings.append(shmq.Queue(TO_MAIN_BYTES, anonymous=True, keep_fd=passable))
        except BaseException:
            self.close()
            raise
        self.to_batcher, self.to_main = self.rings

    def plain_fds(self) -> list[int]:
        """The descriptors this state holds as numbers (not inside an
        array or a ring), which a spawned child needs at the same numbers."""
        fds = [self.warm_fd, *self.order_fds, *self.snapshot_fds]
        if self.spill is not None:
            fds.append(self.spill.fd)
        return [fd for fd in fds if fd >= 0]

    def take_arena_fd(self) -> int:
        """The arena's memfd, for main's LeaseBook, which closes it."""
        fd, self.arena_fd = self.arena_fd, -1
        return fd

    def spill_writer(self, region: int) -> SpillWriter | None:
        """The sending side of a process's spill region (None for threads)."""
        return None if self.spill is None else SpillWriter(self.spill, region)

    def receive(self, msg):
        """A message taken from a ring, with a Spilled record resolved, a
        BatchReady rebuilt from its wire form (batch_ready_wire), and a
        batch's rows' values sent by reference opened (NOTE [ Spilled
        messages ])."""
        if self.spill is None:
            return msg
        if type(msg) is Spilled:  # (few are: the others go on without a call)
            msg = self.spill.receive(msg)
        if type(msg) is tuple:
            msg = batch_ready_from_wire(msg)
        if type(msg) is _protocol.BatchReady and msg.spec.rows_values is not None:
            spec = msg.spec
            rows = [None] * len(spec.rows_values)
            try:
                for r, v in enumerate(spec.rows_values):
                    rows[r] = self.spill.values(v)
            finally:  # interrupted: the rest are freed unopened
                for r, v in enumerate(spec.rows_values):
                    if rows[r] is None:
                        self.spill.free_values(v)
            msg = msg._replace(spec=with_values(spec, rows), values_bytes=sum(
                v.nbytes for v in spec.rows_values if type(v) is not list))
        return msg

    def free_values(self, values) -> None:
        """A row's values that will not be sent (its batch is dropped)."""
        if self.spill is not None:
            self.spill.free_values(values)

    def write_order(self, run: int, order: np.ndarray) -> None:
        """The run's order written out, for the workers (NOTE [ Runs ])."""
        words = np.ascontiguousarray(order, np.int64)  # (a copy only if it is not one already)
        fd = self.order_fds[run % 2]
        os.ftruncate(fd, words.nbytes)
        _write(fd, memoryview(words).cast("B"), 0)

    def read_order(self, run: int, kept: int, nbatches: int, with_offsets: bool):
        """(order, offsets or None) as write_order wrote them: views of the
        file mapped read-only, so every process shares its pages (a
        torch.Generator's order of 2e9 indices is 16 GB once, not once per
        worker).  The file is written again only for run + 2, which starts
        once every process is done with this run (NOTE [ Runs ])."""
        n = kept + (nbatches + 1 if with_offsets else 0)
        out = _map_words(self.order_fds[run % 2], n, "order")
        return (out[:kept], out[kept:]) if with_offsets else (out, None)

    def order_fd(self, run: int) -> int:
        """The run's order file, for a streamed sampler's feed (NOTE
        [ Streamed samplers ] in order/feed.py)."""
        return self.order_fds[run % 2]

    def read_words(self, run: int) -> np.ndarray:
        """All the int64 words of the run's order file (a resumed run's
        Remaining: a few numbers), as a private copy."""
        fd = self.order_fds[run % 2]
        return _map_words(fd, os.fstat(fd).st_size // 8, "order").copy()

    def write_snapshot(self, run: int, snapshot) -> None:
        """What the run carries for the dataset, a RunDataset (see SNAPSHOT
        in NOTE [ Runs ])."""
        _write_pickle(self.snapshot_fds[run % 2], snapshot)

    def read_snapshot(self, run: int):
        return _read_pickle(self.snapshot_fds[run % 2], "snapshot")

    def close(self) -> None:
        if self.arena_fd >= 0:
            os.close(self.arena_fd)  # the mappings keep the memory while they are used
            self.arena_fd = -1
        if self.warm_fd >= 0:
            os.close(self.warm_fd)
            self.warm_fd = -1
        for q in self.rings:
            q.close()
        for fd in self.order_fds + self.snapshot_fds:
            os.close(fd)
        if self.spill is not None:
            self.spill.close()
        self.rings, self.order_fds, self.snapshot_fds = [], [], []


# A BatchReady as the batcher puts it into the to_main ring: plain tuples
# and ints, no class.  Unpickling a class costs an import lookup and a call
# of its Python __new__, for each of a BatchReady's named tuples, on every
# batch: the wire form unpickles an order of magnitude faster (docs/
# benchmarks.md, "W12: main's per-batch path").
# Every message is whole in itself (no spec sent once and referred to), so
# a message lost to a Ctrl-C leaves nothing behind it inconsistent.
# No other message travels as a plain tuple: receive() tells them apart so.


def batch_ready_wire(msg: _protocol.BatchReady) -> tuple:
    s, spec = msg.slab, msg.spec
    leaves = tuple(tuple(leaf) if type(leaf) is ArrayLeaf else (leaf.value, leaf.batched)
                   for leaf in spec.leaves)
    return (msg.run, msg.batch, s.lease, s.generation, s.offset, s.nbytes, spec.structure,
            leaves, spec.rows_values, msg.tags, msg.rows, msg.values_bytes)


def batch_ready_from_wire(w: tuple) -> _protocol.BatchReady:
    """batch_ready_wire's message again (named tuples built by tuple.__new__:
    no Python frame each)."""
    new = tuple.__new__
    leaves = tuple([new(ArrayLeaf, leaf) if len(leaf) == 4 else new(Value, leaf) for leaf in w[7]])
    spec = new(Spec, (w[6], leaves, w[8]))
    return new(_protocol.BatchReady, (w[0], w[1], new(Slab, w[2:6]), spec, w[9], w[10], w[11]))


def _write_pickle(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    _write(fd, memoryview(len(data).to_bytes(8, "little") + data))


def _read_pickle(fd: int, what: str):
    head = bytearray(8)
    _read(fd, memoryview(head), what)
    data = bytearray(int.from_bytes(head, "little"))
    _read(fd, memoryview(data), what, offset=8)
    return pickle.loads(data)


def _write(fd: int, data: memoryview, at: int | None = None) -> None:
    """data into the file at `at`; at None: the file is data alone."""
    if at is None:
        os.ftruncate(fd, len(data))
        at = 0
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], at + done)


def _map_words(fd: int, n: int, what: str) -> np.ndarray:
    """The first n int64 words of the file, mapped read-only and shared."""
    size = os.fstat(fd).st_size
    if size < 8 * n:
        raise RuntimeError(f"the run's {what} file holds {size} bytes, not {8 * n}")
    if n == 0:
        return np.zeros(0, np.int64)
    return np.frombuffer(mmap.mmap(fd, 8 * n, mmap.MAP_SHARED, mmap.PROT_READ), np.int64)


def _read(fd: int, buf: memoryview, what: str, offset: int = 0) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise RuntimeError(f"the run's {what} file holds {offset + done} bytes, "
                               f"not {offset + len(buf)}")
        done += got
