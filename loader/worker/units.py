"""A worker's one loop over the units of a run, and what varies under it.

NOTE [ Units ]
A run is loaded unit by unit, in load_units:

    source.next() -> unit | None    ClaimedUnits: rows, or a collate_fn's batches
                                    placed first-ready; WholeBatches: batches torch
                                    assigns, or claimed whole; StreamUnits: a
                                    stream's samples, numbered
    load(unit) -> what to place     a Fetcher's (worker/fetch.py, shared with
                                    num_workers=0): dataset[i], __getitems__, next(it)
    place(unit, loaded) -> bool     a sample in its row, a batch's rows, a
                                    collated output, a stream's sample;
                                    False once the run ended
    failed(unit, error) -> bool     an error of load(unit) reported; False: the
                                    worker's part of the run is over (a stream's)

A unit is an int: a position, a batch, or a stream's sample number.  The
per-sample path costs one call per unit more than a loop written for it
(place), no allocation.  Which source, load and place a run takes is
decided in one place (MapRun.parts); the text of every error a worker
reports is worded in worker/failures.py.
"""

from __future__ import annotations

from loader._native import DROPPED, ENDED, StreamSlots, derived_seeds
from loader.order import indices as _order
from loader.order.progress import stream_skips
from loader.shared import control as _control
from loader.shared import messages as _protocol
from loader.worker import fetch as _fetch
from loader.worker.seeding import U64
from loader.worker.failures import (FETCHING, ITERATING, LOADING, OPENING_STREAM,
                                    PLACING_FETCHED, PLACING_SAMPLE, PLACING_STREAMED)

FAILED = object()  # a collate_fn raised (and it was reported)


def load_units(source, load, place, failed) -> bool:
    """Load each unit the source gives and place it (NOTE [ Units ]).
    True once the source is exhausted, False once the run ended."""
    next_unit = source.next
    while (unit := next_unit()) is not None:
        try:
            loaded = load(unit)
        except Exception as e:
            if not failed(unit, e):
                return False
            continue
        if not place(unit, loaded):
            return False
    return True


def _raise(unit: int, e: BaseException) -> bool:
    """The failed() of a load that reports its samples' errors itself."""
    raise e


# --- unit sources ------------------------------------------------------------------------


class ClaimedUnits:
    """Units claimed one at a time, each loaded once main's limit allows
    it: positions (rows), or a collate_fn's batches.  per_check: how often
    a dataset that keeps its own state is checked (a batch's worth of
    rows)."""

    def __init__(self, worker, run: int, bound: int, per_check: int):
        self.worker, self.run, self.bound, self.per_check = worker, run, bound, per_check
        self.own, self.autoscaled = worker.own, worker.autoscaled
        self.claim, self.below_limit = worker.counters.claim, worker.counters.below_limit

    def next(self) -> int | None:
        run, worker = self.run, self.worker
        if self.autoscaled and not worker.may_claim(run, self.bound):
            return None
        if self.own is not None:  # before the claim (see CopyState.loaded_a_unit)
            self.own.loaded_a_unit(run, self.per_check)
        unit = self.claim(run)
        if unit < 0 or unit >= self.bound:  # a unit past the end is never waited for
            return None
        if not self.below_limit(run, unit) and not worker.wait_to_load(run, unit):
            return None
        return unit


class WholeBatches:
    """The batches this worker loads whole (DataLoader; __getitems__): in
    order, id, id + W, id + 2W... as torch assigns them (so that what a
    dataset draws from the generators torch seeded per worker lands in the
    same samples); else as claimed, so that a slow batch never holds up
    the batches behind it."""

    def __init__(self, worker, run: int, count: int):
        cfg = worker.cfg
        self.worker, self.run, self.count, self.own = worker, run, count, worker.own
        self.assigned = cfg.in_order and cfg.whole_batches
        self.assigned_next, self.assigned_step = worker.id, cfg.streams

    def next(self) -> int | None:
        run, worker = self.run, self.worker
        if self.assigned:
            unit = self.assigned_next
            if unit >= self.count:
                return None
            self.assigned_next += self.assigned_step
        else:
            if not worker.may_claim(run, self.count):
                return None
            unit = worker.counters.claim(run)
            if not 0 <= unit < self.count:
                return None
        if self.own is not None:
            self.own.loaded_a_unit(run)
        return unit if worker.wait_to_load(run, unit) else None


