"""Which values a run of int indices takes, and the error for those it
does not.

NOTE [ Int indices ]
====================

The first index decides: an int or a numpy integer (not a bool) makes a
run of ints, held as int64, and dataset[...] gets each as a Python int
(the same sample: a numpy integer indexes as its value does).  Every later
index of that run, and every index of a batch sampler's batches, must be
an integer in Python's own sense: what operator.index takes (int, numpy
and torch integers, 0-d integer arrays), as a list dataset takes it in
torch.  Nothing else is converted: a float (2.7, 2.0), a str ("5"),
bytes, None, a bool or numpy bool (True indexes a numpy array as a mask,
not as 1) is a TypeError naming its position, the value and its type;
an integer outside int64 an IndexError.  np.fromiter, which this loader
used, silently made 2.7 -> 2, "5" -> 5, b"6" -> 6.  The check costs a
set of the chunk's types (a few ns per index); only values whose type is
not a plain int are looked at one by one.

A failure is kept (SamplerFeed.failure), and so are the sampler's own
exception (with the values it yielded before it: list.extend keeps
them) and a sized sampler ending before its len(): the indices before it
are fed, and no later pull happens, so that no index is ever stored at
another's position (a retried next() would pull the values after it into
the failed positions).  The next() of the batch that holds it raises it,
in every mode, after exactly the batches before it: with workers, main
stops LIMIT at the last whole batch before it (Runs.limit) and the epoch
raises it when the loop asks for the next one (MapEpoch.
_raise_feed_failure); with num_workers=0, the pull for that batch.  Every
later next() of the epoch raises it again; iter(loader) starts a new run
with a new feed.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np


def is_plain_int(t: type) -> bool:
    """Values of type t are ints as they are: int (and its subclasses but
    bool) and numpy's integer scalars."""
    return issubclass(t, (int, np.integer)) and not issubclass(t, bool)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class NotAnIntIndex(NamedTuple):
    """The first value of a pulled chunk that is not an int index."""
    at: int          # its place in the chunk
    value: object
    out_of_range: bool  # an integer, but not an int64


def as_int64(values: list) -> tuple[np.ndarray, NotAnIntIndex | None]:
    """(the int64s of `values` up to the first that is not an int index,
    that one or None): see NOTE [ Int indices ]."""
    odd = [t for t in set(map(type, values)) if not is_plain_int(t)]
    bad = None
    if odd:
        values, bad = _as_ints(values, frozenset(odd))
    try:
        return np.fromiter(values, np.int64, len(values)), bad
    except OverflowError:
        at = next(i for i, v in enumerate(values) if not _INT64_MIN <= v <= _INT64_MAX)
        return np.fromiter(values[:at], np.int64, at), NotAnIntIndex(at, values[at], True)


def _as_ints(values: list, odd: frozenset) -> tuple[list, NotAnIntIndex | None]:
    """values with those of the types in `odd` made ints by
    operator.index, up to the first it refuses (or a bool)."""
    out = list(values)
    for i, v in enumerate(values):
        if type(v) not in odd:
            continue
        if isinstance(v, (bool, np.bool_)):
            return out[:i], NotAnIntIndex(i, v, False)
        try:
            out[i] = operator.index(v)
        except TypeError:
            return out[:i], NotAnIntIndex(i, v, False)
    return out, None


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# what a run of ints asks of the indices a TypeError names, and what to do
SAMPLER_RULE = ("after an int index first: a sampler whose first index is an int must yield "
                "ints (or numpy or torch integers) throughout, and the loader converts no "
                "other value to one.  Yield int indices (int(x) if the integer part is "
                "meant), or make the first index a non-int too: then dataset[...] gets every "
                "index as it is, as torch passes it")
BATCH_RULE = ("a batch sampler's batches must hold ints (or numpy or torch integers), and "
              "the loader converts no other value to one: yield lists of ints (int(x) if "
              "the integer part is meant)")


def not_an_int_error(bad: NotAnIntIndex, what: str, where: str, rule: str) -> Exception:
    """The error for `bad`, yielded by `what` ("the sampler X") at `where`
    ("its position 7"); rule: SAMPLER_RULE or BATCH_RULE."""
    if bad.out_of_range:
        return IndexError(f"{what} yielded {shown(bad.value)} at {where}, an integer outside "
                          f"int64 [-2**63, 2**63), which a run of int indices holds: yield "
                          f"indices of the dataset")
    kind = type(bad.value)
    return TypeError(f"{what} yielded {shown(bad.value)} (a {kind.__module__}."
                     f"{kind.__qualname__}, not an int) at {where}, {rule}")
