"""ShmLoader with torch datasets and samples (issue 8, items 1-5): 0-d
tensors stay 0-d per sample, bfloat16, torch's IterableDataset decides
iterable even with __len__, torch.utils.data.get_worker_info() inside
workers, one intra-op thread per worker."""

import numpy as np
import pytest

from loader import ShmLoader

torch = pytest.importorskip("torch")
from torch.utils.data import IterableDataset, TensorDataset  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_tensor_dataset_labels_are_zero_d_and_written_by_the_workers():
    x, y = torch.randn(64, 3), torch.arange(64) % 5
    with ShmLoader(TensorDataset(x, y), batch_size=16, num_workers=2, output="torch") as loader:
        for _ in range(2):
            batches = list(loader)
            assert [b[1].shape for b in batches] == [(16,)] * 4
            assert torch.equal(torch.cat([b[1] for b in batches]), y)
            assert torch.equal(torch.cat([b[0] for b in batches]), x)
        stats = loader.stats()
    assert stats["samples_written_by_workers"] == 64 and stats["samples_written_by_batcher"] == 0


def test_bfloat16_tensors_round_trip_and_numpy_output_says_what_to_do():
    x = torch.randn(12, 4).to(torch.bfloat16)
    with ShmLoader(TensorDataset(x), batch_size=4, num_workers=2, output="torch") as loader:
        got = torch.cat([b[0] for b in loader])
    assert got.dtype == torch.bfloat16 and torch.equal(got, x)
    with ShmLoader(TensorDataset(x), batch_size=4, num_workers=2) as loader:
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            with pytest.raises(TypeError, match="output='torch'"):
                next(iter(loader))
        else:
            assert next(iter(loader))[0].dtype.name == "bfloat16"


class CountedStream(IterableDataset):
    """A torch IterableDataset with __len__: iterable all the same, as torch
    decides; it shards itself with torch's get_worker_info()."""

    def __len__(self):
        return 10

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        assert info is not None and info.num_workers == 2
        for i in range(info.id, 10, info.num_workers):
            yield np.array([i, info.id, torch.get_num_threads()])


def test_a_torch_iterable_dataset_with_len_is_iterable_and_sees_torchs_worker_info():
    with ShmLoader(CountedStream(), batch_size=5, num_workers=2) as loader:
        assert loader.iterable
        rows = np.concatenate(list(loader))
    assert sorted(rows[:, 0].tolist()) == list(range(10))
    assert {(i % 2, w) for i, w in rows[:, :2].tolist()} == {(0, 0), (1, 1)}
    assert set(rows[:, 2].tolist()) == {1}  # one intra-op thread per worker, as torch's
    assert torch.utils.data.get_worker_info() is None
