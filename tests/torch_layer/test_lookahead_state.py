"""A state taken through a wrapper that pulls batches ahead of the training
loop counts only what the loop received (NOTE [ A state through a
look-ahead wrapper ] in loader/main/lookahead.py): freeze_state() before
each look-ahead, thaw_state() when the pass ends.  Checked with a wrapper
written as Ray Train's device mover is (one batch ahead), and with Ray's
own mover as loader.torch.integrations.ray subclasses it, without a cluster."""

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from loader import DataLoader, ShmLoader  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, BATCH = 200_000, 500     # 400 batches an epoch


class Ids:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Stream(torch.utils.data.IterableDataset):
    """Each worker its own numbers: i * workers + worker id, below N."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(w, N, n))


class OneAhead:
    """Ray's _WrappedDataLoader's look-ahead (a batch pulled at iter() and
    inside each __next__ before the held one is returned), freezing the
    loader's state before each pull as loader.torch.integrations.ray's does."""

    def __init__(self, loader, freeze=True):
        self.loader, self.freeze = loader, freeze

    def __iter__(self):
        self.it = iter(self.loader)
        self._pull()
        return self

    def _pull(self):
        if self.freeze:
            self.loader.freeze_state()
        self.held = next(self.it, None)
        if self.held is None and self.freeze:
            self.loader.thaw_state()

    def __next__(self):
        batch = self.held
        if batch is None:
            raise StopIteration
        self._pull()
        return batch

    def state_dict(self):
        return self.loader.state_dict()


def _ids(batch) -> list:
    return np.asarray(batch).tolist()


MAKERS = {
    "DataLoader-shuffle": lambda: DataLoader(Ids(), batch_size=BATCH, shuffle=True,
                                             generator=torch.Generator().manual_seed(3),
                                             num_workers=2),
    "ShmLoader-shuffle": lambda: ShmLoader(Ids(), batch_size=BATCH, shuffle=True, seed=3,
                                           num_workers=2),
    "ShmLoader-first-ready": lambda: ShmLoader(Ids(), batch_size=BATCH, shuffle=True, seed=3,
                                               num_workers=2, in_order=False),
    "DataLoader-stream": lambda: DataLoader(Stream(), batch_size=BATCH, num_workers=2),
}


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
@pytest.mark.parametrize("k", [1, 157])
def test_a_state_through_a_look_ahead_wrapper_resumes_every_sample_once(make, k):
    """k batches into the first epoch of 200,000 samples, the state taken
    through the wrapper (which has pulled batch k+1 already): the resumed
    epoch gives the rest, so the epoch is every sample exactly once; the
    next epoch is then complete too.  Without freeze_state() the same
    state loses the look-ahead batch (the old behaviour, kept as the
    reason for the rule)."""
    for freeze in (True, False):
        loader = make()
        wrapped = OneAhead(loader, freeze)
        it = iter(wrapped)
        head = [i for _ in range(k) for i in _ids(next(it))]
        state = pickle.loads(pickle.dumps(wrapped.state_dict()))
        loader.close()
        resumed = make()
        resumed.load_state_dict(state)
        rest = [i for b in OneAhead(resumed) for i in _ids(b)]
        if not freeze:
            assert len(head) + len(rest) == N - BATCH  # the batch pulled ahead: lost
            resumed.close()
            continue
        assert len(head) == k * BATCH and len(head) + len(rest) == N
        assert sorted(head + rest) == list(range(N))
        following = [i for b in OneAhead(resumed) for i in _ids(b)]
        assert sorted(following) == list(range(N))
        resumed.close()


def test_a_frozen_state_is_kept_until_thawed_or_iterated_again():
    """freeze_state() pins state_dict() (a copy each time) until
    thaw_state() or a new iter() of the loader itself; load_state_dict()
    pins the loaded state until the resumed pass begins, so a checkpoint
    taken right after a restore keeps the position (it used to say "the
    epoch is over", and the resumed run skipped the rest of it)."""
    for make in (lambda: DataLoader(Ids(), batch_size=BATCH, num_workers=2),
                 lambda: ShmLoader(Ids(), batch_size=BATCH, num_workers=2)):
        loader = make()
        it = iter(loader)
        next(it)
        loader.freeze_state()
        pinned = loader.state_dict()
        next(it)
        assert loader.state_dict() == pinned and pinned["map"]["done_prefix"] == BATCH
        loader.state_dict()["map"]["done_prefix"] = -1  # the caller's copy, not the pin
        assert loader.state_dict() == pinned
        loader.thaw_state()
        assert loader.state_dict()["map"]["done_prefix"] == 2 * BATCH
        del it
        loader.close()
        restored = make()
        restored.load_state_dict(pinned)
        assert restored.state_dict() == pinned
        it = iter(restored)
        assert [i for b in it for i in _ids(b)] == list(range(BATCH, N))
        assert restored.state_dict()["complete"] is True
        restored.freeze_state()
        it = iter(restored)
        first = _ids(next(it))
        assert first == list(range(BATCH))
        state = restored.state_dict()  # thawed by iter(): the new epoch's first batch
        assert (state["epoch"], state["map"]["done_prefix"]) == (pinned["epoch"] + 1, BATCH)
        del it
        restored.close()


def test_rays_device_mover_as_the_integration_subclasses_it():
    """ray.train.torch's _WrappedDataLoader, subclassed by
    loader.torch.integrations.ray (what prepare_data_loader returns with
    move_to_device=True), on a DataLoader and a ShmLoader: its state_dict()
    counts the batches the loop received, load_state_dict() resumes the
    rest exactly once, and a pass run to its end leaves the state complete."""
    pytest.importorskip("ray.train.torch")
    from loader.torch.integrations.ray import wrapper_class

    mover = wrapper_class()
    for make in (MAKERS["DataLoader-shuffle"], MAKERS["ShmLoader-shuffle"]):
        wrapped = mover(make(), torch.device("cpu"), False)
        it = iter(wrapped)
        head = [i for _ in range(5) for i in _ids(next(it))]
        state = wrapped.state_dict()
        assert state["map"]["done_prefix"] == 5 * BATCH
        wrapped.close()
        resumed = mover(make(), torch.device("cpu"), False)
        resumed.load_state_dict(state)
        rest = [i for b in resumed for i in _ids(b)]
        assert sorted(head + rest) == list(range(N))
        assert resumed.state_dict()["complete"] is True
        resumed.close()
