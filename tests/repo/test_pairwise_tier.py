"""The default run's share of a `pairwise` grid (tests/support/pairwise.py):
every value, and every pair of values of the parameters that interact, is
in it; the choice is the same on every run."""

from itertools import combinations, product

from pairwise import covering_subset

MODES = [(0, "process"), (1, "process"), (1, "thread"), (2, "process"), (2, "thread")]
KINDS, SIZES, ORDERS = ["bucketed", "promoted", "both"], [1, 4, 32], [True, False]


def relayout_grid() -> list:
    """test_relayout_pool.py's grid, as parameters_of gives its cases."""
    return [{"kind": (k,), "batch_size": (b,), "workers,mode": m, "in_order": (o,)}
            for k, b, m, o in product(KINDS, SIZES, MODES, ORDERS)]


def pairs_of(cases: list, names) -> set:
    return {((a, case[a]), (b, case[b])) for case in cases for a, b in combinations(names, 2)}


def test_every_pair_of_values_meets_in_the_subset():
    grid = relayout_grid()
    kept = [grid[i] for i in covering_subset(grid)]
    assert pairs_of(kept, sorted(grid[0])) == pairs_of(grid, sorted(grid[0]))
    assert len(kept) == len(KINDS) * len(MODES)  # the least a pairwise cover can hold here


def test_among_names_the_parameters_whose_pairs_must_meet():
    grid = relayout_grid()
    kept = [grid[i] for i in covering_subset(grid, among=("kind", "in_order"))]
    assert pairs_of(kept, ["kind", "in_order"]) == pairs_of(grid, ["kind", "in_order"])
    for name in grid[0]:
        assert {case[name] for case in kept} == {case[name] for case in grid}, name
    only_values = [grid[i] for i in covering_subset(grid, among=())]
    assert len(only_values) == len(MODES)  # each value once: the most values of one parameter


def test_values_are_told_apart_by_identity_and_the_choice_is_the_same_every_time():
    unhashable = [dict(num_workers=0), dict(num_workers=2), dict(num_workers=2)]  # two equal
    grid = [{"mode": (m,), "sized": (s,)} for m, s in product(unhashable, ORDERS)]
    assert covering_subset(grid) == list(range(len(grid)))  # pairwise of two: the whole grid
    assert covering_subset(grid, among=()) == covering_subset(list(grid), among=()) == [0, 3, 4]
