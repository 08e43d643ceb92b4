"""Issue 29 item 2: datasets that keep their own state (torchdata's Stateful
protocol: state_dict() / load_state_dict(); MosaicML Streaming's
StreamingDataset counts its epochs itself).  The loader's state holds each
copy's state as it began the cut pass, and a resumed loader gives it back
before it loads: the rest of the cut epoch, exactly, then the following
epochs as the uninterrupted run.  Where that cannot be exact, an
InexactResumeWarning names the dataset.  See NOTE [ Datasets that keep
their own state ] in loader/datasets/own_state.py.  loader.DataLoader
beside torch's: tests/torch_layer/test_stateful_datasets.py."""

import warnings

import numpy as np
import pytest

from loader import InexactResumeWarning, ShmLoader, StateError
from epoch_rows import cut, epochs  # tests/support
from shared_datasets import CountsItsEpochs

pytestmark = pytest.mark.timeout(120)

N, BATCH = 96, 8
PER_EPOCH = N // BATCH

# process workers in both ordering modes and with a shuffle buffer (which
# delivers samples out of their stream order), one worker thread (main's
# copy, iterated by that thread), and the main process itself
MODES = {"processes": dict(num_workers=2),
         "processes first-ready": dict(num_workers=2, in_order=False),
         "processes, shuffle buffer": dict(num_workers=2, shuffle_buffer=20, seed=3),
         "a thread": dict(num_workers=1, worker_mode="thread"),
         "main": dict(num_workers=0)}


def make(dataset, mode, **kw):
    return ShmLoader(dataset, batch_size=BATCH, **MODES[mode], **kw)


def same_epoch(mode, got: list, expected: list) -> None:
    """In order: the same rows in the same order; first-ready, or the
    resumed part of an epoch with a shuffle buffer (whose rows are drawn
    again): each once."""
    if MODES[mode].get("in_order", True) and "shuffle_buffer" not in MODES[mode]:
        assert got == expected
    else:
        assert sorted(got) == sorted(expected) and len(set(got)) == len(got)


@pytest.mark.parametrize("cut_epoch", [0, 1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_dataset_that_counts_its_epochs_resumes_the_cut_one(mode, cut_epoch):
    """repro_dl_streaming_own_state_resume.py without Streaming: a state
    taken 5 batches into epoch `cut_epoch` resumes, in a loader over a new
    copy of the dataset (at its epoch 0), with the rest of that epoch, each
    sample once, then the next epoch as the uninterrupted run."""
    whole = make(CountsItsEpochs(N), mode)
    expected = epochs(whole, cut_epoch + 2)
    whole.close()
    assert expected[cut_epoch] != expected[cut_epoch + 1]  # the epochs differ

    first = make(CountsItsEpochs(N), mode)
    got, state = cut(first, cut_epoch, 5)
    first.close()
    assert {e for _, e in got} == {cut_epoch}
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactResumeWarning)
        resumed = make(CountsItsEpochs(N), mode)
        resumed.load_state_dict(state)
    rest, following = epochs(resumed, 2)
    resumed.close()
    same_epoch(mode, got + rest, expected[cut_epoch])
    assert sorted(i for i, _ in got + rest) == list(range(N))
    if MODES[mode].get("in_order", True):
        assert following == expected[cut_epoch + 1]
    else:
        same_epoch(mode, following, expected[cut_epoch + 1])


@pytest.mark.parametrize("mode", ["processes", "a thread", "main"])
def test_a_state_between_epochs_gives_the_next_its_own_state(mode):
    """A state taken once an epoch's iterator ended holds the state the
    next pass begins with (persistent workers: as each ended its part,
    which main may still be waiting for): the resumed loader's first epoch
    is the one after.  Taken after the last batch but before the iterator
    ended (an iterable dataset's end is known only then), it resumes an
    empty rest of the epoch, then the one after."""
    whole = make(CountsItsEpochs(N), mode)
    expected = epochs(whole, 3)
    whole.close()
    for ended in (True, False):
        first = make(CountsItsEpochs(N), mode)
        epochs(first, 1)
        it = iter(first)
        for _ in range(PER_EPOCH):
            next(it)
        if ended:
            assert next(it, None) is None
        state = first.state_dict()
        first.close()
        assert state["complete"] is ended
        resumed = make(CountsItsEpochs(N), mode)
        resumed.load_state_dict(state)
        got = epochs(resumed, 1 if ended else 2)
        resumed.close()
        assert got == ([] if ended else [[]]) + [expected[2]]


def test_without_persistent_workers_each_pass_begins_from_mains_copy():
    """Workers made anew for each pass begin it from main's copy of the
    dataset (which they never change), as torch's do: every epoch is the
    dataset's epoch 0, resumed or not, and a state between passes holds
    nothing to load."""
    loader = make(CountsItsEpochs(N), "processes", persistent_workers=False)
    expected = epochs(loader, 2)
    assert expected[0] == expected[1]
    got, state = cut(loader, 1, 3)
    loader.close()
    resumed = make(CountsItsEpochs(N), "processes", persistent_workers=False)
    resumed.load_state_dict(state)
    rest = epochs(resumed, 1)[0]
    between = resumed.state_dict()
    resumed.close()
    assert got + rest == expected[0]
    assert between["dataset"]["states"] is None and between["dataset"]["exact"]


class Versioned:
    """Map-style: sample i is [i, version]; the version is its state, which
    loading samples never changes (as an epoch counted between passes)."""

    def __init__(self, version, n=N):
        self.version, self.n = version, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.array([i, self.version])

    def state_dict(self):
        return {"version": self.version}

    def load_state_dict(self, state):
        self.version = state["version"]


@pytest.mark.parametrize("resumed_workers", [2, 3])
@pytest.mark.parametrize("mode", ["processes", "processes first-ready", "a thread", "main"])
def test_a_map_style_datasets_state_is_given_to_every_copy(mode, resumed_workers):
    """The resumed loader's dataset is made with version 0; the state gives
    every copy (each worker's, or main's) version 3 back before the rest of
    the cut epoch loads.  Copies that all had the same state resume with
    any number of workers, without a warning."""
    first = make(Versioned(3), mode, shuffle=True, seed=1)
    got, state = cut(first, 1, 4)
    first.close()
    kwargs = dict(MODES[mode], shuffle=True, seed=1)
    if kwargs["num_workers"] > 1:
        kwargs["num_workers"] = resumed_workers
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactResumeWarning)
        resumed = ShmLoader(Versioned(0), batch_size=BATCH, **kwargs)
        resumed.load_state_dict(state)
    rest = epochs(resumed, 1)[0]
    resumed.close()
    assert {v for _, v in got + rest} == {3}
    assert sorted(i for i, _ in got + rest) == list(range(N))


