"""The collator process: places samples into batch slabs and tells main.
See NOTE [ ShmLoader processes and shutdown ] in _protocol.py."""

from __future__ import annotations

import os
import time
import traceback

import numpy as np

import shmq
from loader import _protocol as P
from loader._collate import (
    CollateError,
    Layout,
    OutputPlan,
    flatten,
    signature,
    unflatten,
)
from loader._slabs import SlabAllocator
from loader._worker import die_with_parent, exit_if_orphaned


class _Batch:
    """A batch being filled: its slab, its layout and who fills its rows.

    A batch is *published* while it owns an entry of the batch table
    (workers then write rows themselves and count them there); otherwise
    only this process fills it, counting in `filled`.  A layout taken from
    earlier batches is *provisional* until a sample of this batch matches
    it; samples that do not are set `aside` until the batch is complete."""

    __slots__ = ("index", "rows", "filled", "seen", "counted", "lease", "generation", "offset",
                 "layout", "views", "samples", "published", "provisional", "aside")

    def __init__(self, index, rows):
        self.index, self.rows, self.filled = index, rows, 0
        self.seen = 0           # rows this process has had a message for (SAMPLE or VALUES)
        self.counted = False    # every row is counted (in the table, or in `filled`)
        self.lease = self.layout = self.views = None
        self.published = self.provisional = False
        self.aside = {}  # row -> an owned sample that does not fit a provisional layout
        self.samples = [None] * rows  # collate_fn mode: the samples, by row


