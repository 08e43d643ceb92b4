"""ParquetDataset (issue 9): row groups split across ranks and workers,
their order shuffled per epoch with the seed, rows as dicts of numpy
values; every row exactly once per epoch."""

import numpy as np
import pytest

from loader import ParquetDataset, ShmLoader

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(120)


def write_files(tmp_path, sizes=((37, 10), (64, 16), (5, 5), (90, 30))):
    """Files of (rows, rows per group): row r of all has id r, x = 4 floats
    of r, img = a 2x3 uint8 array of r % 256, name f"r{r}", flag r % 2."""
    first = 0
    for k, (rows, per_group) in enumerate(sizes):
        ids = np.arange(first, first + rows)
        x = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float32)), 4)
        inner = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids % 256, 6).astype(np.uint8)),
                                                  3)
        img = pa.FixedSizeListArray.from_arrays(inner, 2)
        table = pa.table({"id": pa.array(ids), "x": x, "img": img,
                          "name": pa.array([f"r{r}" for r in ids]),
                          "flag": pa.array(ids % 2 == 1)})
        pq.write_table(table, str(tmp_path / f"part{k}.parquet"), row_group_size=per_group)
        first += rows
    return first


def check_rows(batches):
    ids = []
    for b in batches:
        i = b["id"]
        assert i.dtype == np.int64
        np.testing.assert_array_equal(b["x"], np.repeat(i, 4).reshape(-1, 4).astype(np.float32))
        assert b["img"].shape == (len(i), 2, 3) and b["img"].dtype == np.uint8
        np.testing.assert_array_equal(b["img"][:, 1, 2], (i % 256).astype(np.uint8))
        assert b["name"] == [f"r{k}" for k in i.tolist()]
        assert b["flag"].tolist() == [k % 2 == 1 for k in i.tolist()]
        ids += i.tolist()
    return ids


@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_every_row_once_per_epoch_in_a_new_order(tmp_path, num_workers):
    total = write_files(tmp_path)
    ds = ParquetDataset(str(tmp_path / "*.parquet"))
    with ShmLoader(ds, batch_size=16, num_workers=num_workers, seed=4) as loader:
        epochs = [check_rows(loader) for _ in range(3)]
    for ids in epochs:
        assert sorted(ids) == list(range(total))
    assert epochs[0] != epochs[1] != epochs[2]
    with ShmLoader(ParquetDataset(str(tmp_path / "*.parquet")), batch_size=16,
                   num_workers=num_workers, seed=4) as again:
        assert [check_rows(again) for _ in range(3)] == epochs  # the seed decides


def test_columns_and_a_list_of_paths(tmp_path):
    write_files(tmp_path)
    paths = [str(tmp_path / "part1.parquet"), str(tmp_path / "part2.parquet")]
    with ShmLoader(ParquetDataset(paths, columns=["id", "name"], shuffle=False), batch_size=8,
                   num_workers=2) as loader:
        batches = list(loader)
    assert all(set(b) == {"id", "name"} for b in batches)
    assert sorted(i for b in batches for i in b["id"].tolist()) == list(range(37, 37 + 69))


def test_ranks_get_equal_disjoint_shares_and_the_same_number_of_batches(tmp_path):
    total = write_files(tmp_path)
    shares, counts = [], []
    for rank in range(3):
        with ShmLoader(ParquetDataset(str(tmp_path / "*.parquet")), batch_size=7, num_workers=2,
                       seed=9, distributed=(rank, 3)) as loader:
            batches = list(loader)
        counts.append(len(batches))
        shares.append(check_rows(batches))
    assert counts[0] == counts[1] == counts[2]
    per_rank = -(-total // 3)
    assert [len(s) for s in shares] == [per_rank] * 3
    together = shares[0] + shares[1] + shares[2]
    assert sorted(set(together)) == list(range(total))
    assert len(together) - total == 3 * per_rank - total  # only the padding repeats


def test_a_parquet_epoch_resumes_where_it_was(tmp_path):
    write_files(tmp_path)

    def make():
        return ShmLoader(ParquetDataset(str(tmp_path / "*.parquet")), batch_size=8, num_workers=2,
                         seed=1)

    with make() as loader:
        full = [check_rows([b]) for b in loader]
        it = iter(loader)
        head = [check_rows([next(it)]) for _ in range(5)]
        state = loader.state_dict()
        del it
    with make() as resumed:
        resumed.load_state_dict(state)
        rest = [check_rows([b]) for b in resumed]
    with make() as reference:
        list(reference)
        second = [check_rows([b]) for b in reference]
    assert head + rest == second
    assert sorted(sum(full, [])) == sorted(sum(second, []))


def test_a_missing_pattern_says_so(tmp_path):
    with ShmLoader(ParquetDataset(str(tmp_path / "*.parquet")), batch_size=4,
                   num_workers=2) as loader:
        with pytest.raises(FileNotFoundError, match="no file matches"):
            list(loader)


def test_a_shuffle_buffer_mixes_rows_across_row_groups(tmp_path):
    total = write_files(tmp_path)
    with ShmLoader(ParquetDataset(str(tmp_path / "*.parquet"), shuffle=False), batch_size=8,
                   num_workers=2, shuffle_buffer=64, seed=2) as loader:
        ids = check_rows(loader)
    assert sorted(ids) == list(range(total))
    groups = [i // 10 for i in ids[:8]]  # the first batch draws on several row groups
    assert len(set(groups)) > 1 and ids != sorted(ids)
