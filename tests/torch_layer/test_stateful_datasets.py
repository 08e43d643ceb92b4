"""Issue 29 item 2 for loader.DataLoader: a dataset that keeps its own state
(torchdata's Stateful protocol) and counts its epochs itself, as MosaicML
Streaming's does, run beside torch's DataLoader the same way: the same
batches every epoch, and a state taken mid-epoch resumes, in a loader over
a new copy of the dataset, with the rest of the cut epoch, exactly, then
the next.  ShmLoader's side: tests/loader_layer/test_own_state.py.

mosaicml-streaming itself is not run: its wheel requires another torch
(and torchvision) than this project's CUDA-less torch 2.13.0."""

import pytest

torch = pytest.importorskip("torch")

from loader import DataLoader  # noqa: E402
from shared_datasets import CountsItsEpochs  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, BATCH = 96, 8


class TorchCountsItsEpochs(CountsItsEpochs, torch.utils.data.IterableDataset):
    """CountsItsEpochs as a torch IterableDataset, sharing by torch's worker info."""

    def worker(self):
        info = torch.utils.data.get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)


def make(cls, workers):
    return cls(TorchCountsItsEpochs(N), batch_size=BATCH, num_workers=workers,
               persistent_workers=workers > 0)


def epoch(loader) -> list:
    return [tuple(r) for b in loader for r in b.tolist()]


@pytest.mark.parametrize("cut_epoch", [0, 1])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_counts_its_epochs_resumes_as_torch_ran_it(workers, cut_epoch):
    theirs = make(torch.utils.data.DataLoader, workers)
    expected = [epoch(theirs) for _ in range(cut_epoch + 2)]
    del theirs
    ours = make(DataLoader, workers)
    assert [epoch(ours) for _ in range(cut_epoch + 2)] == expected
    ours.close()

    first = make(DataLoader, workers)
    for _ in range(cut_epoch):
        epoch(first)
    it = iter(first)
    got = [tuple(r) for _ in range(5) for r in next(it).tolist()]
    state = first.state_dict()
    first.close()
    resumed = make(DataLoader, workers)
    resumed.load_state_dict(state)
    rest, following = epoch(resumed), epoch(resumed)
    resumed.close()
    assert got + rest == expected[cut_epoch]
    assert following == expected[cut_epoch + 1]


def _hf_rows(n=64):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"i": list(range(n))}).to_iterable_dataset(num_shards=4)
    return ds.with_format("numpy")


def _hf_epoch(loader, ds, epoch) -> list:
    ds.set_epoch(epoch)  # as Hugging Face asks, each epoch: its resume needs it
    return [int(i) for b in loader for i in b["i"]]


@pytest.mark.parametrize("cls,persistent", [("ShmLoader", True), ("DataLoader", False)])
def test_hugging_faces_iterable_dataset_resumes_from_its_own_state(cls, persistent):
    """Hugging Face's IterableDataset keeps torchdata's protocol: each
    worker's copy resumes from where its stream was (its shards and the
    rows of them read), in the epoch set with set_epoch."""
    from loader import ShmLoader

    def make(ds):
        if cls == "ShmLoader":
            return ShmLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)
        return DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)

    ds = _hf_rows()
    whole = make(ds)
    expected = [_hf_epoch(whole, ds, e) for e in range(3)]
    whole.close()
    ds = _hf_rows()
    first = make(ds)
    _hf_epoch(first, ds, 0)
    ds.set_epoch(1)
    it = iter(first)
    got = [int(i) for _ in range(3) for i in next(it)["i"]]
    state = first.state_dict()
    first.close()
    ds = _hf_rows()
    resumed = make(ds)
    resumed.load_state_dict(state)
    rest, following = _hf_epoch(resumed, ds, 1), _hf_epoch(resumed, ds, 2)
    resumed.close()
    assert got + rest == expected[1]
    assert following == expected[2]
