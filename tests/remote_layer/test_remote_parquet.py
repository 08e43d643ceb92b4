"""ParquetDataset over an object store (issue 26): the files listed at each
epoch, their footers read with ranged GETs by the fetcher (main plans the
epoch's row groups before any file is fetched whole), the files fetched
into the cache ahead of the workers and read from there; every row once
per epoch however small the cache, each fault a typed error.

Object f holds rows f*1000 .. f*1000+999 (an int64 "id", a 4-float "x" of
the id, a "name" string), in row groups of 250."""

import io

import numpy as np
import pytest

from loader import ParquetDataset, ShmLoader
from loader.errors import ObjectChanged, ParquetFileError

from extras import import_or_skip_on_older_python  # (tests/support)

import_or_skip_on_older_python("obstore")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:ShmLoader forks .* processes from a process running"),
]
ROWS, GROUP = 1000, 250


def table_bytes(f: int, rows: int = ROWS, group: int = GROUP) -> bytes:
    ids = np.arange(f * rows, (f + 1) * rows)
    x = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float32)), 4)
    table = pa.table({"id": pa.array(ids), "x": x, "name": pa.array([f"r{r}" for r in ids])})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=group)
    return buf.getvalue()


@pytest.fixture
def tables(s3_server, s3_bucket, monkeypatch, tmp_path):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)

    class Tables:
        server, bucket, cache = s3_server, s3_bucket, str(tmp_path / "cache")

        def fill(self, n: int) -> int:
            """n files; the size of one."""
            files = {f"t/{f:03}.parquet": table_bytes(f) for f in range(n)}
            s3_server.put_many(s3_bucket, files)
            return len(next(iter(files.values())))

        def dataset(self, pattern="t/*.parquet", **kw) -> ParquetDataset:
            kw.setdefault("cache_dir", self.cache)
            return ParquetDataset(f"s3://{s3_bucket}/{pattern}", **kw)

    return Tables()


def ids_of(batches) -> list[int]:
    out = []
    for b in batches:
        i = b["id"]
        np.testing.assert_array_equal(b["x"], np.repeat(i, 4).reshape(-1, 4).astype(np.float32))
        assert b["name"] == [f"r{k}" for k in i.tolist()]
        out += i.tolist()
    return out


@pytest.mark.parametrize("workers,mode", [(2, "process"), (0, "process"), (2, "thread")])
def test_every_row_once_per_epoch_through_a_cache_of_a_quarter(tables, workers, mode):
    """20 files (4 row groups each), a cache of 5 of them: 3 shuffled
    epochs, each every row exactly once (the files rotate through the
    cache: each is fetched, read whole, unpinned and evicted), the epochs
    in different orders; the same seed gives the same epochs again."""
    size = tables.fill(20)
    epochs = []
    for run in range(2):
        ds = tables.dataset(cache_limit_bytes=5 * size, requests_in_flight=4)
        try:
            with ShmLoader(ds, batch_size=100, num_workers=workers, worker_mode=mode, seed=3,
                           timeout=60 if workers else None) as ld:
                epochs.append([ids_of(ld) for _ in range(3)])
            remote = ds.remote_stats()
        finally:
            ds.close()
        for got in epochs[-1]:
            assert sorted(got) == list(range(20 * ROWS))
        assert epochs[-1][0] != epochs[-1][1] != epochs[-1][2]
        assert remote["fetch_errors"] == 0 and remote["evictions"] > 0, remote
    assert epochs[0] == epochs[1]


