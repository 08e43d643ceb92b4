"""A loader's state: `LoaderState`, what state_dict() returns and
load_state_dict() takes, with its format and its checks in one place.

A state comes from outside: a checkpoint of another run, of another
version, truncated, edited, or of another loader.  `LoaderState.from_dict`
checks every field against its type, its range and what this loader is
(its dataset's length, batch size, seed, sampler, generators) before
anything of the loader changes, so a bad state is one StateError (a
ValueError) naming the field by its path (map.done_ranges,
stream[1].extra) and both values, and the loader stays as it was.  A
state holds exactly the keys its format defines (STATE_KEYS), at every
level: a key it lacks is refused, and so is one it does not define (an
edited state, or one of another version), which would otherwise be
ignored silently.  `LoaderState.to_dict` writes the dict checkpoints
hold, key for key and in the same order as every version of this format
wrote it.  See NOTE [ Resuming an epoch ] in order/progress.py for what
the fields mean."""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from loader.errors import StateError

# 2: done ranges instead of positions, and the seeded order of NOTE [ The
# seeded order ] (order/indices.py); 1 is read as long as its order is the same
STATE_FORMAT = "shmloader-state-2"
STATE_FORMATS_READ = ("shmloader-state-1", STATE_FORMAT)


class StateKeys(NamedTuple):
    """The keys a state format defines, at each level: what state_dict()
    writes (ShmLoader.state_dict, MapProgress.state, StreamProgress.state;
    tests/loader_layer/test_resume.py keeps them equal) and nothing else
    is loaded (main/state.py)."""
    required: frozenset        # the state's own keys
    optional: frozenset        # keys a state of this format may lack (written later)
    map: frozenset             # "map": a map-style epoch's positions delivered
    stream: frozenset          # each of "stream": a worker's stream delivered


_TOP_KEYS = frozenset({"format", "epoch", "seed", "rank", "world", "workers", "iterable", "rng",
                       "base_seed", "map", "stream", "complete"})
_IDENTITY_KEYS = frozenset({"batch_size", "dataset_len", "sampler"})  # format 1: written later
_STREAM_KEYS = frozenset({"batches", "prefix", "extra"})
STATE_KEYS = {
    "shmloader-state-1": StateKeys(_TOP_KEYS, _IDENTITY_KEYS,
                                   frozenset({"positions", "done_prefix", "done_extra"}),
                                   _STREAM_KEYS),
    # "dataset": written for a dataset that keeps its own state (NOTE [ Datasets
    # that keep their own state ] in datasets/own_state.py)
    # "dataset_epoch": written for a dataset whose epoch a new job cannot take
    # again (NOTE [ Datasets that change with the epoch ] in datasets/snapshot.py)
    STATE_FORMAT: StateKeys(_TOP_KEYS | _IDENTITY_KEYS, frozenset({"dataset", "dataset_epoch"}),
                            frozenset({"positions", "done_prefix", "done_ranges"}), _STREAM_KEYS),
}



class _Absent:
    """A key a state of an older version does not have (kept absent when
    written again)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """Where a loader is: the epoch in progress and which of its samples
    the training loop received.  The fields are the dict's keys, in the
    order to_dict() writes them; map and stream are the progress of the
    epoch (MapProgress.state, StreamProgress.state in order/progress.py),
    dataset a dataset's own state (NOTE [ Datasets that keep their own
    state ]; ABSENT for a dataset that keeps none), dataset_epoch the
    dataset's record of the epoch in progress (NOTE [ Datasets that change
    with the epoch ]; ABSENT if it needs none)."""
    format: str = STATE_FORMAT
    epoch: int
    seed: int
    rank: int
    world: int
    workers: int
    iterable: bool
    rng: dict                     # generator key -> its state, bytes
    base_seed: int | None
    map: dict | None
    stream: list | None
    batch_size: Any = ABSENT      # (ABSENT in format 1 states written before these three)
    dataset_len: Any = ABSENT
    sampler: Any = ABSENT
    complete: bool
    dataset: Any = ABSENT
    dataset_epoch: Any = ABSENT

    def to_dict(self) -> dict:
        """The state as state_dict() returns it and checkpoints keep it."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not ABSENT}

    @classmethod
    def from_dict(cls, state, expected: Expected) -> LoaderState:
        """The state of a dict from state_dict(), of this version or an
        earlier one, checked against what this loader is (the module's
        docstring); the dict itself is left as it is."""
        check_state(state, expected)
        return cls(**copy.deepcopy(state))

    @property
    def own(self) -> dict | None:
        """The dataset's own state, if it keeps one (None: not recorded)."""
        return None if self.dataset is ABSENT else self.dataset

    def with_streams_anew(self) -> LoaderState:
        """This state with every stream begun anew (a dataset that resumes
        itself drops what was delivered itself: NOTE [ Datasets that
        resume themselves ])."""
        return replace(self, stream=[dict(s, batches=0, prefix=0, extra=[])
                                     for s in self.stream])