class StreamUnits:
    """A stream's samples, by number: from `first` (a resumed stream's
    samples read before it) until its load says the stream ended."""

    def __init__(self, first: int):
        self.seq, self.ended = first, False

    def next(self) -> int | None:
        if self.ended:
            return None
        self.seq += 1
        return self.seq - 1


# --- map-style runs ----------------------------------------------------------------------


class MapRun:
    """One run over a map-style dataset: its loads and places."""

    def __init__(self, worker, run: int, epoch: int, order, batches: _order.Batches):
        cfg = worker.cfg
        self.worker, self.run, self.epoch, self.order, self.batches = (worker, run, epoch,
                                                                       order, batches)
        self.index_of = _order.index_getter(order)
        self.load_position = worker.fetcher.positions(epoch, self.index_of)
        self.in_order, self.claim = cfg.in_order, worker.counters.claim
        self.write, self.failed = worker.writer.place, worker.failed
        # a batch unit is placed as that batch; a collate_fn's first-ready
        # ones (ClaimedUnits) in the slot claimed once collated
        self.at_unit = cfg.in_order or cfg.whole_batches or cfg.batched_fetch
        self.indices = None  # __getitems__: the batch's indices, for an error's text
        self.start = self.stop = 0  # a batch unit's span, as its load found it

    def load(self) -> None:
        load_units(*self.parts())

    def parts(self) -> tuple:
        """The run's (source, load, place, failed): see NOTE [ Units ]."""
        cfg, worker, run = self.worker.cfg, self.worker, self.run
        if cfg.whole_batches or cfg.batched_fetch:
            source = WholeBatches(worker, run, self.batches.count)
            if cfg.batched_fetch:
                return (source, self.fetched,
                        self.place_collated if cfg.per_batch else self.place_rows,
                        self.fetch_failed)
            if cfg.per_batch:
                return source, self.samples, self.place_collated, _raise
            return source, self.each_sample, self.place_rows, _raise
        units = worker.control.read(run, _control.UNITS)
        if cfg.per_batch:
            return ClaimedUnits(worker, run, units, 1), self.samples, self.place_collated, _raise
        return (ClaimedUnits(worker, run, units, cfg.rows), self.load_position,
                self.place_row, self.row_failed)

    def blamed(self, unit: int) -> int | None:
        """The batch an error in a batch unit spoils (None: first-ready,
        its slot not claimed yet)."""
        return unit if self.at_unit else None

    # loads

    def each_sample(self, unit: int):
        """The unit's samples, each loaded when it is wanted (so that a batch
        placed row by row is never in memory whole); at an error, reported,
        the rest are not loaded."""
        self.start, self.stop = self.batches.span(unit)  # once a unit (an OPEN run's may move)
        return self._loaded(unit, self.start, self.stop)

    def _loaded(self, unit: int, start: int, stop: int):
        load = self.load_position
        for pos in range(start, stop):
            try:
                sample = load(pos)
            except Exception as e:
                self._not_loaded(e, self.blamed(unit), pos)
                return
            yield sample

    def samples(self, unit: int) -> list | None:
        """The unit's samples, for a collate_fn (None: one failed)."""
        samples = list(self.each_sample(unit))
        return samples if len(samples) == self.stop - self.start else None

    def fetched(self, unit: int) -> list:
        """One __getitems__ call (NOTE [ Batched fetch ] in worker/fetch.py)."""
        self.start, self.stop = self.batches.span(unit)
        self.indices = _fetch.indices_of(self.order, self.start, self.stop)
        return self.worker.fetcher.batch(self.epoch, self.indices, self.start)

    def row_failed(self, pos: int, e: Exception) -> bool:
        batch = self.batches.locate(pos)[0] if self.in_order else None  # first-ready: no slot yet
        self._not_loaded(e, batch, pos)
        return True

    def _not_loaded(self, e: Exception, batch: int | None, pos: int) -> None:
        self.failed(LOADING, e, self.run, batch=batch, pos=pos, index=self.index_of(pos))

    def fetch_failed(self, unit: int, e: Exception) -> bool:
        self.failed(FETCHING, e, self.run, batch=unit,
                    fetch=_fetch.where(self.worker.cfg.dataset, self.indices))
        return True

    # places

    def place_row(self, pos: int, sample) -> bool:
        """A sample in its row: its position's, or in first-ready order the
        next free one."""
        run, batches = self.run, self.batches
        slot = pos if self.in_order else self.claim(run, True)  # first-ready: arrival order
        if slot < 0:
            return False
        batch, row = batches.locate(slot)
        try:
            return self.write(run, batch, row, batches.rows(batch), pos, sample) != ENDED
        except Exception as e:  # a CollateError, or a file read failing (FileDataset)
            # (first-ready too: the batch's slot is taken, so the batcher must give
            # the batch up; main raises at once all the same)
            self._not_placed(e, batch, pos, None)
            return True

    def place_rows(self, unit: int, samples) -> bool:
        """A whole batch's samples, each in its row as it comes."""
        run, write, start, rows = self.run, self.write, self.start, self.stop - self.start
        for row, sample in enumerate(samples):
            try:
                if write(run, unit, row, rows, start + row, sample) == ENDED:
                    return False
            except Exception as e:  # a CollateError, or a file read failing (FileDataset)
                self._not_placed(e, unit, start + row, row)
                return True
        return True

    def place_collated(self, unit: int, samples: list | None) -> bool:
        """A collate_fn's output (batch_size=None: the sample) as one batch."""
        if samples is None:  # a sample failed (reported)
            return True
        run = self.run
        output = self.worker.collate(run, self.blamed(unit), samples)
        if output is FAILED:
            return True
        slot = unit if self.at_unit else self.claim(run, True)  # first-ready: once collated
        return slot >= 0 and self.worker.place_output(run, slot, output, unit)

    def _not_placed(self, e: Exception, batch: int, pos: int, row: int | None) -> None:
        fetched = self.indices is not None  # (its index named in the text alone)
        self.failed(PLACING_FETCHED if fetched else PLACING_SAMPLE, e, self.run, batch=batch,
                    pos=pos, index=None if fetched else self.index_of(pos),
                    shown=self.indices[row] if fetched else None)


