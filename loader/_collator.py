"""The collator process: places samples into batch slabs and tells main.
See NOTE [ ShmLoader processes and shutdown ] in _protocol.py."""

from __future__ import annotations

import os
import time
import traceback

import shmq
from loader import _protocol as P
from loader._collate import CollateError, Layout, OutputPlan
from loader._slabs import SlabAllocator
from loader._worker import die_with_parent, exit_if_orphaned


class _Batch:
    """A batch being filled: its slab, layout and how many rows are in."""

    __slots__ = ("index", "lease", "generation", "offset", "layout", "views", "rows", "filled",
                 "samples")

    def __init__(self, index, rows):
        self.index, self.rows, self.filled = index, rows, 0
        self.lease = self.layout = self.views = None
        self.samples = [None] * rows  # collate_fn mode: the samples, by row


class Collator:
    def __init__(self, to_collator, to_main, arena, released, batch_size, drop_last, in_order,
                 collate_fn, num_workers, prefetch, parent_pid):
        self.inbox, self.to_main = to_collator, to_main
        self.arena = arena
        # Slabs in flight: prefetched, open, held by main's loop, one spare.
        self.slabs = SlabAllocator(arena, released, prefetch + 3)
        self.batch_size, self.drop_last, self.in_order = batch_size, drop_last, in_order
        self.collate_fn, self.num_workers, self.parent_pid = collate_fn, num_workers, parent_pid
        self.epoch, self.n, self.open = None, None, {}

    # --- epoch bookkeeping ---------------------------------------------------

    def start_epoch(self, epoch, n_positions):
        self.drop_open_batches()
        self.epoch, self.n = epoch, n_positions
        self.open: dict[int, _Batch] = {}
        self.arrived = self.sent = self.done_workers = 0

    def drop_open_batches(self):
        for b in self.open.values():
            if b.lease is not None:
                self.slabs.release(b.lease)
        self.open = {}

    def rows_of(self, index):
        if self.n is None:  # iterable dataset: every batch full until the end
            return self.batch_size
        return min(self.batch_size, self.n - index * self.batch_size)

    # --- slabs ---------------------------------------------------------------

    def slab(self, nbytes):
        """(lease, generation, offset), waiting while main holds them all."""
        told = False
        while True:
            got = self.slabs.allocate(nbytes)
            if got is not None:
                return got
            if not told:
                self.to_main.put((P.MEMORY_WAIT, self.slabs.held_bytes, self.arena.nbytes,
                                  len(self.slabs.live)))
                told = True
            exit_if_orphaned(self.parent_pid)
            time.sleep(0.001)

    # --- samples ---------------------------------------------------------------

    def place(self, pos, sample):
        if self.in_order and pos >= 0:
            index, row = divmod(pos, self.batch_size)
        else:  # first-ready: the k-th arrival goes to row k % B of batch k // B
            index, row = divmod(self.arrived, self.batch_size)
        self.arrived += 1
        b = self.open.get(index)
        if b is None:
            b = self.open[index] = _Batch(index, self.rows_of(index))
        if self.collate_fn is not None:
            b.samples[row] = sample
        else:
            if b.layout is None:
                b.layout = Layout(sample, b.rows)
                b.lease, b.generation, b.offset = self.slab(b.layout.nbytes)
                slab = self.arena[b.offset:b.offset + b.layout.nbytes]
                b.views = b.layout.views(slab)
            b.layout.write(b.views, row, sample, f"sample at position {pos}")
        b.filled += 1
        if b.filled == b.rows:
            self.finish(b)

    def finish(self, b):
        del self.open[b.index]
        if self.collate_fn is not None:
            plan = OutputPlan(self.collate_fn(b.samples[:b.filled]))
            nbytes = plan.nbytes
            lease, gen, offset = self.slab(nbytes)
            spec = plan.write(self.arena[offset:offset + nbytes])
        else:
            spec = b.layout.spec(b.views, b.filled)
            lease, gen, offset, nbytes = b.lease, b.generation, b.offset, b.layout.nbytes
        self.to_main.put((P.BATCH, self.epoch, b.index, lease, gen, offset, nbytes, spec))
        self.sent += 1

    def end_epoch(self):
        """Every worker is done: send what is left of a partial batch.  Only
        where rows fill in arrival order (first-ready, iterable datasets) is
        a partial batch a prefix of rows; in order, a batch is partial only
        when a sample failed, and main has been told so already."""
        arrival_order = not self.in_order or self.n is None
        for b in sorted(self.open.values(), key=lambda b: b.index):
            if b.filled and arrival_order and not self.drop_last:
                self.finish(b)
            elif b.lease is not None:
                self.slabs.release(b.lease)
        self.open = {}
        self.to_main.put((P.END, self.epoch, self.sent))

    # --- loop ------------------------------------------------------------------

    def handle(self, msg):
        kind = msg[0]
        if kind == P.EPOCH_START:
            self.start_epoch(msg[1], msg[2])
        elif msg[1] != self.epoch:
            return  # a straggler from an epoch main abandoned
        elif kind == P.SAMPLE:
            try:
                self.place(msg[2], msg[3])
            except Exception as e:
                where = f"collating the sample at position {msg[2]}"
                self.to_main.put((P.ERROR, self.epoch, msg[2], -1, -1, os.getpid(),
                                  _describe(e, where)))
        elif kind == P.ERROR:
            self.to_main.put(msg)
        elif kind == P.DONE:
            self.done_workers += 1
            if self.done_workers == self.num_workers:
                self.end_epoch()

    def run(self):
        copy = self.collate_fn is not None  # collate_fn keeps samples past the ring
        while True:
            # While the arena is not warm yet, poll briefly and fault in a
            # chunk whenever nothing arrives: idle time, not batch time.
            wait = 0.002 if self.slabs.warming else P.WAIT_SLICE_S
            try:
                if copy:
                    msg = self.inbox.get(timeout=wait)
                    if msg[0] == P.STOP:
                        return
                    self.handle(msg)
                else:
                    with self.inbox.get_view(timeout=wait) as msg:
                        if msg[0] == P.STOP:
                            return
                        self.handle(msg)
            except shmq.Empty:
                exit_if_orphaned(self.parent_pid)
                self.slabs.warm_up()
            except shmq.PeerLost:
                pass  # a worker died mid-write; main sees its exit code and reports it


def _describe(exc, where):
    text = "".join(traceback.format_exception(exc))
    if isinstance(exc, CollateError):
        return f"{text}\n(while {where})"
    return text


def collator_main(to_collator, to_main, arena, released, batch_size, drop_last, in_order,
                  collate_fn, num_workers, prefetch, parent_pid):
    die_with_parent(parent_pid)
    Collator(to_collator, to_main, arena, released, batch_size, drop_last, in_order, collate_fn,
             num_workers, prefetch, parent_pid).run()
    to_collator.close()
    to_main.close()
    os._exit(0)