_RNG_KEYS = ("generator", "global", "sampler")


class Expected(NamedTuple):
    """What this loader is, as a state must match it (None: not checked)."""
    iterable: bool
    num_workers: int
    streams: int                  # an iterable dataset's: one per worker (LoaderSpec.streams)
    rank: int
    world: int
    seed: int | None              # None: the loader's seed was not given (it takes the state's)
    batch_size: int | None
    positions: int | None         # map-style: the positions of an epoch (None: unknown here)
    dataset_len: int | None
    sampler: str | None           # the type name of its sampler or batch sampler
    rng_bytes: dict               # generator key -> the size of its state, in bytes
    seeded_shuffle: bool = False  # its order is the seeded permutation (NOTE [ The seeded
                                  # order ] in order/indices.py)
    own_state: str | None = None  # the class of a dataset that keeps its own state (NOTE
                                  # [ Datasets that keep their own state ]); None: it keeps none
    epoch_record: str | None = None  # the class of a dataset that records its epochs (NOTE
                                  # [ Datasets that change with the epoch ]); None: it does not


def _fail(field: str, got, expected: str, remedy: str = "") -> StateError:
    text = f"load_state_dict: field {field!r} is {got!r}, but {expected}"
    return StateError(f"{text}; {remedy}" if remedy else text)


def _path(parent: str, key) -> str:
    """A field's name in errors: parent.key (parent[key] for a key that is
    not a name)."""
    if isinstance(key, str) and key.isidentifier():
        return f"{parent}.{key}" if parent else key
    return f"{parent}[{key!r}]"


_FOREIGN = ("load a state from state_dict() of a loader of the same dataset and arguments")


def _int(state: dict, field: str, minimum: int | None = 0, maximum: int | None = None,
         name: str | None = None):
    v = state.get(field) if isinstance(state, dict) else state
    name = name or field
    if not isinstance(v, int) or isinstance(v, bool):
        raise _fail(name, v, "it must be an int", _FOREIGN)
    if minimum is not None and v < minimum:
        raise _fail(name, v, f"it must be >= {minimum}", _FOREIGN)
    if maximum is not None and v > maximum:
        raise _fail(name, v, f"it must be <= {maximum}", _FOREIGN)
    return v


def _positions(field: str, values, low: int, high: int | None) -> None:
    """A sorted list of distinct ints in [low, high) (high None: unbounded)."""
    if not isinstance(values, list):
        raise _fail(field, values, "it must be a list of positions", _FOREIGN)
    last = low - 1
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v <= last or (
                high is not None and v >= high):
            bound = f"below {high}" if high is not None else "unbounded"
            raise _fail(field, values, f"it must hold increasing ints from {low} ({bound}); "
                        f"{v!r} is not one", _FOREIGN)
        last = v


def check_state(state, exp: Expected) -> None:
    """Raise StateError naming the first field of `state` that this loader
    cannot resume from."""
    if not isinstance(state, dict):
        raise StateError(f"load_state_dict: not a ShmLoader state: a {type(state).__name__}, "
                         f"not the dict state_dict() returns ({_FOREIGN})")
    if state.get("format") not in STATE_FORMATS_READ:
        raise _fail("format", state.get("format"), f"this loader reads {STATE_FORMATS_READ}: "
                    f"not a ShmLoader state", _FOREIGN)
    _check_keys(state)
    for field in ("iterable", "complete"):
        if not isinstance(state[field], bool):
            raise _fail(field, state[field], "it must be True or False", _FOREIGN)
    _check_parts(state)
    if state["iterable"] != exp.iterable:
        kind = "an iterable" if exp.iterable else "a map-style"
        raise _fail("iterable", state["iterable"], f"this loader has {kind} dataset", _FOREIGN)
    complete = state["complete"]
    _int(state, "epoch", 0 if complete else 1)
    _check_identity(state, exp)
    _check_own_state(state, exp)
    _check_epoch_record(state, exp)
    if complete:
        return  # the next epoch starts afresh: nothing of an epoch to check
    _check_rng(state, exp)
    if state["format"] != STATE_FORMAT and exp.seeded_shuffle:
        raise _fail("format", state["format"], f"an epoch of seed={state['seed']} in progress in "
                    f"this format was shuffled by numpy's permutation, and this loader's "
                    f"shuffle is the seeded order of {STATE_FORMAT!r}: the rest of that epoch "
                    f"cannot be told apart from what was delivered",
                    "resume from a state taken at an epoch's end (complete=True), or finish "
                    "the epoch with the version that wrote the state")
    if exp.iterable:
        _check_stream(state, exp)
    else:
        _check_map(state, exp)


