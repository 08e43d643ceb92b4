"""Planning a run: which indices, in which order, how positions fall into
batches and what the workers claim (NOTE [ Runs ] in shared/control.py).

`plan_run` decides it from the loader's spec (`LoaderSpec`, shared/spec.py, as
it stands now: its ranks, workers and seed), the epoch, a state
to resume (NOTE [ Resuming an epoch ] in order/progress.py) and the seeds main
drew; it touches no process and no shared memory, so it is tested on its
own (tests/loader_layer/test_planning.py).  What it may do is pull a
user's sampler: drawn whole, or wrapped in a feed that main pulls as the
run's LIMIT moves (NOTE [ Streamed samplers ] in order/feed.py).
`settled_plan` gives an open run (a sampler without len()) its length
once its sampler has ended, and `limit` says how far workers may load.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np

from loader.shared import control as _control
from loader.shared.spec import LoaderSpec
from loader.order import indices as _order
from loader.order.progress import MapProgress, StreamProgress
from loader.order.feed import (BatchFeed, ObjectFeed, SamplerFeed, int_indices,
                                  sampler_length)


class Plan(NamedTuple):
    """What main decided about one run: see NOTE [ Runs ]."""
    epoch: int
    size: int                  # the dataset's length (a computed order), or the shipped
                               # order's; -1 iterable
    kept: int                  # positions delivered
    units: int                 # what workers claim
    nbatches: int              # -1 iterable
    order_kind: int
    order_seed: int
    shipped: np.ndarray | None  # the order written out for the workers (iterable: skips)
    base_seed: int
    rng: dict                  # generator states at the epoch's start (state_dict)
    progress: object           # MapProgress or StreamProgress of the run
    snapshot: object = None    # the dataset's snapshot of the epoch (FileDataset: its files)
    remaining: _order.Remaining | None = None  # a resumed computed order: the positions left
    feed: SamplerFeed | BatchFeed | None = None  # a streamed sampler (NOTE [ Streamed samplers ])
    claims_batches: bool = False  # workers claim whole batches (UNITS are batches)
    own: Any = None            # RunStates: a dataset that keeps its own state, its copies'
                               # states (NOTE [ Datasets that keep their own state ])
    own_load: list | None = None  # the states its copies load before the run
    pass_start: Any = None     # a dataset that resumes itself: its state as the run's pass
                               # begins (NOTE [ Datasets that resume themselves ])


class _Order(NamedTuple):
    """Where a map-style run's order comes from, before resuming."""
    kind: int
    seed: int
    size: int
    shipped: np.ndarray | None = None
    stream: Any = None         # a sampler's indices, pulled as LIMIT moves
    batch_stream: Any = None   # a batch sampler's batches, pulled as LIMIT moves
    length: int | None = None  # len(sampler), if it has one
    pulling: Any = None        # what every pull of stream or batch_stream runs inside

    @property
    def fed(self) -> bool:
        """Pulled as LIMIT moves (a feed), not written out whole."""
        return self.stream is not None or self.batch_stream is not None


