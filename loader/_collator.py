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
    LayoutCache,
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

    __slots__ = ("aside", "counted", "filled", "generation", "index", "layout", "lease", "offset",
                 "provisional", "published", "rows", "samples", "seen", "views")

    def __init__(self, index, rows):
        self.index, self.rows, self.filled = index, rows, 0
        self.seen = 0           # rows this process has had a message for (SAMPLE or VALUES)
        self.counted = False    # every row is counted (in the table, or in `filled`)
        self.lease = self.layout = self.views = None
        self.published = self.provisional = False
        self.aside = {}  # row -> an owned sample that does not fit a provisional layout
        self.samples = [None] * rows  # collate_fn mode: the samples, by row


class _Pass:
    """One run over the data (see Passes in _protocol.py).  It lives until
    every worker has said DONE for it, even after main abandoned it: until
    then a worker may still write into its slabs."""

    def __init__(self, run, n, batch_size):
        self.run, self.n = run, n
        self.nbatches = None if n is None else -(-n // batch_size)
        self.open: dict[int, _Batch] = {}
        self.lo, self.finished = 0, set()  # batches below lo, and those in `finished`, are sent
        self.sent = self.done_workers = self.samples = self.via_ring = 0
        self.ended = False


class Collator:
    def __init__(self, to_collator, to_main, ctl, arena, released, table, batch_size, drop_last,
                 in_order, collate_fn, num_workers, prefetch, parent_pid):
        self.inbox, self.to_main, self.ctl = to_collator, to_main, ctl
        self.arena, self.table = arena, table
        # Slabs the warm-up should cover: prefetched, open, held by main, one spare.
        self.slabs = SlabAllocator(arena, released, prefetch + 3)
        self.batch_size, self.drop_last, self.in_order = batch_size, drop_last, in_order
        self.collate_fn, self.num_workers, self.parent_pid = collate_fn, num_workers, parent_pid
        self.passes: dict[int, _Pass] = {}
        self.taken: set[int] = set()  # batch table entries a batch is published in
        # Batches are published up to this far past the count sent (not past
        # `lo`: first-ready sends later batches while a worker descheduled
        # mid-row still holds batch `lo`).  The table has many more entries
        # per run, so batch b takes the ring only if batch b - per_run is
        # still open.
        self.window = P.publish_window(prefetch)
        self.guess = None                    # signature of the latest batch's layout
        self.layouts = LayoutCache()

    def rows_of(self, p, index):
        if p.n is None:  # iterable dataset: every batch full until the end
            return self.batch_size
        return min(self.batch_size, p.n - index * self.batch_size)

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

    def lay_out(self, b, sig, slab_got=None):
        b.layout = self.layouts.get(sig, b.rows)
        b.lease, b.generation, b.offset = slab_got or self.slab(b.layout.nbytes)
        b.views = b.layout.views(self.arena[b.offset:b.offset + b.layout.nbytes])

    def try_publish(self, p, b):
        """Give b its table entry if that is free and b is in the window."""
        entry = self.table.entry(p.run, b.index)
        if (self.collate_fn is None and not b.published and entry not in self.taken
                and b.index < p.sent + self.window):
            self.table.publish(p.run, b.index, b.offset, b.layout, b.filled)
            self.taken.add(entry)
            b.published = True

    def unpublish(self, p, b):
        self.table.retire(p.run, b.index)
        self.taken.remove(self.table.entry(p.run, b.index))
        b.published = False

    def publish_ahead(self, p):
        """Lay out the next batches with the latest layout, so workers can
        write their rows directly (NOTE [ Direct row writes ])."""
        if self.collate_fn is not None or self.guess is None or p.ended:
            return
        for index in range(p.lo, p.sent + self.window):
            if p.nbatches is not None and index >= p.nbatches:
                return
            if index in p.open:
                self.try_publish(p, p.open[index])
                continue
            if index in p.finished or self.table.entry(p.run, index) in self.taken:
                continue
            b = _Batch(index, self.rows_of(p, index))
            got = self.slabs.allocate(self.layouts.get(self.guess, b.rows).nbytes)
            if got is None:
                return  # memory is short: the ring path waits for it instead
            self.lay_out(b, self.guess, got)
            b.provisional = True
            p.open[index] = b
            self.try_publish(p, b)

    def filled(self, p, b):
        return self.table.filled(p.run, b.index) if b.published else b.filled

    # --- samples -------------------------------------------------------------

    def place(self, p, pos, index, row, sample):
        """A sample that came through the ring, for row `row` of batch `index`."""
        p.via_ring += 1
        b = p.open.get(index)
        if b is None:
            b = p.open[index] = _Batch(index, self.rows_of(p, index))
            if self.collate_fn is None:
                sig = signature(sample)
                self.lay_out(b, sig)
                self.guess = sig
                self.try_publish(p, b)
        if self.collate_fn is not None:
            b.samples[row] = sample
        elif b.provisional and signature(sample) != b.layout.signature:
            b.aside[row] = _owned(sample)
        else:
            b.layout.write(b.views, row, sample, f"sample at position {pos}")
            b.provisional = False
        b.seen += 1
        if b.published:
            b.counted = self.table.count(p.run, index) == b.rows
        else:
            b.filled += 1
            b.counted = b.filled == b.rows
        self.finish_if_complete(p, b)

    def values(self, p, index, row, values):
        b = p.open[index]
        for leaf, value in zip(b.layout.value_leaves, values):
            b.views[leaf][row] = value
        b.seen += 1
        self.finish_if_complete(p, b)

    def all_counted(self, p, index):
        """A worker counted the last row of a batch (its FILLED message)."""
        b = p.open[index]
        b.counted = True
        self.finish_if_complete(p, b)

    def finish_if_complete(self, p, b):
        """Complete: every row counted, and, where rows carry non-numeric
        leaves, every VALUES message seen.  A worker sends VALUES before it
        counts its row, but a ring sample can complete the count while a
        VALUES message is still behind it in the ring."""
        if b.counted and (self.collate_fn is not None or not b.layout.value_leaves
                          or b.seen == b.rows):
            self.finish(p, b, b.rows)

    def settle_aside(self, b, rows):
        """Rows that did not fit the provisional layout: if no row did, the
        batch takes the layout of its own first sample; otherwise they are
        written as the default collate always does (or refused)."""
        if len(b.aside) == rows:
            old = b.lease
            self.lay_out(b, signature(b.aside[min(b.aside)]))
            self.slabs.release(old)
        for row, sample in sorted(b.aside.items()):
            b.layout.write(b.views, row, sample, f"sample in row {row} of batch {b.index}")
        b.aside = {}

    def finish(self, p, b, rows):
        del p.open[b.index]
        if b.published:
            self.unpublish(p, b)
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
        self.to_main.put((P.BATCH, p.run, b.index, lease, gen, offset, nbytes, spec))
        p.sent += 1
        p.samples += rows
        p.finished.add(b.index)
        while p.lo in p.finished:
            p.finished.remove(p.lo)
            p.lo += 1
        self.publish_ahead(p)

    def end_pass(self, p):
        """Every worker is done: send what is left of a partial batch.  Only
        where rows fill in arrival order (first-ready, iterable datasets) is
        a partial batch a prefix of rows; in order, a batch is partial only
        when a sample failed (main has been told) or main abandoned the run."""
        p.ended = True
        arrival_order = not self.in_order or p.n is None
        for b in sorted(p.open.values(), key=lambda b: b.index):
            rows = self.filled(p, b)
            if rows and arrival_order and not self.drop_last:
                self.finish(p, b, rows)
                continue
            if b.published:
                self.unpublish(p, b)
            if b.lease is not None:
                self.slabs.release(b.lease)
        p.open = {}
        del self.passes[p.run]
        self.to_main.put((P.END, p.run, p.sent, p.samples, p.via_ring))

    # --- loop ------------------------------------------------------------------

    def handle(self, msg):
        kind = msg[0]
        if kind == P.EPOCH_START:
            p = self.passes[msg[1]] = _Pass(msg[1], msg[2], self.batch_size)
            self.publish_ahead(p)
            self.ctl[P.slot(p.run, P.READY)] = p.run  # workers may start
            return
        p = self.passes[msg[1]]  # a run's messages all come before its workers' DONE
        if kind == P.DONE:
            p.done_workers += 1
            if p.done_workers == self.num_workers:
                self.end_pass(p)
        elif kind == P.ERROR:
            self.to_main.put(msg)
        else:
            try:
                if kind == P.SAMPLE:
                    _, _, pos, index, row, sample = msg
                    self.place(p, pos, index, row, sample)
                elif kind == P.VALUES:
                    self.values(p, *msg[2:])
                elif kind == P.FILLED:
                    self.all_counted(p, msg[2])
            except Exception as e:
                pos = msg[2] if kind == P.SAMPLE else -1
                where = (f"collating the sample at position {pos}" if kind == P.SAMPLE
                         else f"collating batch {msg[2]}")
                self.to_main.put((P.ERROR, p.run, pos, -1, -1, os.getpid(), _describe(e, where)))

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


def collator_main(to_collator, to_main, ctl, arena, released, table, batch_size, drop_last,
                  in_order, collate_fn, num_workers, prefetch, parent_pid):
    die_with_parent(parent_pid)
    Collator(to_collator, to_main, ctl, arena, released, table, batch_size, drop_last, in_order,
             collate_fn, num_workers, prefetch, parent_pid).run()
    to_collator.close()
    to_main.close()
    os._exit(0)
