"""What one loader is: `LoaderSpec`, its arguments checked once
(main/arguments.py) with every fact derived from them defined here once,
and `LiveSpec`, the few fields that change while it runs.

Every part of the loader takes the spec, never the loader: the planner,
the runs, the session, the epochs (main/), the workers (worker/) and the
batcher (batcher/), which inherit it when they are forked.  Adding a
parameter to ShmLoader touches two places: its signature (main/loader.py)
and a field here (with its check in main/arguments.py if it needs one).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any

from loader.datasets.own_state import keeps_state, resumes_itself, why_state_cannot_be_taken
from loader.worker.fetch import batch_fetcher


@dataclass(frozen=True)
class Rules:
    """Where ShmLoader's ways and torch DataLoader's differ, the loader's
    choice, fixed when it is made (loader.DataLoader's ShmLoader takes
    TORCH_RULES; NOTE [ Drawing the order as torch does ] in
    torch/order.py).  torch=True: workers seeded as torch seeds them,
    whole batches per worker, the base seed drawn as the iterator is made,
    samplers drawn as torch draws them, torch's collate structure, torch's
    words first in a worker's death, no run ahead into the next epoch, and
    none of ShmLoader's own warnings (stalls, pin_memory without CUDA)."""
    torch: bool


SHM_RULES = Rules(torch=False)
TORCH_RULES = Rules(torch=True)

# the fields that change while a loader runs: see LiveSpec
RUN_TIME_FIELDS = ("num_workers", "seed", "rank", "world", "parent_pid")


