"""Hugging Face `datasets` as a client (issue 18): datasets.Dataset (built
in memory, from Parquet and from Arrow files on disk; formats "numpy" and
"torch") and IterableDataset (to_iterable_dataset(num_shards=...)) through
loader.DataLoader and ShmLoader give exactly torch's DataLoader's batches;
the iterable form's shards split across workers, and across ranks with
datasets.distributed.split_dataset_by_node, as datasets documents.  The
suite turns warnings into errors (pyproject.toml), so a warning torch's
DataLoader does not give fails these tests.  Everything is built locally:
no network."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

from datasets.distributed import split_dataset_by_node  # noqa: E402
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402

from loader import DataLoader, ShmLoader  # noqa: E402

pytestmark = pytest.mark.timeout(120)

N, T = 150, 16  # rows, token ids per row


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))


def columns() -> dict:
    ids = np.arange(N * T, dtype=np.int32).reshape(N, T)
    return {"ids": ids, "label": np.arange(N, dtype=np.int64) % 7,
            "weight": np.linspace(0, 1, N, dtype=np.float32)}


def source(kind: str, tmp_path):
    """The same rows, built as `kind`."""
    ds = datasets.Dataset.from_dict(columns())
    if kind == "memory":
        return ds
    if kind == "parquet":
        path = str(tmp_path / "rows.parquet")
        ds.to_parquet(path)
        return datasets.Dataset.from_parquet(path, cache_dir=str(tmp_path / "cache"))
    ds.save_to_disk(str(tmp_path / "arrow"))  # Arrow files, memory-mapped when loaded
    return datasets.load_from_disk(str(tmp_path / "arrow"))


def flat(batch) -> dict:
    """A batch as plain lists, keyed by column."""
    return {k: torch.as_tensor(np.asarray(v)).tolist() for k, v in batch.items()}


def torch_batches(ds, **kw) -> list:
    return [flat(b) for b in TorchDataLoader(ds, **kw)]


def expected_rows(order) -> dict:
    c = columns()
    return {"ids": c["ids"][order].tolist(), "label": c["label"][order].tolist(),
            "weight": c["weight"][order].tolist()}


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("kind", ["memory", "parquet", "arrow"])
@pytest.mark.parametrize("fmt", ["numpy", "torch"])
@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_gives_torchs_batches(kind, fmt, workers, tmp_path):
    ds = source(kind, tmp_path).with_format(fmt)
    kw = dict(batch_size=16, shuffle=True, num_workers=workers)
    theirs = list(TorchDataLoader(ds, generator=torch.Generator().manual_seed(4), **kw))
    batches = list(DataLoader(ds, generator=torch.Generator().manual_seed(4), **kw))
    want = [flat(b) for b in theirs]
    assert [flat(b) for b in batches] == want
    assert len(want) == 10 and sum(len(b["label"]) for b in want) == N
    assert all(type(v) is torch.Tensor for b in batches for v in b.values())
    assert [{k: v.dtype for k, v in b.items()} for b in batches] == [
        {k: v.dtype for k, v in b.items()} for b in theirs]
    for b in want:  # each row is the dataset's row (its ids say which)
        assert b == expected_rows([row[0] // T for row in b["ids"]])
    assert sorted(row[0] // T for b in want for row in b["ids"]) == list(range(N))


@pytest.mark.parametrize("fmt", ["numpy", "torch"])
@pytest.mark.parametrize("workers,in_order", [(0, True), (2, True), (2, False)])
def test_shmloader_rows_are_the_datasets(fmt, workers, in_order, tmp_path):
    ds = source("arrow", tmp_path).with_format(fmt)
    with ShmLoader(ds, batch_size=32, shuffle=True, seed=3, num_workers=workers,
                   in_order=in_order) as ld:
        for _ in range(2):
            batches = [flat(b) for b in ld]
            if in_order:
                assert [len(b["label"]) for b in batches] == [32] * 4 + [22]
            assert sorted(len(b["label"]) for b in batches) == [22, 32, 32, 32, 32]
            for b in batches:  # every row is the dataset's row of its ids
                first_ids = [row[0] // T for row in b["ids"]]
                assert b == expected_rows(first_ids)
            assert sorted(sum((b["label"] for b in batches), [])) == sorted(
                columns()["label"].tolist())
            assert sorted(row[0] // T for b in batches for row in b["ids"]) == list(range(N))


def stream(num_shards: int, fmt="torch"):
    return datasets.Dataset.from_dict(columns()).with_format(fmt).to_iterable_dataset(
        num_shards=num_shards)


@pytest.mark.parametrize("workers,shards", [(0, 6), (2, 6), (2, 3)])
def test_iterable_dataset_shards_split_across_workers_as_torchs(workers, shards):
    ds = stream(num_shards=shards)
    want = torch_batches(ds, batch_size=8, num_workers=workers)
    got = [flat(b) for b in DataLoader(ds, batch_size=8, num_workers=workers)]
    assert got == want
    rows = sorted(row[0] // T for b in got for row in b["ids"])
    assert rows == list(range(N))  # each row once: the shards are split, not repeated


def test_iterable_dataset_through_shmloader_each_row_once():
    ds = stream(num_shards=4, fmt="numpy")
    with ShmLoader(ds, batch_size=8, num_workers=2) as ld:
        for _ in range(2):
            rows = [row[0] // T for b in ld for row in flat(b)["ids"]]
            assert sorted(rows) == list(range(N))


@pytest.mark.parametrize("num_shards", [4, 3])  # divisible by the world size, and not
def test_split_dataset_by_node_ranks_share_the_rows(num_shards):
    ds = stream(num_shards=num_shards)
    seen = []
    for rank in range(2):
        part = split_dataset_by_node(ds, rank=rank, world_size=2)
        want = torch_batches(part, batch_size=8, num_workers=2)
        got = [flat(b) for b in DataLoader(part, batch_size=8, num_workers=2)]
        assert got == want
        seen += [row[0] // T for b in got for row in b["ids"]]
    assert sorted(seen) == list(range(N))  # the ranks together: every row once
