"""LoaderSpec (shared/spec.py): ShmLoader's arguments checked once into one
frozen record that every part of the loader takes (issue 27, item 1).  A
parameter is its signature's and a field of the spec, and nothing more;
the attributes read the spec and cannot be set behind the planner's and
the workers' backs; what changes at run time changes in LiveSpec only."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from loader import ShmLoader
from loader.shared.spec import (RUN_TIME_FIELDS, SHM_RULES, TORCH_RULES, LiveSpec, LoaderSpec,
                                public_fields)

pytestmark = pytest.mark.timeout(120)

DERIVED = {"auto", "seed_given", "iterable", "rules"}  # set by the checks, not passed


def parameters() -> list[str]:
    return list(inspect.signature(ShmLoader.__init__).parameters)[1:]


def test_every_parameter_is_a_spec_field_and_every_field_a_parameter_or_derived():
    """Adding a parameter touches two places: the signature and the spec
    (a parameter missing from either fails here, and ShmLoader() itself
    fails on it: check_arguments passes every parameter by its name)."""
    names = {f.name for f in dataclasses.fields(LoaderSpec)}
    assert set(parameters()) == names - DERIVED - set(RUN_TIME_FIELDS) | {"num_workers", "seed"}
    assert set(public_fields()) == set(parameters()) - {"trace"} | {"auto", "iterable"}


def test_arguments_are_read_only_attributes_and_the_loader_stays_usable():
    data = np.arange(64)
    with ShmLoader(data, batch_size=8, num_workers=2, seed=3) as ld:
        assert (ld.batch_size, ld.num_workers, ld.seed, ld.prefetch, ld.iterable, ld.auto) == \
            (8, 2, 3, 3, False, False)
        for name, value in (("batch_size", 4), ("shuffle", True), ("num_workers", 0)):
            with pytest.raises(AttributeError, match=rf"ShmLoader\.{name} is fixed when the "
                                                     rf"loader is made .* make a new ShmLoader "
                                                     rf"with {name}={value!r}"):
                setattr(ld, name, value)
        assert [b.tolist() for b in ld] == [list(range(k, k + 8)) for k in range(0, 64, 8)]
        assert ld.batch_size == 8


def test_the_spec_is_frozen_and_keyword_only():
    fields = dataclasses.fields(LoaderSpec)
    with pytest.raises(TypeError, match="positional"):
        LoaderSpec(*[None] * len(fields))
    made = _spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.batch_size = 2


def _spec(**kw) -> LoaderSpec:
    base = dict(dataset=range(10), batch_size=4, shuffle=False, sampler=None, batch_sampler=None,
                num_workers=2, collate_fn=None, drop_last=False, in_order=True, prefetch=3,
                persistent_workers=True, worker_init_fn=None, seed=7, generator=None,
                reproducible=False, timeout=None, output="numpy", pin_memory=False,
                memory_cap_bytes=1 << 30, distributed=False, shuffle_buffer=0,
                worker_mode="process", max_workers=0, trace=None, start_method="fork",
                auto=False, seed_given=True,
                iterable=False)
    base.update(kw)
    return LoaderSpec(**base)


class Fetches:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return i

    def __getitems__(self, indices):
        return list(indices)


@pytest.mark.parametrize("kw, workers_claim, inline_claims", [
    ({}, False, False),
    ({"collate_fn": list}, True, True),            # per batch: a collate_fn
    ({"batch_size": None}, True, True),            # per batch: unbatched
    ({"rules": TORCH_RULES}, True, False),         # torch's whole batches, with workers only
    ({"dataset": Fetches()}, True, False),         # __getitems__, with workers only
    ({"rules": TORCH_RULES, "iterable": True}, False, False),
])
def test_claims_batches_is_one_fact_for_planning_and_for_the_processes(kw, workers_claim,
                                                                       inline_claims):
    """What was two definitions (PlanRules' and LoaderConfig's) is one: a
    run's units are batches for a collate_fn or batch_size=None always, and
    for torch's rules or a dataset's __getitems__ when workers load."""
    assert _spec(**kw).claims_batches is workers_claim
    assert _spec(num_workers=0, **kw).claims_batches is inline_claims


def test_run_time_fields_change_in_live_spec_only_and_each_change_is_a_new_spec():
    live = LiveSpec(_spec())
    given = live.now
    assert live.update(num_workers=2) is given  # no change: the same spec
    now = live.update(num_workers=3, seed=11)
    assert (now.num_workers, now.seed, now.streams) == (3, 11, 3)
    assert (given.num_workers, given.seed) == (2, 7)  # what a component was given never changes
    with pytest.raises(AttributeError, match=r"\['batch_size'\] are fixed when the loader is made"):
        live.update(batch_size=8)
    assert live.now is now and given.rules is SHM_RULES


def test_a_loaded_state_changes_the_seed_every_part_reads():
    """load_state_dict() of a state of another seed, into a loader without
    one: the loader's seed, and the order its planner and workers compute,
    are the state's (the rest of the epoch exactly as the seeded loader's)."""
    data = np.arange(96)
    with ShmLoader(data, batch_size=8, num_workers=2, seed=5, shuffle=True) as seeded:
        it = iter(seeded)
        head = [next(it).tolist() for _ in range(4)]
        state = seeded.state_dict()
        rest = [b.tolist() for b in it]
    with ShmLoader(data, batch_size=8, num_workers=2, shuffle=True) as resumed:
        assert resumed.seed != 5
        resumed.load_state_dict(state)
        assert resumed.seed == 5
        got = [b.tolist() for b in resumed]
    assert got == rest and len(head) == 4
    assert sorted(v for b in head + got for v in b) == list(range(96))