def test_a_cache_that_holds_everything_fetches_each_file_once(tables):
    """A cache larger than the data: epoch 1 fetches each file once, later
    epochs none (footers are read once per dataset, by ranged GETs); a new
    dataset on the same cache fetches nothing."""
    tables.fill(12)
    ds = tables.dataset(cache_limit_bytes=1 << 30)
    try:
        with ShmLoader(ds, batch_size=64, num_workers=2, seed=1, timeout=60) as ld:
            for _ in range(3):
                assert sorted(ids_of(ld)) == list(range(12 * ROWS))
        assert ds.remote_stats()["objects_fetched"] == 12
    finally:
        ds.close()
    again = tables.dataset(cache_limit_bytes=1 << 30)
    try:
        with ShmLoader(again, batch_size=64, num_workers=2, seed=1, timeout=60) as ld:
            assert sorted(ids_of(ld)) == list(range(12 * ROWS))
        assert again.remote_stats()["objects_fetched"] == 0
    finally:
        again.close()


def test_columns_and_shuffle_false_read_in_listing_order(tables):
    tables.fill(3)
    ds = tables.dataset(columns=["id"], shuffle=False, cache_limit_bytes=1 << 30)
    try:
        with ShmLoader(ds, batch_size=100, num_workers=0) as ld:
            batches = list(ld)
        assert set(batches[0]) == {"id"}
        assert np.concatenate([b["id"] for b in batches]).tolist() == list(range(3 * ROWS))
    finally:
        ds.close()


def test_a_file_that_is_not_parquet_is_named_as_the_epoch_starts(tables):
    tables.fill(3)
    tables.server.put(tables.bucket, "t/001.parquet", b"this is no parquet file, just text")
    ds = tables.dataset(cache_limit_bytes=1 << 30)
    try:
        with ShmLoader(ds, batch_size=100, num_workers=2, timeout=60) as ld:
            with pytest.raises(ParquetFileError, match=r"t/001\.parquet.*PAR1"):
                next(iter(ld))
    finally:
        ds.close()


def test_a_file_replaced_after_its_listing_is_object_changed(tables):
    """Replaced between the listing and the epoch (its footer is read with
    If-Match its listed ETag): ObjectChanged naming it as the epoch
    starts; once listed again, the epoch reads the new version."""
    tables.fill(4)
    ds = tables.dataset(cache_limit_bytes=1 << 30)
    try:
        ds._remote._list_now(60)   # (the listing asked in the background: done before the put)
        tables.server.put(tables.bucket, "t/003.parquet", table_bytes(3, group=500))
        with ShmLoader(ds, batch_size=250, num_workers=2, timeout=60) as ld:
            with pytest.raises(ObjectChanged, match=r"t/003\.parquet"):
                next(iter(ld))
            ds._remote._list_now(60)   # (the one asked in the background may predate the put)
            ds._remote._list_now(60)
            assert sorted(ids_of(ld)) == list(range(4 * ROWS))
    finally:
        ds.close()


def test_local_paths_refuse_cache_options_and_a_url_comes_alone(tables, tmp_path):
    with pytest.raises(ValueError, match="object-store URL"):
        ParquetDataset(str(tmp_path / "*.parquet"), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="alone"):
        ParquetDataset([f"s3://{tables.bucket}/t/*.parquet", str(tmp_path / "*.parquet")])


def test_a_state_loaded_into_the_same_loader_mid_epoch_reads_the_rest(tables):
    """load_state_dict() of a state of the epoch in progress, into the same
    loader (its runs dropped): the epoch is planned anew (before, the
    snapshot of the dropped run came back with its rows already counted
    read, so files were unpinned before their last rows and, once evicted,
    never fetched again: a hang through a cache of 5 of 20 files)."""
    size = tables.fill(20)
    ds = tables.dataset(cache_limit_bytes=5 * size, requests_in_flight=4)
    try:
        with ShmLoader(ds, batch_size=100, num_workers=2, seed=3, timeout=60) as ld:
            it = iter(ld)
            head = ids_of(next(it) for _ in range(60))
            state = ld.state_dict()
            ids_of(next(it) for _ in range(20))   # (read on, then go back)
            ld.load_state_dict(state)
            rest = ids_of(ld)
            assert sorted(head + rest) == list(range(20 * ROWS))
            assert sorted(ids_of(ld)) == list(range(20 * ROWS))   # and the next epoch
    finally:
        ds.close()
