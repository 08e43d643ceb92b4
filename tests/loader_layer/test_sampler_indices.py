"""Issue 28 item 6: a sampler's indices are never converted.  A run whose
first index is an int holds ints; a later float, str, bytes, None or bool
(np.fromiter made 2.7 -> 2, "5" -> 5, b"6" -> 6) is a TypeError naming its
position, the value and its type, raised by the next() whose batch holds
it, after exactly the batches before it; again at every next() of that
epoch; and a new iter() starts afresh.  Integers in Python's own sense
(operator.index: numpy and torch integers) load as the same sample.  See
NOTE [ Int indices ] in loader/order/int_indices.py."""

from __future__ import annotations

import decimal
import enum
import operator

import numpy as np
import pytest

from loader import ShmLoader
from shared_datasets import Ids

pytestmark = pytest.mark.timeout(120)

MODES = {"inline": dict(num_workers=0), "processes": dict(num_workers=2),
         "threads": dict(num_workers=2, worker_mode="thread"),
         "first-ready": dict(num_workers=2, in_order=False)}


class Turns:
    """range(n), but `value` at position `at` in its first iteration only
    (the next epoch is good: the loader must be usable after the error);
    no len()."""

    def __init__(self, n: int, at: int, value):
        self.n, self.at, self.value = n, at, value
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        first = self.iterations == 1
        for i in range(self.n):
            yield self.value if first and i == self.at else i


class SizedTurns(Turns):
    def __len__(self):
        return self.n


class IntsOnly(Ids):
    """Sample i is i, and dataset[...] must get a Python int (a run of ints
    hands every index over as one)."""

    def __getitem__(self, i):
        assert type(i) is int, f"dataset[...] got {i!r} ({type(i).__name__})"
        return i


def delivered_then_error(ld, error=TypeError):
    """(the batches an epoch delivers before it raises `error`, the error's
    text); the next next() must raise it again."""
    it = iter(ld)
    got = []
    with pytest.raises(error) as raised:
        for b in it:
            got.append(np.asarray(b).copy())
    with pytest.raises(error) as again:
        next(it)
    assert str(again.value) == str(raised.value)
    return got, str(raised.value)


def flat(batches) -> np.ndarray:
    return np.concatenate(batches) if batches else np.zeros(0, np.int64)


# --- every kind of non-int, after ints ----------------------------------------------

class Colour(enum.Enum):
    RED = 3


NOT_INTS = [2.7, 2.0, "5", b"6", None, True, False, np.bool_(True), np.float64(3.0),
            np.float32(1.5), decimal.Decimal(3), [3], (3,), Colour.RED, np.array(3.0),
            np.array([3])]


@pytest.mark.parametrize("value", NOT_INTS, ids=[repr(v) for v in NOT_INTS])
def test_a_non_int_after_ints_is_a_type_error_naming_it(value):
    """Position 300 of 1,000 (batches of 100, two worker processes):
    exactly the 3 batches before it, then a TypeError naming the position,
    the value, its type and what to do; the next epoch (the sampler is good
    again) whole."""
    with ShmLoader(IntsOnly(1000), sampler=SizedTurns(1000, 300, value), batch_size=100,
                   num_workers=2) as ld:
        got, text = delivered_then_error(ld)
        assert np.array_equal(flat(got), np.arange(300)) and len(got) == 3
        for words in ("the sampler SizedTurns", f"yielded {value!r}", "at its position 300",
                      f"{type(value).__qualname__}, not an int", "int(x)",
                      "make the first index a non-int"):
            assert words in text, text
        assert np.array_equal(flat([np.asarray(b) for b in ld]), np.arange(1000))


INTEGERS = [np.int8(7), np.int32(7), np.uint8(7), np.uint64(7), np.int64(7), np.array(7),
            enum.IntEnum("Small", "A B C D E F G")(7)]


@pytest.mark.parametrize("mode", ["inline", "processes"])
def test_integers_of_every_kind_after_ints_load_their_sample(mode):
    """numpy integers, a 0-d integer array, an IntEnum (and a torch
    integer, where torch is installed): each loads the sample of its value,
    and dataset[...] gets a Python int."""
    values = list(INTEGERS)
    try:
        import torch
        values += [torch.tensor(7), torch.tensor(7, dtype=torch.uint8)]
    except ImportError:
        pass
    order = [i for v in values for i in (1, v)]
    assert [operator.index(v) for v in order] == [1, 7] * len(values)
    with ShmLoader(IntsOnly(10), sampler=order, batch_size=2, **MODES[mode]) as ld:
        assert [np.asarray(b).tolist() for b in ld] == [[1, 7]] * len(values)


@pytest.mark.parametrize("mode", ["inline", "processes"])
@pytest.mark.parametrize("value", [1 << 63, -(1 << 63) - 1, np.uint64(1 << 63)],
                         ids=["2**63", "-2**63-1", "uint64 2**63"])
