"""NOTE [ Datasets that keep their own state ]
=============================================

A dataset may keep state of its own and say so as torchdata's Stateful
protocol does: `state_dict()` returns it, `load_state_dict(state)` takes it
back, and the pass that follows goes on from it (where a stream is, the
epoch it counts itself, a generator it draws from).  Each copy of the
dataset has its own state: each worker process's (forked from main's), or
main's one object with num_workers=0 (and, map-style, with thread
workers).  The loader's state_dict() holds each copy's, as torchdata's
StatefulDataLoader does, and load_state_dict() gives each copy of the
resumed loader its own back before it loads anything:

- iterable datasets: a worker takes its copy's state (and its iterator's,
  if the iterator keeps one) right after iter(dataset), and again after
  every batch's worth of samples it reads and at the stream's end, and
  sends each (DatasetState AT, with the number of samples read) to main
  before the samples it read since can be in a batch main hands out.  A
  state holds, per worker, the one at the most samples read that were all
  delivered (its whole stream position without a shuffle buffer, which
  delivers a prefix of it).  The resumed worker loads it, makes its
  iterator, and goes on from there: it reads again only what a shuffle
  buffer had not delivered past that point, and drops what it had.  A
  state's worker with nothing delivered has its state after iter(): a
  dataset whose state_dict() then says where the pass that begins starts
  resumes exactly; Hugging Face's IterableDataset does once its epoch is
  set each pass (set_epoch), as it asks.
- map-style datasets: which samples remain is the loader's (its positions);
  each copy gets back the state it began the cut pass with (STARTED, sent
  before the worker loads anything of the run; main takes its own copy's).
  Exact for a state that changes between passes, not for one that moves as
  samples load (a generator): a worker compares its copy's state with the
  one it began with after each batch it loads and says once if it moved
  (CHANGED); main compares its own copy's when a state is taken.
- a state taken between passes holds the state the next pass begins with:
  persistent workers' copies as they ended their part (ENDED, sent before
  the worker's Done), main's copy as it is.  Workers made anew for each
  pass begin it from main's copy, which they never change: nothing to hold.

What cannot be exact is said, never silent: load_state_dict() gives an
InexactResumeWarning naming the dataset's class when
- its state_dict() takes arguments, so the loader cannot take the state
  (but MosaicML Streaming's state_dict(num_samples, from_beginning) is
  taken as its StreamingDataLoader takes it: NOTE [ Datasets that resume
  themselves ], below);
- its state moved while the cut pass loaded (map-style, above), or a
  copy's state is unknown (its state_dict() raised, and main raised that);
- worker threads share one copy of an iterable one (each iterating it);
- the loader resumes with another number of copies than the state holds
  and their states differ (copy w takes state w modulo their number);
- the state holds no state of the dataset (a state of an older version).
A state holding a dataset's state, given to a loader whose dataset keeps
none or is of another class, is a StateError.
"""

from __future__ import annotations

import inspect
import pickle
import warnings
from typing import NamedTuple

from loader.errors import InexactResumeWarning
from loader.shared.messages import DatasetState

STARTED, CHANGED, ENDED, AT = "started", "changed", "ended", "at"   # DatasetState.when


class RunDataset(NamedTuple):
    """What a run carries for the dataset's copies (the SNAPSHOT memfd of
    NOTE [ Runs ]): its epoch snapshot (NOTE [ Datasets that change with
    the epoch ]), and what each copy loads before the run (None: nothing):
    map-style, its state; iterable, a stream point {"position", "state"}."""
    snapshot: object
    states: list | None


