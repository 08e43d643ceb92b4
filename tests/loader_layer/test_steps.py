"""ShmLoader.steps(n): n batches across epoch boundaries, advancing epochs
(and their shuffles) as it goes, going on where the last call stopped,
and resumable (issue 9)."""

import itertools

import numpy as np
import pytest

from loader import ShmLoader

pytestmark = pytest.mark.timeout(60)


def make(**kw):
    return ShmLoader(np.arange(50), batch_size=8, shuffle=True, seed=2, num_workers=2, **kw)


def epochs_of(n):
    with make() as loader:
        return [b.tolist() for _ in range(n) for b in loader]


def test_steps_cross_epoch_boundaries_in_the_epochs_order():
    full = epochs_of(4)              # 7 batches an epoch
    with make() as loader:
        got = [b.tolist() for b in loader.steps(17)]
        assert got == full[:17]
        assert [b.tolist() for b in loader.steps(5)] == full[17:22]   # goes on mid-epoch
        assert [b.tolist() for b in loader.steps(0)] == []
        assert [b.tolist() for b in itertools.islice(loader.steps(), 6)] == full[22:28]


def test_steps_resume_from_a_state_taken_between_calls():
    full = epochs_of(4)
    with make() as loader:
        list(loader.steps(10))
        state = loader.state_dict()
    with make(in_order=True) as resumed:
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed.steps(12)] == full[10:22]


def test_steps_over_an_empty_epoch_say_so():
    with ShmLoader(np.arange(3), batch_size=4, drop_last=True, num_workers=2) as loader:
        with pytest.raises(ValueError, match="yielded no batch"):
            next(loader.steps())
    with pytest.raises(ValueError, match="n must be"):
        next(make().steps(-1))
