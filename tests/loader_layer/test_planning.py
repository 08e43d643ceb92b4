"""plan_run() on its own: a run's order, positions, batches and units,
decided from a LoaderSpec without a process or shared memory (order/planning.py)."""

from __future__ import annotations

import numpy as np
import pytest

from loader.order import indices as _order
from loader.order.planning import order_of, plan_run, settled_plan
from loader.shared.spec import SHM_RULES, TORCH_RULES, LoaderSpec
from loader.order.feed import BatchFeed, ObjectFeed, SamplerFeed


def rules(n=10, *, per_batch=False, torch_rules=False, **kw) -> LoaderSpec:
    """A spec over a dataset of n (per_batch: with a collate_fn, whose
    workers claim whole batches)."""
    base = dict(dataset=range(n), batch_size=4, shuffle=False, sampler=None, batch_sampler=None,
                num_workers=2, collate_fn=list if per_batch else None, drop_last=False,
                in_order=True, prefetch=3, persistent_workers=True, worker_init_fn=None, seed=7,
                generator=None, reproducible=False, timeout=None, output="numpy",
                pin_memory=False, memory_cap_bytes=1 << 30, distributed=False, shuffle_buffer=0,
                worker_mode="process", max_workers=0, trace=None, start_method="fork",
                auto=False, seed_given=True,
                iterable=False, rules=TORCH_RULES if torch_rules else SHM_RULES)
    base.update(kw)
    return LoaderSpec(**base)


def plan(r: LoaderSpec, resume=None):
    return plan_run(r, epoch=3, resume=resume, base_seed=11, rng={})


def test_a_range_order_of_ten_in_batches_of_four():
    p = plan(rules(10))
    assert (p.order_kind, p.size, p.kept, p.nbatches, p.units) == (_order.ORDER_RANGE, 10, 10, 3,
                                                                  10)
    assert (p.epoch, p.base_seed, p.shipped, p.feed) == (3, 11, None, None)
    assert [_order.index_getter(order_of(p, 0, 1))(i) for i in range(10)] == list(range(10))


def test_drop_last_and_whole_batch_claims():
    p = plan(rules(10, drop_last=True, per_batch=True))
    assert (p.kept, p.nbatches, p.units, p.claims_batches) == (8, 2, 2, True)


def test_a_seeded_shuffle_is_computed_and_sharded_by_formula():
    shares = []
    for rank in range(3):
        p = plan(rules(1001, shuffle=True, rank=rank, world=3, batch_size=None))
        assert p.order_kind == _order.ORDER_PERMUTATION and p.shipped is None
        assert p.order_seed == _order.order_seed_word(7) and p.kept == p.nbatches
        get = _order.index_getter(order_of(p, rank, 3))
        shares.append([get(i) for i in range(p.kept)])
    assert [len(s) for s in shares] == [334] * 3  # equal shares, padded as torch pads
    joined = [i for s in shares for i in s]
    assert set(joined) == set(range(1001)) and len(joined) == 1002


def test_a_sized_sampler_streams_its_int_indices_and_its_keys():
    p = plan(rules(sampler=[5, 3, 9, 1, 0]))
    assert isinstance(p.feed, SamplerFeed) and p.shipped is None
    assert (p.order_kind, p.kept, p.nbatches) == (_order.ORDER_SHIPPED, 5, 2)
    keys = plan(rules(sampler=[("a", 1), ("b", 2), None]))
    assert isinstance(keys.feed, ObjectFeed) and keys.shipped is None
    assert (keys.order_kind, keys.kept, keys.nbatches) == (_order.ORDER_OBJECTS, 3, 1)
    keys.feed.feed(3)  # num_workers=0: the window, as a list
    assert [keys.feed[i] for i in range(3)] == [("a", 1), ("b", 2), None]


def test_a_sampler_without_len_is_open_until_it_ends():
    class NoLen:
        def __iter__(self):
            return iter(range(9))

    r = rules(sampler=NoLen())
    p = plan(r)
    assert p.kept == _order.OPEN_POSITIONS and isinstance(p.feed, SamplerFeed)
    assert settled_plan(p, r) is None  # nothing pulled yet
    p.feed.feed(p.kept)  # pulled to its end
    settled = settled_plan(p, r)
    assert (settled.kept, settled.nbatches, settled.units) == (9, 3, 9)


class Drawn:
    """What loader.DataLoader gives ShmLoader as its sampler (TorchOrder):
    draw() -> (an iterator, what each pull runs inside), here a context
    that records the items pulled inside it."""

    def __init__(self, items):
        self.items, self.inside, self.pulled_inside = items, False, []

    def __len__(self):
        return len(self.items)

    def draw(self):
        def pull():
            for item in self.items:
                assert self.inside, "pulled outside its context"
                self.pulled_inside.append(item)
                yield item
        return pull(), self

    def __enter__(self):
        self.inside = True

    def __exit__(self, *exc):
        self.inside = False


def test_a_batch_sampler_streams_its_batches():
    p = plan(rules(batch_size=1, batch_sampler=[[4, 2], [7], [1, 3, 5]]))
    assert isinstance(p.feed, BatchFeed) and p.kept == _order.OPEN_POSITIONS
    # loader.DataLoader's batch sampler streams too, each pull inside its context
    drawn = Drawn([[4, 2], [7], [1, 3, 5]])
    r = rules(batch_size=1, batch_sampler=drawn, torch_rules=True)
    p = plan(r)
    assert isinstance(p.feed, BatchFeed) and p.kept == _order.OPEN_POSITIONS
    assert drawn.pulled_inside == []  # nothing pulled before LIMIT asks
    p.feed.feed_batches(4)
    assert drawn.pulled_inside == [[4, 2], [7], [1, 3, 5]] and not drawn.inside
    settled = settled_plan(p, r)
    assert settled.nbatches == 3 and settled.kept == 6
    assert p.feed.offsets[:4].tolist() == [0, 2, 3, 6]
    assert [p.feed.index(i) for i in range(6)] == [4, 2, 7, 1, 3, 5]


def test_a_dataloader_sampler_streams_inside_its_context_unless_drawn_in_one_call():
    drawn = Drawn([5, 3, 9, 1, 0])
    p = plan(rules(sampler=drawn, torch_rules=True))
    assert isinstance(p.feed, SamplerFeed) and p.shipped is None and p.kept == 5
    assert drawn.pulled_inside == [5]  # its first index: is it an int?
    p.feed.feed(5)
    assert drawn.pulled_inside == [5, 3, 9, 1, 0] and p.feed.window.tolist() == [5, 3, 9, 1, 0]

    class OneCall(Drawn):
        def draw(self):
            return np.asarray(self.items, np.int64), None

    whole = plan(rules(sampler=OneCall([2, 0, 1]), torch_rules=True))
    assert whole.feed is None and whole.shipped.tolist() == [2, 0, 1]


def test_a_run_past_the_cursor_width_is_refused_with_the_remedy():
    with pytest.raises(ValueError, match="pass a larger batch_size with a collate_fn"):
        plan(rules(1 << 33, batch_size=None))


def test_an_iterable_datasets_run_is_one_stream_per_worker():
    p = plan(rules(iterable=True, num_workers=3))
    assert (p.size, p.kept, p.units, p.nbatches, p.order_kind) == (-1, -1, -1, -1,
                                                                  _order.ORDER_RANGE)
    assert np.array_equal(np.asarray(p.progress.first_batches()), np.zeros(3))