class Drawing(Versioned):
    """Map-style, with a state that moves as samples load: a generator."""

    def __init__(self, n=N):
        super().__init__(0, n)
        self.rng = np.random.default_rng(0)

    def __getitem__(self, i):
        return np.array([i, int(self.rng.integers(1 << 30))])

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


@pytest.mark.parametrize("mode", ["processes", "main"])
def test_a_state_that_moves_as_samples_load_is_said_inexact(mode):
    """Each copy's state is restored as it began the pass, so what a
    generator gives the remaining samples may differ: load_state_dict()
    says so, naming the dataset; the remaining samples are still exactly
    the rest of the epoch, each once."""
    first = make(Drawing(), mode)
    got, state = cut(first, 0, 4)
    first.close()
    assert state["dataset"]["exact"] is False
    resumed = make(Drawing(), mode)
    with pytest.warns(InexactResumeWarning, match=r"test_own_state\.Drawing cannot resume "
                                                  r"exactly: its state moved"):
        resumed.load_state_dict(state)
    rest = epochs(resumed, 1)[0]
    resumed.close()
    assert sorted(i for i, _ in got + rest) == list(range(N))


def test_worker_threads_sharing_an_iterable_copy_are_said_inexact():
    """Two worker threads iterate main's one copy: no state of it says
    where each stream is, and load_state_dict() says so; the samples that
    follow are the stream replayed from the copy as it is made."""
    first = ShmLoader(CountsItsEpochs(N), batch_size=BATCH, num_workers=2, worker_mode="thread")
    _, state = cut(first, 0, 2)
    first.close()
    assert state["dataset"]["states"] is None
    resumed = ShmLoader(CountsItsEpochs(N), batch_size=BATCH, num_workers=2,
                        worker_mode="thread")
    with pytest.warns(InexactResumeWarning, match=r"CountsItsEpochs cannot resume exactly: its "
                      r"one copy is shared by 2 worker threads"):
        resumed.load_state_dict(state)
    resumed.close()


class NeedsArguments(CountsItsEpochs):
    """A state_dict() that takes arguments, not Streaming's (those:
    test_resumes_itself.py)."""

    def state_dict(self, step, rank):
        return {"epoch": self.epoch, "step": step}


def test_a_state_the_loader_cannot_take_is_said_so_at_resume():
    first = make(NeedsArguments(N), "processes")
    got, state = cut(first, 1, 3)
    first.close()
    assert state["dataset"]["states"] is None and not state["dataset"]["exact"]
    resumed = make(NeedsArguments(N), "processes")
    with pytest.warns(InexactResumeWarning, match=r"test_own_state\.NeedsArguments cannot "
                      r"resume exactly: its state_dict\(\) takes arguments \(step, rank\)"):
        resumed.load_state_dict(state)
    resumed.close()


def test_states_of_other_datasets_are_refused_and_old_ones_said_inexact():
    """A dataset's state given to a loader whose dataset keeps none, or is
    of another class, is a StateError naming the field, the loader left as
    it was; a state without one (an older version's) resumes with a
    warning."""
    first = make(Versioned(3), "processes")
    _, state = cut(first, 0, 2)
    first.close()
    plain = ShmLoader(np.arange(N), batch_size=BATCH, num_workers=2)
    with pytest.raises(StateError, match=r"field 'dataset.class' is '.*Versioned', but this "
                                         r"loader's dataset keeps no state of its own"):
        plain.load_state_dict(state)
    assert len([b for b in plain]) == PER_EPOCH
    plain.close()
    other = make(Renamed(3), "processes")
    with pytest.raises(StateError, match=r"field 'dataset.class'.*this loader's dataset is a "
                                         r"test_own_state.Renamed"):
        other.load_state_dict(state)
    other.close()
    old = {k: v for k, v in state.items() if k != "dataset"}
    resumed = make(Versioned(0), "processes")
    with pytest.warns(InexactResumeWarning, match="the state holds no state of it"):
        resumed.load_state_dict(old)
    rest = epochs(resumed, 1)[0]
    resumed.close()
    assert {v for _, v in rest} == {0} and len(rest) == N - 2 * BATCH


class Renamed(Versioned):
    """Another class: a state of Versioned is not its."""


class FailsToSay(Versioned):
    def state_dict(self):
        raise RuntimeError("no state today")


def test_a_state_dict_that_raises_is_raised_in_main_naming_the_dataset():
    loader = make(FailsToSay(1), "processes")
    with pytest.raises(RuntimeError, match="no state today"):
        list(loader)
    loader.close()
