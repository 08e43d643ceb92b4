"""Issue 29 item 2: datasets that resume themselves (MosaicML Streaming's
StreamingDataset: an epoch counter and a loaded state in memory all its
copies share, one order per epoch over all workers, state_dict(num_samples,
from_beginning) in main).  A state taken mid-epoch resumes, in a loader over
a new copy (a new process's: at epoch 0), with exactly the rest of the cut
epoch, then the following epochs as the uninterrupted run; where the
delivered samples are not the first of the dataset's order, an
InexactResumeWarning says why.  See NOTE [ Datasets that resume themselves ]
in loader/datasets/own_state.py; the real Streaming:
tests/torch_layer/test_streaming_resume.py."""

import numpy as np
import pytest

from loader import InexactResumeWarning, ShmLoader
from loader.order.progress import StreamProgress
from epoch_rows import cut, epochs, rows  # tests/support
from shared_datasets import ResumesItself

pytestmark = pytest.mark.timeout(120)

N, BATCH = 96, 8
PER_EPOCH = N // BATCH

MODES = {"processes": dict(num_workers=2),
         "persistent processes": dict(num_workers=2, persistent_workers=True),
         "one process": dict(num_workers=1),
         "a thread": dict(num_workers=1, worker_mode="thread"),
         "main": dict(num_workers=0)}


def make(dataset, mode, **kw):
    return ShmLoader(dataset, batch_size=BATCH, **MODES[mode], **kw)


def expected(epoch: int, shuffle: bool = True) -> list:
    """The uninterrupted run's epoch: the dataset's order, round-robin."""
    return [(int(i), epoch) for i in ResumesItself(N, BATCH, shuffle).order(epoch)]


def resume(mode, state, shuffle=True):
    """A loader over a new copy of the dataset (a new process's), resumed."""
    resumed = make(ResumesItself(N, BATCH, shuffle), mode)
    resumed.load_state_dict(state)  # (warnings are errors: none)
    return resumed


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cut_epoch", [0, 1, 2])
def test_a_state_mid_epoch_resumes_the_rest_of_it(mode, cut_epoch):
    """repro_dl_streaming_own_state_resume.py without Streaming: 5 batches
    into epoch `cut_epoch`, then a new copy resumes with the other 7, the
    same as the uninterrupted run, then the next epoch."""
    assert expected(cut_epoch) != expected(cut_epoch + 1)
    first = make(ResumesItself(N, BATCH), mode)
    got, state = cut(first, cut_epoch, 5)
    first.close()
    assert state["dataset"]["states"] == [{"epoch": cut_epoch, "sample_in_epoch": 5 * BATCH}]
    resumed = resume(mode, state)
    rest, following = epochs(resumed, 2)
    resumed.close()
    assert got + rest == expected(cut_epoch)
    assert following == expected(cut_epoch + 1)


@pytest.mark.parametrize("mode", ["processes", "main"])
def test_without_shuffle_and_resumed_twice(mode):
    """Every epoch in the same order; a state taken in a resumed epoch
    counts from where that resume began (from_beginning=False)."""
    first = make(ResumesItself(N, BATCH, shuffle=False), mode)
    got, state = cut(first, 1, 3)
    first.close()
    second = resume(mode, state, shuffle=False)
    it = iter(second)
    got += [r for _ in range(4) for r in rows(next(it))]
    state = second.state_dict()
    second.close()
    assert state["dataset"]["states"] == [{"epoch": 1, "sample_in_epoch": 7 * BATCH}]
    third = resume(mode, state, shuffle=False)
    rest, following = epochs(third, 2)
    third.close()
    assert got + rest == expected(1, shuffle=False)
    assert following == expected(2, shuffle=False)


@pytest.mark.parametrize("mode", ["processes", "persistent processes", "main"])
def test_a_state_between_passes_resumes_with_the_next_epoch(mode):
    """Once epoch 1's iterator ended, the state says the next pass is
    epoch 2 from its start (the counter in the new copy says 0)."""
    first = make(ResumesItself(N, BATCH), mode)
    epochs(first, 2)
    state = first.state_dict()
    first.close()
    assert state["complete"] and state["dataset"]["states"] == [
        {"epoch": 2, "sample_in_epoch": 0}]
    resumed = resume(mode, state)
    assert epochs(resumed, 2) == [expected(2), expected(3)]
    resumed.close()


@pytest.mark.parametrize("mode", ["processes", "main"])
def test_a_state_before_anything_of_the_pass_is_delivered(mode):
    """iter() made, no batch taken: the workers may or may not have begun
    the dataset's pass, so its counter is not read; the state holds the
    pass as the run was planned: epoch 1 from its start."""
    first = make(ResumesItself(N, BATCH), mode)
    epochs(first, 1)
    it = iter(first)
    state = first.state_dict()
    assert state["dataset"]["states"] == [{"epoch": 1, "sample_in_epoch": 0}]
    assert len(rows(next(it))) == BATCH  # (the pass goes on as before)
    first.close()
    resumed = resume(mode, state)
    assert epochs(resumed, 1) == [expected(1)]
    resumed.close()


def test_a_batch_size_other_than_the_datasets_is_said_inexact():
    """Its order's batches of 8 go round-robin to the workers; the loader's
    batches of 4 hand out the first half of each: not the first samples."""
    first = ShmLoader(ResumesItself(N, BATCH), batch_size=4, num_workers=2)
    _, state = cut(first, 1, 4)
    first.close()
    assert not state["dataset"]["exact"]
    resumed = ShmLoader(ResumesItself(N, BATCH), batch_size=4, num_workers=2)
    with pytest.warns(InexactResumeWarning, match=r"ResumesItself cannot resume exactly: its "
                      r"batch_size \(8\) is not the loader's \(4\)"):
        resumed.load_state_dict(state)
    resumed.close()


def test_worker_threads_sharing_its_copy_are_said_inexact():
    first = ShmLoader(ResumesItself(N, BATCH), batch_size=BATCH, num_workers=2,
                      worker_mode="thread")
    it = iter(first)
    next(it)
    state = first.state_dict()
    first.close()
    resumed = ShmLoader(ResumesItself(N, BATCH), batch_size=BATCH, num_workers=2,
                        worker_mode="thread")
    with pytest.warns(InexactResumeWarning, match=r"ResumesItself cannot resume exactly: its "
                      r"one copy is shared by 2 worker threads"):
        resumed.load_state_dict(state)
    resumed.close()


def progress_of(batches: list, prefix: list, extra=None) -> StreamProgress:
    return StreamProgress(len(batches), BATCH, [
        {"batches": b, "prefix": p, "extra": e} for b, p, e in
        zip(batches, prefix, extra or [[]] * len(batches))])


def test_what_is_not_the_first_of_its_order_is_named():
    """First-ready hands out the batches as they are ready: round-robin
    counts are the first samples, others not; a shuffle buffer's rows are
    not each stream's first."""
    from loader.datasets.own_state import _why_not_a_prefix

    ds = ResumesItself(N, BATCH)
    ok = _why_not_a_prefix(ds, progress_of([3, 2], [24, 16]), False, BATCH, 0)
    assert ok is None
    assert "not round-robin (per worker [3, 1])" in _why_not_a_prefix(
        ds, progress_of([3, 1], [24, 8]), False, BATCH, 0)
    assert "a shuffle buffer" in _why_not_a_prefix(
        ds, progress_of([2, 2], [14, 16], [[15, 17], []]), True, BATCH, 0)
