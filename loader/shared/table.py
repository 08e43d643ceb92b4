"""The batch table: slabs the batcher has laid out, which workers fill row
by row themselves.  See NOTE [ Direct row writes ] below; the workers' side
of it is compiled (RowWriter in native/rowwriter.pxi).

NOTE [ Direct row writes ]
==========================

Every sample is written once, by the worker that loaded it, straight into
its row of its batch's slab.  Samples never travel through a ring, so no
sample size is too large; the batcher only lays out slabs and hears one
message per batch.

  batcher                               table entry of (run, batch)          worker
  ────────                               ───────────────────────────          ──────
  lays out the batch with a layout:      OFFSET ROWS DIGEST TOKEN             STAMP == (run, batch)?
  the latest one (a *provisional*        FILLED = (flags|version, count)      no: send LayoutRequest(sig),
  guess), or one a sample asked for  ──► STAMP = (run, batch)  (stored last)       wait for the entry
  (*confirmed*)                                                               digest == its layout's?
                                                                                yes: hazard = TOKEN,
                                                                                re-read STAMP, FILLED,
                                                                                write the row,
                                         FILLED count += 1 (CAS, same ◄─────── count it (CAS: only if
                                         version)                               the version is the same)
  finish the batch ◄─── Filled ───────────────────────────────────────────── the one that counts the last row

When the digest differs:
- the entry is provisional and no row is counted: the worker sends a
  LayoutRequest with its signature and waits; the batcher lays the batch
  out again with it (a new slab, version + 1, confirmed).  This is what
  happens at the first batch with a new shape (bucketing) and at the first
  batch of all: the first sample's small signature is enough.
- otherwise (confirmed, or a row already counted): the worker sends the
  whole sample as a SampleRow.  The batcher writes it itself, casting when
  that is safe, or promotes the batch's dtypes (np.result_type: an int in a
  float batch, say; version + 1, rows copied over), or refuses the batch
  (CollateError to main, entry REFUSED: every worker drops its row).  Only
  samples of a batch whose dtypes differ take this path.

Why it is safe:
- The batcher changes an entry only between two increments of its SEQ
  word (odd while changing).  A worker reads SEQ, the entry, SEQ again,
  and acts only on a snapshot taken under one even SEQ (a seqlock).
- A version bump is a CAS on FILLED, so after it no count of the old
  version can succeed: a worker whose count fails wrote into a replaced
  slab and starts over.  The replaced slab is retired, not freed: it is
  reused only once no worker's hazard word names its TOKEN (hazard
  pointers: the worker's hazard store and the batcher's CAS are both
  sequentially consistent, so either the worker sees the new version or
  the batcher sees the hazard).  The worker re-reads SEQ after setting
  its hazard, so a change that began before is seen.
- A completed batch needs the row of every worker still writing into it;
  a run's entries are kept until every worker has said Done for it, and a
  worker says Done only after its last write.  So no late write lands in a
  slab handed out again, even when main abandoned the run midway.
- Non-numeric leaves (strings, None, objects) travel in a small
  RowValues message sent before the row is counted; the worker that counts
  the last row sends Filled after its count, so the batcher sees every
  RowValues of a batch before its Filled (one ring, ordered by claim).
"""

from __future__ import annotations

import numpy as np

from shmq import sync
from loader.shared.passable import shared_array

STAMP, OFFSET, ROWS, DIGEST0, DIGEST1, FILLED, TOKEN, SEQ = range(8)
WORDS = 8  # per entry: one 64-byte line, so entries never share a cache line

# FILLED: (flags | version) << 32 | rows counted
COUNT_MASK = 0xFFFFFFFF
VERSION_MASK = (1 << 28) - 1
CONFIRMED = 1 << 28   # flags: the layout came from a sample of this batch
REFUSED = 1 << 29     # the batch cannot be collated: workers drop their rows


def stamp(run: int, batch: int) -> int:
    return (run << 32) | (batch + 1)  # never 0: 0 is a free entry


def version_of(filled: int) -> int:
    return (filled >> 32) & VERSION_MASK


def flags_of(filled: int) -> int:
    return (filled >> 32) & ~VERSION_MASK


def count_of(filled: int) -> int:
    return filled & COUNT_MASK