@dataclass(frozen=True, kw_only=True)
class LoaderSpec:
    """ShmLoader's arguments after checking (its docstring says what each
    is), and what follows from them."""
    dataset: Any
    batch_size: int | None       # None: samples one by one, unbatched
    shuffle: bool
    sampler: Any
    batch_sampler: Any
    num_workers: int             # "auto": the workers now (LiveSpec)
    collate_fn: Any
    drop_last: bool
    in_order: bool
    prefetch: int                # batches loaded ahead of main (iterable: shared by streams)
    persistent_workers: bool
    worker_init_fn: Any
    seed: int                    # load_state_dict() may change it (LiveSpec)
    generator: Any
    reproducible: bool           # seed the generators before every sample
    timeout: float | None
    output: str
    pin_memory: bool
    memory_cap_bytes: int
    distributed: bool | tuple
    shuffle_buffer: int          # 0: none
    worker_mode: str
    max_workers: int             # num_workers="auto": the most workers there can be (else 0)
    trace: Any                   # a TraceLog (trace=PATH): NOTE [ Trace records ]
    start_method: str            # "spawn": NOTE [ Starting clean ] in shared/passable.py
    # derived by the checks
    auto: bool                   # num_workers="auto"
    seed_given: bool             # else a resumed state brings its own
    iterable: bool
    rules: Rules = SHM_RULES
    # fixed as the processes start (LiveSpec)
    rank: int = 0                # distributed: this process's share of each epoch
    world: int = 1
    parent_pid: int = 0          # the process that forked the children (0: threads)

    # --- the shape of a batch and of a run ------------------------------------------------

    @property
    def torch_rules(self) -> bool:
        return self.rules.torch

    @property
    def passable(self) -> bool:
        """Shared memory must be reachable by descriptor (start_method="spawn")."""
        return self.start_method == "spawn" and not self.threads

    @property
    def rows(self) -> int:
        """Samples per batch (1 unbatched: batch_size=None)."""
        return 1 if self.batch_size is None else self.batch_size

    @property
    def streams(self) -> int:
        """Workers' shares of a run: an iterable dataset's streams, the
        strides of whole batches in order, the LIMIT words (one, for
        num_workers=0)."""
        return max(self.num_workers, 1)

    @property
    def threads(self) -> bool:
        return self.worker_mode == "thread"

    @property
    def per_batch(self) -> bool:
        """Workers load and collate whole batches (a collate_fn, as torch
        runs it, or batch_size=None) instead of placing samples in rows."""
        return self.collate_fn is not None or self.batch_size is None

    @property
    def whole_batches(self) -> bool:
        """A worker loads whole batches of samples (torch's way): in order,
        worker w batches w, w + W, ...; else as claimed."""
        return self.rules.torch and not self.iterable

    @functools.cached_property
    def batched_fetch(self) -> bool:
        """One dataset.__getitems__ call per batch (NOTE [ Batched fetch ]
        in worker/fetch.py)."""
        return batch_fetcher(self.dataset, self.batch_size, self.iterable) is not None

    @property
    def claims_batches(self) -> bool:
        """A map-style run's units are batches, not positions: a worker
        claims a whole batch (workers only: num_workers=0 loads in main)."""
        return self.per_batch or (self.num_workers > 0
                                  and (self.whole_batches or self.batched_fetch))

    def runs_ahead(self) -> bool:
        """Can the next epoch start before this one ends?  Not when the
        next order is the user's to make (a sampler, which may wait for
        set_epoch(); an iterable dataset), nor without persistent workers,
        nor for DataLoader (torch draws its seeds at iter(), maybe after
        the user reseeded the generator)."""
        return (self.persistent_workers and self.sampler is None and self.batch_sampler is None
                and not self.iterable and not self.rules.torch)

    # --- the dataset and the samplers ------------------------------------------------------

    def dataset_len(self) -> int:
        dataset = self.dataset
        try:
            return len(dataset)
        except TypeError:
            raise TypeError(f"this map-style dataset ({type(dataset).__name__}) has no "
                            f"__len__: pass a sampler that says which indices to load") from None

    def map_len(self) -> int | None:
        """The dataset's length (None: iterable, or none)."""
        if self.iterable:
            return None
        try:
            return len(self.dataset)
        except TypeError:
            return None

    @property
    def sampler_name(self) -> str | None:
        s = self.batch_sampler if self.batch_sampler is not None else self.sampler
        return None if s is None else getattr(s, "sampler_name", type(s).__name__)

    # --- a dataset that keeps its own state (NOTE [ Datasets that keep their own state ]) -

    def dataset_copies(self) -> tuple[int, bool, int, bool]:
        """What RunStates takes: (copies of the dataset, whether main takes
        their state itself, worker threads iterating main's copy of an
        iterable one, whether the copy is main's object): one per worker
        process; a worker thread's stream reports as a process's does;
        else main's copy."""
        if self.num_workers > 0 and not self.threads:
            return self.num_workers, False, 0, False
        if self.num_workers > 0 and self.iterable:
            return 1, False, 0 if self.num_workers == 1 else self.num_workers, True
        return 1, True, 0, True

    def takes_own_state(self) -> bool:
        return keeps_state(self.dataset) and why_state_cannot_be_taken(self.dataset) is None

    def resumes_itself(self) -> bool:
        """An iterable dataset keeping MosaicML Streaming's protocol (NOTE
        [ Datasets that resume themselves ])."""
        return self.iterable and resumes_itself(self.dataset)

    @property
    def own_state(self) -> bool:
        """Do the workers report their copies' states (not main)?"""
        _, in_main, shared_by, _ = self.dataset_copies()
        return self.takes_own_state() and not in_main and not shared_by

    # --- how much is in flight ------------------------------------------------------------

    @property
    def worker_prefetch(self) -> int:
        """Iterable datasets: batches each worker may fill ahead of main."""
        return max(1, -(-self.prefetch // self.streams))

    @property
    def shuffle_batches(self) -> int:
        """shuffle_buffer: the batches of each worker's window (its share of
        the buffer, in batches)."""
        if not self.shuffle_buffer:
            return 0
        share = -(-self.shuffle_buffer // self.streams)
        return max(1, -(-share // self.rows))

    @property
    def slabs_to_progress(self) -> int:
        """The fewest batches in memory at once that let loading go on.  A
        shuffle buffer fills each worker's window of `shuffle_batches`
        batches at once; memory goes to batches in order (NOTE [ Memory
        goes to batches in order ] in batcher/runs.py), so one worker with
        its whole window, and every other short of one, is enough: the
        first completes its lowest batch, and main moves out what it holds
        back of it until its turn."""
        if not self.shuffle_batches:
            return 1
        return self.streams * (self.shuffle_batches - 1) + 1

    @property
    def publish_window(self) -> int:
        """How many batches past those sent the batcher lays out ahead:
        workers load units below main's limit, `prefetch` batches past what
        it has yielded, plus one claim each that waits; two more batches
        of slack let the next be ready as the window moves.  (Iterable
        datasets: per worker, past that worker's batches sent.)"""
        if self.iterable:
            return self.worker_prefetch + self.shuffle_batches + 2
        return self.prefetch + 2

    @property
    def slabs_in_flight(self) -> int:
        """The slabs a steady loop keeps alive, which the batcher faults in
        ahead (NOTE [ Warming the arena ]): map-style, `prefetch` loading, one
        laid out past main's limit and two the loop holds as next() hands
        out a batch (runs started ahead share the prefetch); iterable, two
        runs' windows and those two."""
        if self.iterable:
            return 2 * self.publish_window + 2
        return self.prefetch + 3

    @property
    def table_per_run(self) -> int:
        """Batch table entries per run.  A multiple of the worker count, so
        that the batches of an iterable run's workers (ids j * W + w) never
        share an entry across workers, and large enough for the batches in
        flight (see NOTE [ Runs ])."""
        w = self.streams
        return w * max(-(-64 // w), -(-2 * self.publish_window // w),
                       self.worker_prefetch + self.shuffle_batches + 3)


class LiveSpec:
    """The spec as it stands now.  Only RUN_TIME_FIELDS change, and only
    here: the workers (num_workers="auto" grows and shrinks the pool), the
    seed (load_state_dict() takes a state's), the ranks and the parent's
    pid (taken as the processes start: torchrun may have initialised its
    process group since the loader was made).  Each change makes a new
    frozen spec: what a component was given never changes under it (the
    processes keep the spec they were started with)."""

    def __init__(self, spec: LoaderSpec):
        self.now = spec

    def update(self, **changes) -> LoaderSpec:
        unknown = set(changes) - set(RUN_TIME_FIELDS)
        if unknown:
            raise AttributeError(f"LoaderSpec fields {sorted(unknown)} are fixed when the loader "
                                 f"is made")
        if any(getattr(self.now, k) != v for k, v in changes.items()):
            self.now = replace(self.now, **changes)
        return self.now


def public_fields() -> tuple[str, ...]:
    """The spec's fields a ShmLoader shows as its read-only attributes:
    its arguments (but trace, which the spec holds opened: a TraceLog, not
    the path given), and whether its dataset is iterable and its workers
    "auto"."""
    hidden = {"seed_given", "rules", "rank", "world", "parent_pid", "trace"}
    return tuple(f.name for f in fields(LoaderSpec) if f.name not in hidden)