def test_an_integer_outside_int64_is_an_index_error(mode, value):
    with ShmLoader(IntsOnly(1000), sampler=SizedTurns(1000, 250, value), batch_size=50,
                   **MODES[mode]) as ld:
        got, text = delivered_then_error(ld, IndexError)
    assert np.array_equal(flat(got), np.arange(250))
    assert f"yielded {value!r} at its position 250" in text and "int64" in text, text


# --- every mode, past the first window --------------------------------------------------

# the default run: every mode once and both samplers (each value: the test
# names no pair of them); all 8 with -m stress
@pytest.mark.pairwise(among=())
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("sized", [True, False], ids=["len", "no-len"])
def test_a_non_int_far_into_a_long_sampler_in_every_mode(mode, sized):
    """"5" at position 100,000 of 300,000 (batches of 100), with and
    without len() (an OPEN run), in processes, threads, first-ready and
    inline (which pulls 65,536 indices at a time: the chunk holding it is
    pulled long before): exactly the 1,000 batches before it (first-ready:
    the first 100,000 indices, each once), then the TypeError; a new iter()
    gives the whole next epoch, in order."""
    n, at = 300_000, 100_000
    sampler = (SizedTurns if sized else Turns)(n, at, "5")
    with ShmLoader(Ids(n), sampler=sampler, batch_size=100, **MODES[mode]) as ld:
        got, text = delivered_then_error(ld)
        assert len(got) == 1000 and all(len(b) == 100 for b in got)
        if mode == "first-ready":
            assert np.array_equal(np.sort(flat(got)), np.arange(at))
        else:
            assert np.array_equal(flat(got), np.arange(at))
        assert "yielded '5' (a builtins.str, not an int) at its position 100000" in text, text
        whole = flat([np.asarray(b).copy() for b in ld])
    if mode == "first-ready":
        whole = np.sort(whole)
    assert np.array_equal(whole, np.arange(n))


@pytest.mark.parametrize("mode", ["inline", "processes"])
def test_the_first_index_decides_and_others_reach_the_dataset_as_they_are(mode):
    """A sampler whose first index is not an int: every index reaches
    dataset[...] as it is (as torch passes it), ints and non-ints alike;
    2.7 is not 2."""
    order = [2.7, 1, "5", b"6", (3, 4)]
    with ShmLoader(Ids(10), sampler=order, batch_size=None, **MODES[mode]) as ld:
        got = list(ld)
    assert got == order and type(got[1]) is int


# --- a batch sampler ------------------------------------------------------------------

class TurningBatches:
    """Batches of 10 of range(n); place `place` of batch `k` is `value` in
    its first iteration; no len()."""

    def __init__(self, n: int, k: int, place: int, value):
        self.n, self.k, self.place, self.value = n, k, place, value
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        for b in range(self.n // 10):
            batch = list(range(10 * b, 10 * b + 10))
            if self.iterations == 1 and b == self.k:
                batch[self.place] = self.value
            yield batch


class SizedTurningBatches(TurningBatches):
    def __len__(self):
        return self.n // 10


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("mode", ["inline", "processes", "threads"])
@pytest.mark.parametrize("sized", [True, False], ids=["len", "no-len"])
@pytest.mark.parametrize("value", [2.5, "7", np.float64(4.0)], ids=["float", "str", "np-float"])
def test_a_batch_sampler_with_a_non_int_names_its_batch_and_place(mode, sized, value):
    """30,000 indices in batches of 10; place 3 of batch 1,500 (position
    15,003, past the first 1,024 batches pulled at once): exactly the 1,500
    batches before it, then the TypeError; the next epoch whole."""
    n = 30_000
    sampler = (SizedTurningBatches if sized else TurningBatches)(n, 1_500, 3, value)
    with ShmLoader(Ids(n), batch_sampler=sampler, **MODES[mode]) as ld:
        got, text = delivered_then_error(ld)
        assert len(got) == 1_500 and np.array_equal(flat(got), np.arange(15_000))
        assert (f"yielded {value!r} (a {type(value).__module__}.{type(value).__qualname__}, "
                f"not an int) at place 3 of its batch 1500 (the epoch's position 15003)"
                in text), text
        assert "lists of ints" in text
        assert np.array_equal(flat([np.asarray(b).copy() for b in ld]), np.arange(n))


@pytest.mark.parametrize("mode", ["inline", "processes"])
def test_a_batch_sampler_of_integer_arrays_loads_them_and_refuses_others(mode):
    batches = [[0, np.int32(1)], np.array([2, 3], np.uint16), np.array([4, 5])]
    try:
        import torch
        batches.append(torch.tensor([6, 7]))
    except ImportError:
        batches.append([6, 7])
    with ShmLoader(IntsOnly(10), batch_sampler=batches, **MODES[mode]) as ld:
        assert [np.asarray(b).tolist() for b in ld] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for bad, words in [(np.array([2.0, 3.0]), "yielded np.float64(2.0)"),
                       (np.array([True, False]), "yielded np.True_ (a numpy.bool, not an int)"),
                       (7, "yielded 7 (a int) as its batch 1, which is not a sequence")]:
        with ShmLoader(IntsOnly(10), batch_sampler=[[0, 1], bad], **MODES[mode]) as ld:
            got, text = delivered_then_error(ld)
        assert [b.tolist() for b in got] == [[0, 1]] and words in text, text


# --- the sampler's own error -----------------------------------------------------------

class Raises:
    """range(n), raising LookupError at position `at` (its own error,
    which must reach the loop as it is)."""

    def __init__(self, n: int, at: int):
        self.n, self.at = n, at

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            if i == self.at:
                raise LookupError(f"no index at {i}")
            yield i


@pytest.mark.parametrize("mode", ["inline", "processes"])
def test_a_sampler_raising_mid_epoch_loses_and_shifts_nothing(mode):
    """The sampler's own LookupError at position 1,234 (batches of 100): the
    12 batches before it exactly, then that LookupError, again at the next
    next() (a retried pull would have put the indices after it at its
    positions)."""
    with ShmLoader(Ids(5000), sampler=Raises(5000, 1234), batch_size=100,
                   **MODES[mode]) as ld:
        got, text = delivered_then_error(ld, LookupError)
    assert np.array_equal(flat(got), np.arange(1200)) and "no index at 1234" in text


# --- resuming ------------------------------------------------------------------------

class AlwaysBad(SizedTurns):
    """SizedTurns whose bad value comes in every iteration."""

    def __iter__(self):
        for i in range(self.n):
            yield self.value if i == self.at else i


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bad_at, delivered_to", [(7_000, 7_000), (3_000, 5_000)],
                         ids=["after-the-state", "among-the-delivered"])