def _check_keys(state: dict) -> None:
    """Every key the state's format defines, at every level, and no other
    (see the module's docstring)."""
    keys = STATE_KEYS[state["format"]]
    _keys_of(state, "", keys.required, keys.optional, state["format"])
    rng = state["rng"]
    if not isinstance(rng, dict):
        raise _fail("rng", rng, "it must be a dict of generator states", _FOREIGN)
    _keys_of(rng, "rng", frozenset(), frozenset(_RNG_KEYS), state["format"])
    if isinstance(state["map"], dict):
        _keys_of(state["map"], "map", keys.map, frozenset(), state["format"])
    if isinstance(state["stream"], list):
        for w, s in enumerate(state["stream"]):
            if isinstance(s, dict):
                _keys_of(s, f"stream[{w}]", keys.stream, frozenset(), state["format"])


def _keys_of(d: dict, parent: str, required: frozenset, optional: frozenset,
             fmt: str) -> None:
    missing = sorted(required - d.keys())
    if missing:
        raise StateError(f"load_state_dict: the state has no field {_path(parent, missing[0])!r}"
                         f": truncated, or not from state_dict() ({_FOREIGN})")
    unknown = [key for key in d if key not in required and key not in optional]
    if unknown:
        name = _path(parent, unknown[0])
        why = _WRITTEN_BY_OTHERS.get(name, "edited, or written by another version of the loader "
                                           "(which this one would misread)")
        raise StateError(f"load_state_dict: the state has a field {name!r}, which a state of "
                         f"format {fmt!r} does not define: {why}; {_FOREIGN}, of this "
                         f"version")


# fields of states that other classes' state_dict() write, and what to do
_WRITTEN_BY_OTHERS = {
    "sampler_epoch": "loader.DataLoader's states record it (the epoch of a sampler with "
                     "set_epoch); load this state into a loader.DataLoader"}


def _check_parts(state: dict) -> None:
    """A map-style state's "map" is None (no epoch started) or a dict, and
    its "stream" None; an iterable one's the other way round."""
    iterable = state["iterable"]
    shapes = {"map": (dict, not iterable), "stream": (list, iterable)}
    for part, (kind, mine) in shapes.items():
        value = state[part]
        if value is None:
            continue
        if not mine:
            dataset = "an iterable" if iterable else "a map-style"
            raise _fail(part, value, f"the state is of {dataset} dataset (iterable={iterable}),"
                        f" whose {part!r} is None", _FOREIGN)
        if not isinstance(value, kind):
            raise _fail(part, value, f"it must be None or a {kind.__name__}", _FOREIGN)


def _check_identity(state: dict, exp: Expected) -> None:
    seed = _int(state, "seed", None)
    if exp.seed is not None and seed != exp.seed:
        raise _fail("seed", seed, f"this loader's seed is {exp.seed}",
                    "a state resumes the run of its own seed: pass seed=%d (or no seed)" % seed)
    world = _int(state, "world", 1)
    rank = _int(state, "rank", 0, world - 1)
    if (rank, world) != (exp.rank, exp.world):
        raise _fail("rank", rank, f"this loader is rank {exp.rank} of {exp.world} (the state: "
                    f"rank {rank} of {world})", "each rank resumes from its own state")
    workers = _int(state, "workers", 0)
    if exp.iterable and not state["complete"] and workers != exp.num_workers:
        raise _fail("workers", workers, f"this loader has {exp.num_workers}: an iterable dataset "
                    f"resumes only with the same number of workers (the streams are theirs)",
                    f"pass num_workers={workers}")
    for field, mine in (("batch_size", exp.batch_size), ("dataset_len", exp.dataset_len),
                        ("sampler", exp.sampler)):
        if field in state and state[field] != mine:  # (states before these fields: not checked)
            raise _fail(field, state[field], f"this loader's is {mine!r}", _FOREIGN)
    base = state["base_seed"]
    if base is not None:
        _int(state, "base_seed", -(1 << 63), (1 << 64) - 1)


_OWN_KEYS = frozenset({"class", "states", "exact", "why"})