def plan_run(spec: LoaderSpec, *, epoch: int, resume, base_seed: int,
             rng: dict) -> Plan:
    """The plan of epoch's run; with `resume` (a LoaderState, main/state.py),
    of what the state says is left of it.  base_seed and rng: what main
    drew for the epoch."""
    if spec.iterable:
        return _stream_plan(spec, epoch, resume, base_seed, rng)
    order = _order_source(spec)
    kept = _kept(spec, order)
    if order.shipped is not None:  # drop_last's short batch
        order = order._replace(shipped=order.shipped[:kept])
    open_ended = order.fed and (order.length is None or order.batch_stream is not None)
    if open_ended:  # its length is learnt when the sampler ends (settled_plan)
        kept = _order.OPEN_POSITIONS
    done = remaining = None
    if resume is not None:  # the epoch's remaining positions, in its order
        done = MapProgress.done_of(resume.map)
        positions = resume.map["positions"]
        if positions != kept and not open_ended:
            raise ValueError(f"this state is of an epoch of {positions} samples, but the "
                             f"loader's epoch {epoch} has {kept}: load it into a loader of "
                             f"the same dataset, sampler and batching")
        remaining = _order.Remaining(kept, *done.state())
        order, kept = _resumed(order, kept, remaining)
    feed, geometry = _feed_and_geometry(spec, order, kept, remaining)
    nbatches = (kept if spec.batch_size is None or order.batch_stream is not None
                else -(-kept // spec.batch_size))
    units = nbatches if spec.claims_batches else kept
    if units >= 1 << _control.RUN_SHIFT:  # the cursor counts a run's units in 32 bits
        raise ValueError(f"an epoch of {kept:,} samples is {units:,} units for the workers "
                         f"to claim, and a run holds fewer than 2**32: pass a larger "
                         f"batch_size with a collate_fn (workers then claim whole batches), "
                         f"or split the dataset")
    epoch_positions = kept if resume is None or open_ended else resume.map["positions"]
    progress = MapProgress(epoch_positions, done, remaining, geometry, spec.per_batch)
    computed = order.kind in (_order.ORDER_RANGE, _order.ORDER_PERMUTATION)
    return Plan(epoch=epoch, size=order.size, kept=kept, units=units, nbatches=nbatches,
                order_kind=order.kind, order_seed=order.seed, shipped=order.shipped,
                base_seed=base_seed, rng=rng, progress=progress,
                remaining=remaining if computed else None, feed=feed,
                claims_batches=spec.claims_batches)


def _stream_plan(spec: LoaderSpec, epoch: int, resume, base_seed: int,
                 rng: dict) -> Plan:
    """An iterable dataset's run: each worker's stream; resumed, the samples
    each stream skips (shipped)."""
    progress = StreamProgress(spec.streams, spec.rows,
                              None if resume is None else resume.stream)
    skips = None if resume is None else progress.skips()
    return Plan(epoch=epoch, size=-1, kept=-1 if skips is None else len(skips), units=-1,
                nbatches=-1,
                order_kind=_order.ORDER_RANGE if skips is None else _order.ORDER_SHIPPED,
                order_seed=0, shipped=skips, base_seed=base_seed, rng=rng,
                progress=progress)


def _order_source(spec: LoaderSpec) -> _Order:
    """A user's batch sampler or sampler (streamed, or drawn whole), torch's
    shuffle of a generator, or an order the workers compute (NOTE [ Runs ])."""
    SHIPPED = _order.ORDER_SHIPPED
    if spec.batch_sampler is not None:
        # streamed, its batches pulled as LIMIT moves: OPEN, as the positions
        # it covers are known only once it ends, even with a len()
        it, pulling = _pulled(spec, spec.batch_sampler)
        return _Order(SHIPPED, 0, _order.OPEN_POSITIONS, batch_stream=it, pulling=pulling)
    if spec.sampler is not None:
        return _sampler_order(spec)
    if spec.shuffle and spec.generator is not None:
        import torch

        # torch's RandomSampler(generator=...) yields randperm(n) of its
        # generator (and draws the next randperm only once exhausted,
        # which this loader, like np.fromiter of it, never asks for):
        # the same draw, in one call, with no Python int per index
        n = spec.dataset_len()
        shipped = torch.randperm(n, generator=spec.generator).numpy()
        shipped = _order.shard(shipped, spec.rank, spec.world)
        return _Order(SHIPPED, 0, len(shipped), shipped=shipped)
    # computed by the workers from the dataset's length (SIZE), then cut
    # into this rank's share
    if spec.shuffle:
        return _Order(_order.ORDER_PERMUTATION, _order.order_seed_word(spec.seed),
                      spec.dataset_len())
    return _Order(_order.ORDER_RANGE, 0, spec.dataset_len())


def _sampler_order(spec: LoaderSpec) -> _Order:
    """A user's sampler: streamed when its indices are ints (without len():
    to a provisional bound until it ends, OPEN), else drawn whole; torch's
    own samplers under loader.DataLoader are drawn in one call."""
    length = sampler_length(spec.sampler)
    it, pulling = _pulled(spec, spec.sampler)
    if isinstance(it, np.ndarray):  # torch's own sampler, drawn in one call
        return _Order(_order.ORDER_SHIPPED, 0, len(it), shipped=it, length=length)
    with pulling or contextlib.nullcontext():
        ints, stream = int_indices(it)
    # indices of other kinds (keys, tuples): dataset[...] gets them as they are
    kind = _order.ORDER_SHIPPED if ints else _order.ORDER_OBJECTS
    size = _order.OPEN_POSITIONS if length is None else length
    return _Order(kind, 0, size, stream=stream, length=length, pulling=pulling)


def _pulled(spec: LoaderSpec, sampler):
    """(an iterator of the sampler, what each pull of it runs inside or
    None).  loader.DataLoader's samplers are drawn as torch draws them
    (NOTE [ Drawing the order as torch does ] in torch/order.py): `draw()`
    gives an int64 array for torch's own samplers, drawn in one call (and
    None), else the iterator and its generator sandbox."""
    if spec.torch_rules:
        return sampler.draw()
    return iter(sampler), None


def _kept(spec: LoaderSpec, order: _Order) -> int:
    """Positions of this rank's share the run delivers (drop_last drops a
    short last batch)."""
    computed = order.kind in (_order.ORDER_RANGE, _order.ORDER_PERMUTATION)
    share = _order.shard_size(order.size, spec.world) if computed else order.size
    if spec.batch_size is None:
        return share
    return _order.kept_of(share, spec.batch_size, spec.drop_last)


def _resumed(order: _Order, kept: int, remaining: _order.Remaining) -> tuple[_Order, int]:
    """The order of what is left of a resumed epoch, and its positions.  A
    shipped order is written out anyway: write out what is left of it.  A
    computed order stays computed: the workers get the few numbers of
    `remaining` (NOTE [ The seeded order ]); a streamed sampler skips the
    delivered positions as it is pulled (each batch of a batch sampler
    keeping its positions not delivered)."""
    shipped, seed, size = order.shipped, order.seed, order.size
    if shipped is not None:
        remap = remaining.original(np.arange(remaining.count, dtype=np.int64))
        shipped = np.ascontiguousarray(shipped[:kept][remap], np.int64)
        seed, size = 0, remaining.count
    kept = remaining.count
    if order.fed:
        size = kept
    return order._replace(seed=seed, size=size, shipped=shipped), kept


def _feed_and_geometry(spec: LoaderSpec, order: _Order, kept: int, remaining):
    """(the streamed sampler's feed or None, how the run's positions fall
    into batches)."""
    if order.batch_stream is not None:
        feed = BatchFeed(order.batch_stream, spec.sampler_name, kept, remaining, order.pulling)
        return feed, feed.batches()
    geometry = _order.Batches(kept, spec.rows)
    if order.stream is not None:
        feed_type = ObjectFeed if order.kind == _order.ORDER_OBJECTS else SamplerFeed
        return feed_type(order.stream, spec.sampler_name, order.length, kept, remaining,
                         order.pulling), geometry
    return None, geometry


def settled_plan(plan: Plan, spec: LoaderSpec) -> Plan | None:
    """An OPEN plan (a sampler without len()) whose sampler has ended, with
    its final length (and its progress told it); None otherwise."""
    feed = plan.feed
    if feed is None or feed.settled:
        return None
    end = feed.end(spec.batch_size, spec.drop_last)
    if end is None:
        return None
    feed.settled = True
    epoch_kept, kept = end
    if isinstance(feed, BatchFeed):
        nbatches = feed.batches_fed
        batches = _order.Batches(kept, spec.rows, feed.offsets[:nbatches + 1].copy())
    else:
        nbatches = kept if spec.batch_size is None else -(-kept // spec.batch_size)
        batches = _order.Batches(kept, spec.rows)
    units = nbatches if plan.claims_batches else kept
    plan.progress.kept = epoch_kept
    plan.progress.batches = batches
    return plan._replace(size=kept, kept=kept, units=units, nbatches=nbatches)


def offsets_word(plan: Plan) -> int:
    """OFFSETS (NOTE [ Runs ]): a batch sampler's offsets are streamed."""
    return _order.OFFSETS_STREAMED if isinstance(plan.feed, BatchFeed) else 0


def order_of(plan: Plan, rank: int, world: int):
    """The order of a map-style plan's run: its shipped indices, its feed,
    or a computed order (None: the position is the index)."""
    if plan.shipped is not None:
        return plan.shipped
    if plan.feed is not None:
        return plan.feed
    return _order.computed_order(plan.order_kind, plan.size, plan.order_seed, plan.epoch,
                                 rank, world, plan.kept, plan.remaining)


def run_indices(plan: Plan, rank: int, world: int) -> np.ndarray | None:
    """The dataset indices a map-style run loads, position by position (an
    int64 array), or None for a streamed feed (its indices come as LIMIT
    moves) or an order of keys rather than ints."""
    if plan.feed is not None:
        return None
    order = order_of(plan, rank, world)
    if order is None:
        return np.arange(plan.kept, dtype=np.int64)
    if isinstance(order, np.ndarray):
        return order[:plan.kept] if order.dtype.kind in "iu" else None
    return order[0:len(order)]
