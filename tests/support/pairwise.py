"""The default run's share of a parametrized grid (`@pytest.mark.pairwise`).

A test marked `pairwise` keeps in the default run a subset of its grid in which
every value of every parameter appears, and every pair of values of two
parameters meets at least once (of the parameters named in `among=`, if the
marker names some: those that interact; the others need only each value).  The
rest of the grid is marked `stress` (the long tier, `python -m pytest -m
stress`), so the two tiers together still run every case.  conftest.py's
`pytest_collection_modifyitems` applies it; this module only chooses.

Parameters given together (`parametrize("workers,mode", MODES)`) count as
one, whose values are MODES' entries.  Values are told apart by identity (a
parametrize list's values are the same objects in every case), so they need
not be hashable, and their reprs (an object's address) play no part.  The choice is greedy (the case that covers
most of what is still missing, the earliest on a tie) over the grid in its
collected order: the same on every run and in every xdist worker, which must
all collect the same tests.
"""

from __future__ import annotations

from itertools import combinations


def parameters_of(item) -> dict:
    """A parametrized test item's case: {parameter: value}, parameters given
    together in one parametrize as one, their values as a tuple."""
    params, case = item.callspec.params, {}
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if all(name in params for name in names):
            case[",".join(names)] = tuple(params[name] for name in names)
    given = {name for names in case for name in names.split(",")}
    case.update({name: (value,) for name, value in params.items() if name not in given})
    return case


def _numbered(cases: list) -> list:
    """Each case as {parameter: the number of its value}, values numbered
    in the order they first appear."""
    seen = {}
    def number(name, value):
        values = seen.setdefault(name, [])
        for i, known in enumerate(values):
            if len(known) == len(value) and all(a is b for a, b in zip(known, value)):
                return i
        values.append(value)
        return len(values) - 1
    return [{name: number(name, value) for name, value in case.items()} for case in cases]


def _what_a_case_covers(case: dict, among) -> set:
    names = sorted(case)
    singles = {((name, case[name]),) for name in names}
    paired = [name for name in names if among is None or name in among]
    pairs = {((a, case[a]), (b, case[b])) for a, b in combinations(paired, 2)}
    return singles | pairs


def covering_subset(cases: list, among=None) -> list:
    """Positions in `cases` (each {parameter: tuple of values}, as
    parameters_of gives them) of a subset that holds
    every value, and every pair of values of two parameters in `among` (all
    of them if None; a parameter given together with others is named as in
    its parametrize, "workers,mode") that some case holds together."""
    covers = [_what_a_case_covers(case, among) for case in _numbered(cases)]
    missing = set().union(*covers)
    chosen = []
    while missing:
        best = max(range(len(cases)), key=lambda i: (len(covers[i] & missing), -i))
        chosen.append(best)
        missing -= covers[best]
    return sorted(chosen)