def test_a_resumed_epoch_checks_the_sampler_it_pulls_again(workers, bad_at, delivered_to):
    """A state taken 50 batches (5,000 indices) into an epoch of 10,000; the
    resumed loader pulls the sampler again from its start: a float at
    7,000 is the TypeError after exactly the 20 batches from 5,000; one at
    3,000, among the positions skipped as delivered, is refused at the
    first batch (the sampler must yield ints throughout)."""
    n, B = 10_000, 100
    with ShmLoader(Ids(n), sampler=AlwaysBad(n, n, 0), batch_size=B,  # (never: at n)
                   num_workers=workers) as ld:
        it = iter(ld)
        head = [next(it).copy() for _ in range(50)]
        state = ld.state_dict()
        del it
    assert np.array_equal(flat(head), np.arange(5000))
    with ShmLoader(Ids(n), sampler=AlwaysBad(n, bad_at, 1.5), batch_size=B,
                   num_workers=workers) as ld:
        ld.load_state_dict(state)
        got, text = delivered_then_error(ld)
    assert np.array_equal(flat(got), np.arange(5000, delivered_to))
    assert f"yielded 1.5 (a builtins.float, not an int) at its position {bad_at}" in text


# --- loader.DataLoader ----------------------------------------------------------------

def _torch_sampler(n, at, value, draws):
    import torch

    class Drawn(torch.utils.data.Sampler):
        """A permutation of range(n) from its generator (or range(n)), with
        `value` at position `at` in its first iteration."""

        def __init__(self):
            self.generator = torch.Generator().manual_seed(5) if draws else None
            self.iterations = 0

        def __len__(self):
            return n

        def __iter__(self):
            self.iterations += 1
            order = (torch.randperm(n, generator=self.generator).tolist() if draws
                     else list(range(n)))
            if self.iterations == 1:
                order[at] = value
            return iter(order)

    return Drawn()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("draws", [False, True], ids=["fixed", "generator"])
def test_dataloader_refuses_a_non_int_as_shmloader_does(workers, draws):
    """loader.DataLoader with a sampler (pulled in its generator sandbox
    when it draws) and with a batch sampler: the batches before position
    2,500 of 10,000, then the TypeError naming it; the next epoch whole."""
    torch = pytest.importorskip("torch")
    from loader import DataLoader

    n, at = 10_000, 2_500
    sampler = _torch_sampler(n, at, 2.5, draws)
    expect = (torch.randperm(n, generator=torch.Generator().manual_seed(5)).numpy() if draws
              else np.arange(n))
    loaders = [DataLoader(Ids(n), sampler=sampler, batch_size=100, num_workers=workers),
               DataLoader(Ids(n), num_workers=workers, batch_sampler=torch.utils.data.
                          BatchSampler(_torch_sampler(n, at, 2.5, draws), 100, False))]
    for ld in loaders:
        try:
            got, text = delivered_then_error(ld)
            assert len(got) == 25 and np.array_equal(flat(got), expect[:at])
            assert "yielded 2.5 (a builtins.float, not an int)" in text, text
            assert f"position {at}" in text
            assert sum(len(b) for b in ld) == n
        finally:
            ld._shm_loader().close()
