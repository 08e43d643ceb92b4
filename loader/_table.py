"""The batch table: slabs the collator has laid out ahead, which workers
fill row by row themselves.  See NOTE [ Direct row writes ] below.

NOTE [ Direct row writes ]
==========================

Without this table every sample is copied twice: worker → to_collator ring
→ its row of the slab.  With it, a worker writes its sample straight into
its row, and the collator handles one message per batch instead of one per
sample.

  collator                         table[b % K]                      worker
  ────────                         ────────────                      ──────
  allocate slab for batch b        OFFSET, ROWS, DIGEST,
  with the layout of recent        FILLED = 0
  batches, then publish ──────────► STAMP = (run, b)  ◄─── read STAMP: is it (run, b)?
                                                              and does the sample's layout
                                                              digest equal DIGEST?
                                                              yes: write the row into the slab,
                                   FILLED += 1 ◄───────────── then count it (atomic add)
  finish batch b  ◄──────── FILLED (run, b) ─────────────── the one that counts the last row
                                                              no: send the sample through the
                                                              ring (the collator places it and
                                                              counts it the same way)

Why it is safe:
- STAMP is stored last, and read first, with a sequentially consistent
  atomic (shmq.atomic_add), so a worker that sees it sees the entry.
- An entry is retired only when its batch is complete, which needs the
  row of every worker still writing into it, or when its run is over:
  every worker has said DONE for it, and a worker sends DONE only after
  its last write.  So no late write can land in a slab handed out again,
  even when main abandoned the run midway (the collator keeps a run's
  slabs until its DONEs arrive).
- Leaves that are not numbers (strings, None...) travel in a small VALUES
  message sent before the row is counted; the completing worker's FILLED
  message is sent after its count, so the collator sees every VALUES of a
  batch before its FILLED (one ring, ordered by claim).
- The digest is 128 bits of blake2b over the pickled (signature, rows):
  exact where hash() is not.  A sample that does not match, and a batch
  that is not published, take the ring as before: correctness never
  depends on the guess.
"""

from __future__ import annotations

import numpy as np

import shmq
from loader._collate import CollateError, Layout, LayoutCache, signature_and_leaves

STAMP, OFFSET, ROWS, DIGEST0, DIGEST1, FILLED = range(6)
WORDS = 8  # per entry: one 64-byte line, so entries never share a cache line


def stamp(run: int, batch: int) -> int:
    return (run << 32) | (batch + 1)  # never 0: 0 is a free entry


class BatchTable:
    """`per_run` entries for each run parity (two runs can be live: see
    Passes in _protocol.py), in a shared int64 array made before the fork."""

    def __init__(self, per_run: int):
        self.per_run = per_run
        self.words = shmq.shared_array(2 * per_run * WORDS, np.int64)

    def entry(self, run: int, batch: int) -> int:
        return (run % 2) * self.per_run + batch % self.per_run

    def _at(self, run: int, batch: int, field: int) -> int:
        return self.entry(run, batch) * WORDS + field

    # --- collator side ---------------------------------------------------

    def publish(self, run, batch, offset, layout: Layout, filled=0) -> None:
        w, base = self.words, self._at(run, batch, 0)
        w[base + OFFSET] = offset
        w[base + ROWS] = layout.rows
        w[base + DIGEST0], w[base + DIGEST1] = layout.digest
        w[base + FILLED] = filled
        shmq.atomic_add(w, base + STAMP, stamp(run, batch) - int(w[base + STAMP]))  # stored last

    def retire(self, run: int, batch: int) -> None:
        i = self._at(run, batch, STAMP)
        shmq.atomic_add(self.words, i, -int(self.words[i]))

    def count(self, run: int, batch: int) -> int:
        """Count one more filled row; the new total."""
        return shmq.atomic_add(self.words, self._at(run, batch, FILLED), 1) + 1

    def filled(self, run: int, batch: int) -> int:
        return int(shmq.atomic_add(self.words, self._at(run, batch, FILLED), 0))


class RowWriter:
    """Worker side: write a sample into its published row, if it can."""

    def __init__(self, table: BatchTable, arena: np.ndarray):
        self.table, self.arena = table, arena
        self.layouts = LayoutCache()

    def try_write(self, run: int, batch: int, row: int, sample):
        """Write the sample into its row if batch is published with the
        sample's layout: returns (rows of the batch, non-numeric leaves).
        None if it was not written: then it must take the ring."""
        w, base = self.table.words, self.table._at(run, batch, 0)
        if shmq.atomic_add(w, base + STAMP, 0) != stamp(run, batch):
            return None
        _, offset, rows, d0, d1 = w[base:base + FILLED].tolist()  # read after the stamp
        try:
            sig, leaves = signature_and_leaves(sample)
        except CollateError:
            return None  # the collator reports it
        layout = self.layouts.get(sig, rows)
        if layout.digest != (d0, d1):
            return None
        return rows, layout.write_row(self.arena[offset:offset + layout.nbytes], row, leaves)