def keeps_state(obj) -> bool:
    """Does it say it keeps its own state (torchdata's Stateful protocol)?"""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def why_state_cannot_be_taken(dataset) -> str | None:
    """Why dataset.state_dict() cannot be called without arguments, or None."""
    try:
        params = inspect.signature(dataset.state_dict).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: try it
        return None
    needed = [p.name for p in params if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not needed:
        return None
    return (f"its state_dict() takes arguments ({', '.join(needed)}), so the loader cannot "
            f"take its state")


def name_of(dataset) -> str:
    kind = type(dataset)
    return f"{kind.__module__}.{kind.__qualname__}"


def _same(a, b) -> bool:
    try:
        return pickle.dumps(a) == pickle.dumps(b)
    except Exception:  # a state that does not pickle: not known to be the same
        return False


def stream_point(position: int, dataset_state, iterator_state=None) -> dict:
    """Where an iterable dataset's copy is: after `position` samples of its
    stream, its state and its iterator's (None: none of its own)."""
    return {"position": position, "state": {"dataset": dataset_state,
                                            "iterator": iterator_state}}


class RunStates:
    """Main's book of one run: what each copy of the dataset reported
    (NOTE [ Datasets that keep their own state ]).  copies: the worker
    processes (or 1: main's copy); in_main: main takes its copy's state
    itself; mains: the copy is main's object (main's, or a worker thread's,
    which reports as a process does); shared_by: worker threads sharing
    main's copy of an iterable dataset (none of its states describe them)."""

    def __init__(self, copies: int, in_main: bool, shared_by: int = 0, mains: bool = False):
        self.copies, self.in_main, self.shared_by = copies, in_main, shared_by
        self.mains = mains or in_main
        self.run = None            # the run's id, once started
        self.progress = None       # the run's StreamProgress (iterable)
        self.started: dict = {}    # map-style: copy -> its state as it began (None: unknown)
        self.ended: dict = {}      # copy -> its state as it ended its part
        self.points: dict = {}     # iterable: copy -> {samples read: stream point state}
        self.changed = False

    def record(self, msg: DatasetState) -> None:
        """A worker's report."""
        state = msg.state if msg.known else None
        if msg.when == CHANGED:
            self.changed = True
        elif msg.when == STARTED:
            self.started[msg.worker] = state
        elif msg.when == ENDED:
            self.ended[msg.worker] = state
        else:
            self.at(msg.worker, msg.position, state, msg.known)

    def at(self, copy: int, position: int, state, known: bool = True) -> None:
        """An iterable copy's state after `position` samples read; those
        below the latest all delivered are of no use any more."""
        points = self.points.setdefault(copy, {})
        points[position] = state if known else None
        delivered = self._delivered(copy)
        for p in sorted(p for p in points if p <= delivered)[:-1]:
            del points[p]

    def _delivered(self, copy: int) -> int:
        progress = self.progress
        return progress.prefix[copy] if progress is not None and copy < len(
            progress.prefix) else 0

    def begin_in_main(self, dataset, states: list | None) -> None:
        """Main's copy of a map-style dataset begins the run: load what the
        run carries, take its state."""
        if states is not None:
            dataset.load_state_dict(states[0])
        self.started[0] = dataset.state_dict()

    def waits_for_workers(self, complete: bool, persistent: bool) -> bool:
        """Does a state need reports the workers may still be sending?"""
        if self.in_main or self.shared_by:
            return False
        return not complete or (persistent and not self.mains)

    def reported(self, complete: bool, iterable: bool) -> bool:
        """Has every copy said what a state needs (as it began its part,
        the point of its stream delivered, or as it ended its part)?"""
        if complete:
            return all(c in self.ended for c in range(self.copies))
        if not iterable:
            return all(c in self.started for c in range(self.copies))
        return all(self._point(c) is not None for c in range(self.copies))

    def _point(self, copy: int):
        """(position, state) of copy's latest report with all below delivered."""
        delivered = self._delivered(copy)
        points = [p for p in self.points.get(copy, ()) if p <= delivered]
        if not points:
            return None
        best = max(points)
        return best, self.points[copy][best]

    def record_of(self, dataset, *, complete: bool, iterable: bool, persistent: bool) -> dict:
        """The state's "dataset" entry (NOTE [ Datasets that keep their own state ])."""
        if self.shared_by > 1:
            return entry(dataset, None, f"its one copy is shared by {self.shared_by} worker "
                         f"threads, each iterating it, so no state of it says where each "
                         f"stream is: it resumes from the state it is made with")
        if complete:
            return self._between_passes(dataset, iterable, persistent)
        if iterable:
            points = [self._point(c) for c in range(self.copies)]
            states = [None if p is None else {"position": p[0], "state": p[1]} for p in points]
            unknown = any(p is None or p[1] is None for p in points)
            return entry(dataset, states, _UNKNOWN if unknown else None)
        if self.in_main and not _same(dataset.state_dict(), self.started.get(0)):
            self.changed = True
        states = [self.started.get(c) for c in range(self.copies)]
        why = None
        if self.changed:
            why = ("its state moved while the cut pass loaded: each copy gets back the state "
                   "it began the pass with, so the remaining samples are the right ones but "
                   "what a state that moves as samples load (a generator) makes of them may "
                   "differ")
        elif any(s is None for s in states):
            why = _UNKNOWN
        return entry(dataset, states, why)

    def _between_passes(self, dataset, iterable: bool, persistent: bool) -> dict:
        """A state between passes: what the next one begins with."""
        if self.mains:  # main's object: as it is now
            states = [dataset.state_dict()]
        elif not persistent:
            return entry(dataset, None, None)  # workers begin the next pass from main's copy
        else:
            states = [self.ended.get(c) for c in range(self.copies)]
        why = _UNKNOWN if any(s is None for s in states) else None
        if iterable:
            states = [stream_point(0, s) for s in states]
        return entry(dataset, states, why)


_UNKNOWN = ("a copy's state of it is unknown (its state_dict() raised, and the loader raised "
            "that): that copy resumes from the state it is made with")


def entry(dataset, states: list | None, why: str | None) -> dict:
    """A state's "dataset" entry: the dataset's class, its copies' states
    (None: none to load), and why a resume from them is not exact (None: it is)."""
    return {"class": name_of(dataset), "states": states, "exact": why is None, "why": why}


def without_state(dataset) -> dict:
    """The "dataset" entry when the loader cannot take the state."""
    return entry(dataset, None, why_state_cannot_be_taken(dataset) + (
        ": the resumed pass begins from the state the dataset is made with, and what it "
        "yields there may repeat samples the cut pass delivered and miss others"))


def states_to_load(dataset, record: dict | None, copies: int) -> list | None:
    """What each copy of a resumed loader loads (copy w: states[w]), with
    an InexactResumeWarning where that cannot be exact."""
    if record is None:
        _warn(dataset, "the state holds no state of it (a state of an older version, or of a "
                       "loader over another dataset): it resumes from the state it is made with")
        return None
    states = record["states"]
    if not record["exact"]:
        _warn(dataset, record["why"])
    if states is None:
        return None
    if len(states) != copies and not all(_same(s, states[0]) for s in states):
        _warn(dataset, f"the state holds the states of {len(states)} copies of it (one per "
                       f"worker) and this loader has {copies}: copy w takes state w modulo "
                       f"{len(states)}")
    return [states[w % len(states)] for w in range(copies)]


def _warn(dataset, why: str) -> None:
    warnings.warn(f"load_state_dict: {name_of(dataset)} cannot resume exactly: {why} (NOTE "
                  f"[ Datasets that keep their own state ] in loader/datasets/own_state.py)",
                  InexactResumeWarning, stacklevel=5)


class CopyState:
    """A worker's copy of the dataset (NOTE [ Datasets that keep their own
    state ]): what it reports to main, as it begins and ends each run, at
    points of an iterable dataset's stream, and once if a map-style one's
    state moves during a run.  send(msg): to the batcher; failed(exc,
    where, run): report an error (main raises it)."""

    def __init__(self, dataset, worker: int, iterable: bool, rows: int, send, failed):
        self.dataset, self.worker, self.iterable, self.rows = dataset, worker, iterable, rows
        self.send, self.failed = send, failed
        self.began = None    # map-style: the state the current run began with, pickled
        self.units = 0

    def _report(self, run: int, when: str, state=None, known: bool = True, position=None):
        self.send(DatasetState(run=run, worker=self.worker, when=when, state=state,
                               known=known, position=position))

    def _state(self, run: int, what: str = "state_dict"):
        """(the dataset's state, whether it could be taken)."""
        try:
            return self.dataset.state_dict(), True
        except Exception as e:
            self.failed(e, f"in {name_of(self.dataset)}.{what}(), in worker {self.worker}", run)
            return None, False

    # --- map-style --------------------------------------------------------------------

    def begin(self, run: int, states: list | None, usable: bool = True) -> None:
        """Before the worker loads anything of the run (usable False: it
        will load nothing, its worker_init_fn failed).  Iterable: only an
        unusable worker says so here (its stream reports itself)."""
        if self.iterable:
            if not usable:
                self._report(run, AT, known=False, position=0)
            return
        state, known = None, False
        if usable:
            try:
                if states is not None:
                    self.dataset.load_state_dict(states[self.worker % len(states)])
                state, known = self._state(run)
            except Exception as e:
                self.failed(e, f"in {name_of(self.dataset)}.load_state_dict(), in worker "
                               f"{self.worker}", run)
        self.began, self.units = (pickle.dumps(state) if known else None), 0
        self._report(run, STARTED, state, known)

    def loaded_a_unit(self, run: int, per_check: int = 1) -> None:
        """Before the worker claims its next unit (a batch, or a sample:
        then every `per_check`, a batch's worth): has the state moved since
        the run began?"""
        self.units += 1
        if self.began is None or self.units % per_check:
            return
        try:
            moved = pickle.dumps(self.dataset.state_dict()) != self.began
        except Exception:
            moved = True
        if moved:
            self.began = None  # said once a run
            self._report(run, CHANGED)

    def end(self, run: int) -> None:
        """The worker's part of the run is over (before its Done)."""
        state, known = self._state(run)
        self._report(run, ENDED, state, known)

    # --- iterable ---------------------------------------------------------------------

    def open_stream(self, run: int, point: dict | None):
        """iter(dataset) for the run, from the stream point the run carries
        (None: as the copy is): (the iterator, the samples read before it)."""
        position = 0
        try:
            if point is not None:
                position = point["position"]
                if point["state"]["dataset"] is not None:
                    self.dataset.load_state_dict(point["state"]["dataset"])
            it = iter(self.dataset)
            if point is not None and point["state"]["iterator"] is not None:
                it.load_state_dict(point["state"]["iterator"])
        except BaseException:
            self._report(run, AT, known=False, position=position)
            raise
        self._read(run, it, position)
        return it, position

    def read(self, run: int, it, position: int) -> None:
        """`position` samples of the stream are read: a batch's worth more?"""
        if position % self.rows == 0:
            self._read(run, it, position)

    def stream_ended(self, run: int, it, position: int) -> None:
        if position % self.rows:
            self._read(run, it, position)

    def _read(self, run: int, it, position: int) -> None:
        state, known = self._state(run)
        own = it is not self.dataset and keeps_state(it)
        if known and own:
            try:
                point = {"dataset": state, "iterator": it.state_dict()}
            except Exception as e:
                self.failed(e, f"in the iterator of {name_of(self.dataset)}: state_dict(), in "
                               f"worker {self.worker}", run)
                point, known = None, False
        else:
            point = {"dataset": state, "iterator": None} if known else None
        self._report(run, AT, point, known, position)


# NOTE [ Datasets that resume themselves ]
# ========================================
#
# MosaicML Streaming's StreamingDataset keeps its state another way than
# the Stateful protocol above, and per-copy states cannot describe it:
# - its epoch counter and a loaded state live in shared memory that main's
#   copy and every worker's share (by name: a new process starts at epoch 0);
#   each pass (its __iter__ in the workers, all at once behind a barrier)
#   takes the loaded state if it is not older than the counter, else the
#   counter's epoch from its start, and moves the counter on;
# - one order per epoch over all workers: the remaining samples (after
#   sample_in_epoch) in batches of its batch_size, batch j to worker j mod W,
#   so that a loader handing batches out round-robin gives that order;
# - state_dict(num_samples, from_beginning), called in main with the samples
#   the loader delivered of the epoch (its StreamingDataLoader passes those
#   of the current pass with from_beginning=False: the dataset adds where a
#   resumed pass began), returns {"epoch", "sample_in_epoch", ...};
#   load_state_dict() writes it to the shared memory for the next pass.
# So the loader does what Mosaic's StreamingDataLoader does: main takes the
# dataset's state with the samples of the pass delivered (times the ranks,
# over its replication), and a resumed loader gives it back to main's copy
# and reads each stream from its start (the dataset drops what was
# delivered).  Where the counter cannot be read it is not trusted: a state
# with nothing of the pass delivered yet (the workers may not have begun it)
# holds the state the run's pass began with, taken as the run was planned
# (before any worker began it: the loaded state, or the epoch after the one
# the counter says); a state between passes, the next epoch from its start.
# Exact only when the delivered samples are the first of the dataset's
# order, else an InexactResumeWarning at load_state_dict() says why: batches
# handed out first-ready not round-robin, a shuffle buffer, a loader
# batch_size other than the dataset's, one copy shared by worker threads.

_PASS_KEYS = ("epoch", "sample_in_epoch")


def resumes_itself(dataset) -> bool:
    """Does it keep MosaicML Streaming's protocol (state_dict(num_samples,
    from_beginning) and load_state_dict(state))?"""
    if not keeps_state(dataset):
        return False
    try:
        names = list(inspect.signature(dataset.state_dict).parameters)
    except (TypeError, ValueError):
        return False
    return names[:2] == ["num_samples", "from_beginning"]


def _at(state, epoch: int, sample: int):
    """state, moved to sample `sample` of epoch `epoch` (None: it has not
    the keys of one)."""
    if not isinstance(state, dict) or any(k not in state for k in _PASS_KEYS):
        return None
    return {**state, "epoch": epoch, "sample_in_epoch": sample}


def next_pass(dataset):
    """The dataset's state as its next pass begins, when nothing is loaded
    (main, before the run's workers begin it): the epoch after the one its
    counter says, from its start (None: not known)."""
    now = dataset.state_dict(0, True)
    return _at(now, now.get("epoch", 0) + 1, 0) if isinstance(now, dict) else None


def pass_entry(dataset, pass_start, progress, *, world: int, in_order: bool,
               batch_size: int | None, shared_by: int) -> dict:
    """The state's "dataset" entry of a dataset that resumes itself (NOTE
    [ Datasets that resume themselves ]); progress None: no run yet."""
    if progress is None:
        return entry(dataset, None, None)
    if progress.complete:
        now = dataset.state_dict(0, True)  # the pass ended, none began since: its epoch
        state = _at(now, now.get("epoch", -1) + 1, 0) if isinstance(now, dict) else None
    elif sum(progress.prefix) + sum(len(e) for e in progress.extra) == 0:
        state = pass_start
    else:
        state = dataset.state_dict(_samples_of_pass(dataset, progress, world), False)
    why = _why_not_a_prefix(dataset, progress, in_order, batch_size, shared_by)
    if state is None:
        why = (f"its state has no {' and '.join(_PASS_KEYS)}, so the loader cannot tell the "
               f"pass that begins: it resumes from the state it is made with")
    return entry(dataset, None if state is None else [state], why)


def _samples_of_pass(dataset, progress, world: int) -> int:
    """What Mosaic's StreamingDataLoader counts: the samples of the pass
    delivered, over all ranks, once per replica."""
    n = (sum(progress.prefix) + sum(len(e) for e in progress.extra)) * world
    replication = getattr(dataset, "replication", None)
    return n // replication if isinstance(replication, int) and replication > 1 else n


def _why_not_a_prefix(dataset, progress, in_order: bool, batch_size, shared_by: int):
    """Why the samples delivered may not be the first of the dataset's
    order (None: they are)."""
    if shared_by > 1:
        return (f"its one copy is shared by {shared_by} worker threads, each iterating it, so "
                f"what was delivered is not a count of its order")
    if progress.complete:
        return None
    streams = len(progress.prefix)
    own_batch = getattr(dataset, "batch_size", None)
    if streams > 1 and isinstance(own_batch, int) and own_batch != batch_size:
        return (f"its batch_size ({own_batch}) is not the loader's ({batch_size}), so the "
                f"batches of its order are not the ones handed out round-robin")
    if any(progress.extra) or any(p != b * progress.rows for p, b in
                                  zip(progress.prefix, progress.batches)):
        return ("the samples delivered were not each stream's first (a shuffle buffer), so "
                "they are not the first of its order: some may repeat, others be missed")
    total = sum(progress.batches)
    round_robin = [total // streams + (w < total % streams) for w in range(streams)]
    if streams > 1 and not in_order and progress.batches != round_robin:
        return (f"batches were handed out as they were ready (in_order=False), not "
                f"round-robin (per worker {progress.batches}), so the samples delivered are "
                f"not the first of its order: some may repeat, others be missed")
    return None