def _check_own_state(state: dict, exp: Expected) -> None:
    """The "dataset" entry: the state a dataset keeps itself, of this loader's dataset."""
    record = state.get("dataset")
    if record is None:
        return
    if not isinstance(record, dict):
        raise _fail("dataset", record, "it must be a dict (the dataset's own state)", _FOREIGN)
    _keys_of(record, "dataset", _OWN_KEYS, frozenset(), state["format"])
    if exp.own_state is None:
        raise _fail("dataset.class", record["class"], "this loader's dataset keeps no state of "
                    "its own (no state_dict() and load_state_dict())", _FOREIGN)
    if record["class"] != exp.own_state:
        raise _fail("dataset.class", record["class"], f"this loader's dataset is a "
                    f"{exp.own_state}", _FOREIGN)
    if not isinstance(record["exact"], bool):
        raise _fail("dataset.exact", record["exact"], "it must be True or False", _FOREIGN)
    if not (record["states"] is None or isinstance(record["states"], list) and record["states"]):
        raise _fail("dataset.states", record["states"], "it must be None or a list of one "
                    "state per copy of the dataset", _FOREIGN)
    if not (record["why"] is None or isinstance(record["why"], str)):
        raise _fail("dataset.why", record["why"], "it must be None or a str", _FOREIGN)


def _check_epoch_record(state: dict, exp: Expected) -> None:
    """A "dataset_epoch" record is of an epoch in progress, for a dataset
    that takes one (its contents are the dataset's to check: record_len)."""
    if "dataset_epoch" not in state:
        return
    record = state["dataset_epoch"]
    if exp.epoch_record is None:
        raise _fail("dataset_epoch", "a record", "this loader's dataset records no epochs (the "
                    "state is of a dataset whose epoch a new job cannot take again: a remote "
                    "FileDataset with train_on='cached')", _FOREIGN)
    if state["complete"] or not isinstance(record, dict):
        raise _fail("dataset_epoch", type(record).__name__, "it must be a dict, of an epoch in "
                    "progress (complete=False)", _FOREIGN)


def _check_rng(state: dict, exp: Expected) -> None:
    for key, value in state["rng"].items():  # (its keys: _check_keys)
        if key not in exp.rng_bytes:
            raise _fail(_path("rng", key), f"{len(value) if isinstance(value, bytes) else value}",
                        "this loader has no such generator (a generator= or a sampler's "
                        "generator it was made without)", _FOREIGN)
        if not isinstance(value, bytes) or len(value) != exp.rng_bytes[key]:
            got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
            raise _fail(_path("rng", key), got, f"this loader's generator state is "
                        f"{exp.rng_bytes[key]} bytes", _FOREIGN)


def _check_map(state: dict, exp: Expected) -> None:
    progress = state.get("map")
    if not isinstance(progress, dict):
        raise _fail("map", progress, "a map-style epoch in progress has a dict of positions",
                    _FOREIGN)
    positions = _int(progress, "positions", name="map.positions")
    if exp.positions is not None and positions != exp.positions:
        raise _fail("map.positions", positions, f"an epoch of this loader has {exp.positions} "
                    f"(its dataset length, sampler, batch size, drop_last and ranks)", _FOREIGN)
    prefix = _int(progress, "done_prefix", 0, positions - 1, name="map.done_prefix")
    if state["format"] == STATE_FORMAT:
        _ranges("map.done_ranges", progress.get("done_ranges"), prefix + 1, positions)
    else:
        _positions("map.done_extra", progress.get("done_extra"), prefix + 1, positions)


def _ranges(field: str, values, low: int, high: int) -> None:
    """A list of [start, stop) pairs, increasing, apart, within [low, high]."""
    if not isinstance(values, list):
        raise _fail(field, values, "it must be a list of [start, stop) ranges", _FOREIGN)
    last = low - 1
    for r in values:
        ok = (isinstance(r, (list, tuple)) and len(r) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) for v in r))
        if not ok or not last < r[0] < r[1] <= high:
            raise _fail(field, values, f"it must hold increasing, separate [start, stop) ranges "
                        f"within [{low}, {high}]; {r!r} is not one", _FOREIGN)
        last = r[1]


def _check_stream(state: dict, exp: Expected) -> None:
    streams = state.get("stream")
    workers = exp.streams
    if not isinstance(streams, list) or len(streams) != workers:
        raise _fail("stream", streams, f"this loader reads {workers} streams: a list of one "
                    f"dict per stream", _FOREIGN)
    for w, s in enumerate(streams):
        if not isinstance(s, dict):
            raise _fail(f"stream[{w}]", s, "it must be a dict", _FOREIGN)
        _int(s, "batches", name=f"stream[{w}].batches")
        prefix = _int(s, "prefix", name=f"stream[{w}].prefix")
        _positions(f"stream[{w}].extra", s.get("extra"), prefix + 1, None)