class BatchTable:
    """`per_run` entries for each run parity (two runs can be live: see
    NOTE [ Runs ] in shared/control.py), in a shared int64 array made before the
    fork.  The batcher changes an entry only inside a window of its SEQ
    word (odd while changing), so workers read consistent snapshots."""

    def __init__(self, per_run: int, passable: bool = False):
        self.per_run = per_run
        # passable: start_method="spawn" (NOTE [ Starting clean ] in shared/passable.py)
        self.words = shared_array(2 * per_run * WORDS, np.int64, passable)

    def entry(self, run: int, batch: int) -> int:
        return (run % 2) * self.per_run + batch % self.per_run

    def base(self, run: int, batch: int) -> int:
        return self.entry(run, batch) * WORDS

    def filled_word(self, run: int, batch: int) -> int:
        return sync.atomic_load(self.words, self.base(run, batch) + FILLED)

    # --- batcher side: every change inside a SEQ window -----------------------

    def _begin(self, base: int) -> None:
        sync.atomic_add(self.words, base + SEQ, 1)  # SYNC POINT: odd; seq_cst (hazards)

    def _end(self, base: int) -> None:
        sync.atomic_add(self.words, base + SEQ, 1)  # even: a new snapshot

    def publish(self, run, batch, offset, token, layout, version, flags, count=0) -> None:
        w, base = self.words, self.base(run, batch)
        self._begin(base)
        w[base + OFFSET] = offset
        w[base + ROWS] = layout.rows
        w[base + DIGEST0], w[base + DIGEST1] = layout.digest
        w[base + TOKEN] = token
        sync.atomic_store(w, base + FILLED, ((flags | version) << 32) | count)
        sync.atomic_store(w, base + STAMP, stamp(run, batch))
        self._end(base)

    def publish_refused(self, run: int, batch: int) -> None:
        """An entry without a slab that says REFUSED: a batch refused
        before it was laid out (too large for the pool).  Workers read the
        flag before anything else and drop their rows."""
        w, base = self.words, self.base(run, batch)
        self._begin(base)
        w[base + OFFSET] = -1
        w[base + ROWS] = 0
        w[base + DIGEST0], w[base + DIGEST1] = 0, 0
        w[base + TOKEN] = 0
        sync.atomic_store(w, base + FILLED, REFUSED << 32)
        sync.atomic_store(w, base + STAMP, stamp(run, batch))
        self._end(base)

    def unpublish(self, run: int, batch: int) -> None:
        base = self.base(run, batch)
        self._begin(base)
        sync.atomic_store(self.words, base + STAMP, 0)
        self._end(base)

    def _cas_filled(self, base: int, change) -> int:
        """FILLED := change(FILLED) by CAS (workers count concurrently);
        returns the value replaced."""
        w, i = self.words, base + FILLED
        while True:
            old = sync.atomic_load(w, i)
            if sync.atomic_cas(w, i, old, change(old)):
                return old

    def replace_if_uncounted(self, run: int, batch: int) -> bool:
        """If no row is counted: bump the version and unpublish (the caller
        publishes the new layout), True.  Else keep the layout and mark it
        CONFIRMED, False."""
        base = self.base(run, batch)
        self._begin(base)

        def change(old):
            if count_of(old):
                return old | (CONFIRMED << 32)
            return (CONFIRMED | ((version_of(old) + 1) & VERSION_MASK)) << 32

        replaced = not count_of(self._cas_filled(base, change))
        if replaced:
            sync.atomic_store(self.words, base + STAMP, 0)
        self._end(base)
        return replaced

    def freeze(self, run: int, batch: int) -> int:
        """Bump the version keeping the count and unpublish: no count of the
        old version succeeds after this.  Returns the rows counted."""
        base = self.base(run, batch)
        self._begin(base)
        old = self._cas_filled(base, lambda old: (
            ((flags_of(old) | ((version_of(old) + 1) & VERSION_MASK)) << 32) | count_of(old)))
        sync.atomic_store(self.words, base + STAMP, 0)
        self._end(base)
        return count_of(old)

    def add_flags(self, run: int, batch: int, flags: int) -> None:
        base = self.base(run, batch)
        self._begin(base)
        self._cas_filled(base, lambda old: old | (flags << 32))
        self._end(base)

    # --- workers ---------------------------------------------------------------

    def count(self, run: int, batch: int, version: int) -> int:
        """Count one more row written in `version`: the new count, or -1 if
        the version changed (the row went into a replaced slab)."""
        w, i = self.words, self.base(run, batch) + FILLED
        while True:
            old = sync.atomic_load(w, i)
            if version_of(old) != version:
                return -1
            if sync.atomic_cas(w, i, old, old + 1):
                return count_of(old) + 1