class Collator:
    def __init__(self, to_collator, to_main, arena, released, table, batch_size, drop_last,
                 in_order, collate_fn, num_workers, prefetch, parent_pid):
        self.inbox, self.to_main = to_collator, to_main
        self.arena, self.table = arena, table
        # Slabs in flight: published ahead, held by main's loop, one spare.
        self.slabs = SlabAllocator(arena, released, table.entries + prefetch + 1)
        self.batch_size, self.drop_last, self.in_order = batch_size, drop_last, in_order
        self.collate_fn, self.num_workers, self.parent_pid = collate_fn, num_workers, parent_pid
        self.epoch, self.n, self.open = None, None, {}
        self.done_workers = num_workers  # no epoch in flight
        self.owner = [None] * table.entries  # batch index published in each table entry
        self.guess = None                    # signature of the latest batch's layout
        self.layouts = {}                    # (signature, rows) -> (Layout, digest)
        # abandoned epochs: epoch -> [workers yet to say DONE, leases held back]
        self.quarantine: dict[int, list] = {}

    # --- epoch bookkeeping ---------------------------------------------------

    def start_epoch(self, epoch, n_positions):
        self.abandon_open_batches()
        self.epoch, self.n = epoch, n_positions
        self.nbatches = None if n_positions is None else -(-n_positions // self.batch_size)
        self.open: dict[int, _Batch] = {}
        self.lo, self.finished = 0, set()  # batches below lo, and those in `finished`, are sent
        self.sent = self.done_workers = self.samples = self.via_ring = 0
        self.ended = False
        self.publish_ahead()

    def abandon_open_batches(self):
        """Main moved on mid-epoch.  Workers may still be writing rows of
        published batches: their slabs wait for every worker's DONE (see
        NOTE [ Direct row writes ] in _table.py)."""
        held = []
        for b in self.open.values():
            if b.published:
                self.unpublish(b)
            if b.lease is not None:
                held.append(b.lease)
        self.open = {}
        waiting = self.num_workers - self.done_workers
        if held and waiting > 0:
            self.quarantine[self.epoch] = [waiting, held]
        else:
            for lease in held:
                self.slabs.release(lease)

    def worker_done(self, epoch):
        if epoch == self.epoch:
            self.done_workers += 1
            if self.done_workers == self.num_workers:
                self.end_epoch()
        elif epoch in self.quarantine:
            held = self.quarantine[epoch]
            held[0] -= 1
            if held[0] == 0:
                for lease in self.quarantine.pop(epoch)[1]:
                    self.slabs.release(lease)

    def rows_of(self, index):
        if self.n is None:  # iterable dataset: every batch full until the end
            return self.batch_size
        return min(self.batch_size, self.n - index * self.batch_size)

    # --- slabs and the batch table -----------------------------------------------

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

    def layout(self, sig, rows):
        key = (sig, rows)
        found = self.layouts.get(key)
        if found is None:
            layout = Layout(sig, rows)
            found = self.layouts[key] = (layout, layout.digest())
            if len(self.layouts) > 64:
                del self.layouts[next(iter(self.layouts))]
        return found

    def lay_out(self, b, sig, slab_got=None):
        b.layout = self.layout(sig, b.rows)[0]
        b.lease, b.generation, b.offset = slab_got or self.slab(b.layout.nbytes)
        b.views = b.layout.views(self.arena[b.offset:b.offset + b.layout.nbytes])

    def try_publish(self, b):
        """Give b a table entry if its own is free and b is in the window."""
        entry = b.index % self.table.entries
        if (self.collate_fn is None and not b.published and self.owner[entry] is None
                and b.index < self.lo + self.table.entries):
            self.table.publish(self.epoch, b.index, b.offset, b.layout,
                               self.layout(b.layout.signature, b.rows)[1], b.filled)
            self.owner[entry] = b.index
            b.published = True

    def unpublish(self, b):
        self.table.retire(b.index)
        self.owner[b.index % self.table.entries] = None
        b.published = False

    def publish_ahead(self):
        """Lay out the next batches with the latest layout, so workers can
        write their rows directly (NOTE [ Direct row writes ])."""
        if self.collate_fn is not None or self.guess is None or self.ended:
            return
        for index in range(self.lo, self.lo + self.table.entries):
            if self.nbatches is not None and index >= self.nbatches:
                return
            if index in self.open:
                self.try_publish(self.open[index])
                continue
            if index in self.finished:
                continue
            if self.owner[index % self.table.entries] is not None:
                continue
            b = _Batch(index, self.rows_of(index))
            got = self.slabs.allocate(self.layout(self.guess, b.rows)[0].nbytes)
            if got is None:
                return  # memory is short: the ring path waits for it instead
            self.lay_out(b, self.guess, got)
            b.provisional = True
            self.open[index] = b
            self.try_publish(b)

    def filled(self, b):
        return self.table.filled(b.index) if b.published else b.filled

    # --- samples -------------------------------------------------------------

    def place(self, pos, index, row, sample):
        """A sample that came through the ring, for row `row` of batch `index`."""
        self.via_ring += 1
        b = self.open.get(index)
        if b is None:
            b = self.open[index] = _Batch(index, self.rows_of(index))
            if self.collate_fn is None:
                sig = signature(sample)
                self.lay_out(b, sig)
                self.guess = sig
                self.try_publish(b)
        if self.collate_fn is not None:
            b.samples[row] = sample
        elif b.provisional and signature(sample) != b.layout.signature:
            b.aside[row] = _owned(sample)
        else:
            b.layout.write(b.views, row, sample, f"sample at position {pos}")
            b.provisional = False
        b.seen += 1
        if b.published:
            b.counted = self.table.count(index) == b.rows
        else:
            b.filled += 1
            b.counted = b.filled == b.rows
        self.finish_if_complete(b)

    def values(self, index, row, values):
        b = self.open[index]
        for leaf, value in zip(b.layout.value_leaves, values):
            b.views[leaf][row] = value
        b.seen += 1
        self.finish_if_complete(b)

    def all_counted(self, index):
        """A worker counted the last row of a batch (its FILLED message)."""
        b = self.open[index]
        b.counted = True
        self.finish_if_complete(b)

    def finish_if_complete(self, b):
        """Complete: every row counted, and, where rows carry non-numeric
        leaves, every VALUES message seen.  A worker sends VALUES before it
        counts its row, but a ring sample can complete the count while a
        VALUES message is still behind it in the ring."""
        if b.counted and (self.collate_fn is not None or not b.layout.value_leaves
                          or b.seen == b.rows):
            self.finish(b, b.rows)

    def settle_aside(self, b, rows):
        """Rows that did not fit the provisional layout: if no row did, the
        batch takes the layout of its own first sample; otherwise they are
        written as the default collate always does (or refused)."""
        if len(b.aside) == rows:
            old = b.lease
            first = min(b.aside)
            self.lay_out(b, signature(b.aside[first]))
            self.slabs.release(old)
        for row, sample in sorted(b.aside.items()):
            b.layout.write(b.views, row, sample, f"sample in row {row} of batch {b.index}")
        b.aside = {}

    def finish(self, b, rows):
        del self.open[b.index]
        if b.published:
            self.unpublish(b)
        if self.collate_fn is not None:
            plan = OutputPlan(self.collate_fn(b.samples[:rows]))
            nbytes = plan.nbytes
            lease, gen, offset = self.slab(nbytes)
            spec = plan.write(self.arena[offset:offset + nbytes])
        else:
            try:
                if b.aside:
                    self.settle_aside(b, rows)
            except Exception:
                self.slabs.release(b.lease)
                raise
            self.guess = b.layout.signature
            spec = b.layout.spec(b.views, rows)
            lease, gen, offset, nbytes = b.lease, b.generation, b.offset, b.layout.nbytes
        self.to_main.put((P.BATCH, self.epoch, b.index, lease, gen, offset, nbytes, spec))
        self.sent += 1
        self.samples += rows
        self.finished.add(b.index)
        while self.lo in self.finished:
            self.finished.remove(self.lo)
            self.lo += 1
        self.publish_ahead()

    def end_epoch(self):
        """Every worker is done: send what is left of a partial batch.  Only
        where rows fill in arrival order (first-ready, iterable datasets) is
        a partial batch a prefix of rows; in order, a batch is partial only
        when a sample failed, and main has been told so already."""
        self.ended = True
        arrival_order = not self.in_order or self.n is None
        for b in sorted(self.open.values(), key=lambda b: b.index):
            rows = self.filled(b)
            if rows and arrival_order and not self.drop_last:
                self.finish(b, rows)
                continue
            if b.published:
                self.unpublish(b)
            if b.lease is not None:
                self.slabs.release(b.lease)
        self.open = {}
        self.to_main.put((P.END, self.epoch, self.sent, self.samples, self.via_ring))

    # --- loop ------------------------------------------------------------------

    def handle(self, msg):
        kind = msg[0]
        if kind == P.EPOCH_START:
            self.start_epoch(msg[1], msg[2])
        elif kind == P.DONE:
            self.worker_done(msg[1])
        elif msg[1] != self.epoch:
            return  # a straggler from an epoch main abandoned
        elif kind == P.SAMPLE:
            _, _, pos, index, row, sample = msg
            try:
                self.place(pos, index, row, sample)
            except Exception as e:
                where = f"collating the sample at position {pos}"
                self.to_main.put((P.ERROR, self.epoch, pos, -1, -1, os.getpid(),
                                  _describe(e, where)))
        elif kind == P.VALUES:
            self.values(*msg[2:])
        elif kind == P.FILLED:
            try:
                self.all_counted(msg[2])
            except Exception as e:
                self.to_main.put((P.ERROR, self.epoch, -1, -1, -1, os.getpid(),
                                  _describe(e, f"collating batch {msg[2]}")))
        elif kind == P.ERROR:
            self.to_main.put(msg)

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


def _owned(sample):
    """A copy of a sample whose arrays may view ring memory."""
    leaves: list = []
    structure = flatten(sample, leaves)
    return unflatten(structure, [np.array(x) if isinstance(x, np.ndarray) else x for x in leaves])


def _describe(exc, where):
    text = "".join(traceback.format_exception(exc))
    if isinstance(exc, CollateError):
        return f"{text}\n(while {where})"
    return text


def collator_main(to_collator, to_main, arena, released, table, batch_size, drop_last, in_order,
                  collate_fn, num_workers, prefetch, parent_pid):
    die_with_parent(parent_pid)
    Collator(to_collator, to_main, arena, released, table, batch_size, drop_last, in_order,
             collate_fn, num_workers, prefetch, parent_pid).run()
    to_collator.close()
    to_main.close()
    os._exit(0)