# --- iterable datasets -------------------------------------------------------------------


class StreamRun:
    """This worker's own pass over an iterable dataset, into its own
    batches (see NOTE [ Runs ]): batch j of worker w is the run's batch
    j * W + w.  point: where its copy of the dataset resumes from (NOTE
    [ Datasets that keep their own state ])."""

    def __init__(self, worker, run: int, point: dict | None):
        cfg, c = worker.cfg, worker.control
        self.worker, self.run, self.point, self.own = worker, run, point, worker.own
        self.N, self.w, self.in_order = cfg.streams, worker.id, cfg.in_order
        self.epoch = epoch = c.read(run, _control.EPOCH)
        j0, self.done_below, self.done_past = 0, 0, set()  # a resumed epoch: what was delivered
        if c.read(run, _control.ORDER) == _order.ORDER_SHIPPED:
            words, _ = worker.shared.read_order(run, c.read(run, _control.KEPT), 0, False)
            j0, self.done_below, self.done_past = stream_skips(words, self.N, self.w)
        self.slots = None if cfg.per_batch else StreamSlots(
            j0, cfg.rows, cfg.shuffle_batches,
            derived_seeds(cfg.seed & U64, epoch, self.w + 1, 1 << 62)[0],
            lambda j: worker.wait_for_room(run, j))
        self.j, self.pending = j0, []  # per_batch: this worker's batch j's samples so far
        self.it = self.source = None

    def load(self) -> _protocol.StreamEnd:
        """Returns how the stream ended (StreamEnd): its short last batch
        and its rows when rows fill in order, none when there is none or
        the run ended first; with a shuffle buffer, holes in its last
        batches for the batcher to close up."""
        try:  # seq: the samples of the stream read before it
            it, seq = (iter(self.worker.cfg.dataset), 0) if self.own is None else \
                self.own.open_stream(self.run, self.point)
        except Exception as e:
            self.worker.failed(OPENING_STREAM, e, self.run, batch=self._batch(self.j))
            return _protocol.NO_STREAM_END
        self.it, self.source = it, StreamUnits(seq)
        next_sample = self.worker.fetcher.stream(it, self.epoch, self.w + 1)
        into_batch = self._add_to_batch if self.slots is None else self._place_in_slot
        # (a fresh stream of a dataset without its own state: straight into its batch)
        place = self.place if self.own is not None or self.done_below or self.done_past \
            else into_batch
        if not load_units(self.source, next_sample, place, self.failed):
            return _protocol.NO_STREAM_END
        return self._ended()

    def _batch(self, j: int) -> int | None:
        """The run's batch of this worker's j-th, if errors name it (in order)."""
        return j * self.N + self.w if self.in_order else None

    def failed(self, seq: int, e: Exception) -> bool:
        if isinstance(e, StopIteration):
            self.source.ended = True
            if self.own is not None:
                self.own.stream_ended(self.run, self.it, seq)
            return True
        # the stream is over; its batches in progress are dropped
        self.worker.failed(ITERATING, e, self.run,
                           batch=self._batch(self.j if self.slots is None else self.slots.current))
        return False

    def place(self, pos: int, sample) -> bool:
        """False: the stream is over for this epoch."""
        if self.own is not None:  # before the sample can be in a batch main hands out
            self.own.read(self.run, self.it, pos + 1)
        if pos < self.done_below or pos in self.done_past:
            return True  # read (and seeded) as before, so the stream goes on where it was
        if self.slots is None:
            return self._add_to_batch(pos, sample)
        return self._place_in_slot(pos, sample)

    def _add_to_batch(self, pos: int, sample) -> bool:
        """per_batch: collect the sample; place the batch once it is full.
        False: the run ended (or the batch could not be placed)."""
        self.pending.append(sample)
        if len(self.pending) < self.worker.cfg.rows:
            return True
        if not self.worker.wait_for_room(self.run, self.j) or not self._place_batch():
            return False
        self.pending, self.j = [], self.j + 1
        return True

    def _place_in_slot(self, pos: int, sample) -> bool:
        """Write the sample into its row (a shuffle buffer's random one)."""
        cfg = self.worker.cfg
        slot = self.slots.next()
        if slot is None:
            return False
        batch, row = slot[0] * self.N + self.w, slot[1]
        try:
            if self.worker.writer.place(self.run, batch, row, cfg.rows, pos,
                                        sample) in (ENDED, DROPPED):
                # ended, or the batcher gave up a batch of this stream (it cannot
                # collate it): the stream is over for this epoch; main raises the
                # batch's error and goes on with the other workers' batches
                return False
        except Exception as e:  # a CollateError, or a file read failing (FileDataset)
            self.worker.failed(PLACING_STREAMED, e, self.run,
                               batch=batch if cfg.in_order else None)
        return True

    def _place_batch(self) -> bool:
        """Place this worker's j-th batch of the stream (collated here)."""
        batch = self.j * self.N + self.w
        output = self.worker.collate(self.run, batch, self.pending)
        return output is FAILED or self.worker.place_output(self.run, batch, output, self.j)

    def _ended(self) -> _protocol.StreamEnd:
        """What Done says once the stream ended (see load)."""
        cfg, slots = self.worker.cfg, self.slots
        if slots is None:
            if self.pending and not cfg.drop_last and self.worker.wait_for_room(self.run, self.j):
                self._place_batch()
            return _protocol.NO_STREAM_END
        written = slots.written()
        if not written:
            return _protocol.NO_STREAM_END
        if cfg.shuffle_batches:
            return _protocol.StreamEnd(holes_to_close=True)  # the batcher closes them up
        return _protocol.StreamEnd(last_batch=slots.current * self.N + self.w, last_rows=written)
