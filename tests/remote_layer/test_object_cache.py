"""The object cache on its own (NOTE [ The object cache ] in
loader/datasets/remote/cache.py): identity, the size bound, what is evicted and
what never is, jobs that die at any moment, an index lost or corrupt."""

import multiprocessing as mp
import os
import signal

import pytest

from loader.datasets.remote.cache import COMPLETE, Entry, ObjectCache, Reservation, path_of
from loader.errors import NoRoom

pytestmark = pytest.mark.timeout(120)
KiB = 1 << 10


def fetch(cache: ObjectCache, url: str, size: int, etag: str = "e1", byte: int = 1):
    """reserve, write, commit: what the fetcher does, without a store."""
    got = cache.reserve(url, etag, size)
    if isinstance(got, Reservation):
        with open(got.tmp, "wb") as f:
            f.write(bytes([byte]) * size)
        got = cache.commit(got)
    return got


def test_objects_are_named_by_url_and_etag_and_complete_files_only(tmp_path):
    cache = ObjectCache(str(tmp_path), 1 << 20)
    try:
        entry = fetch(cache, "s3://b/a.npy", 100)
        assert isinstance(entry, Entry) and entry.path == path_of(str(tmp_path), "s3://b/a.npy", "e1")
        with open(entry.path, "rb") as f:
            assert f.read() == b"\x01" * 100
        assert cache.lookup("s3://b/a.npy", "e1") == entry
        assert cache.lookup("s3://b/a.npy", "e2") is None       # a changed object: another name
        changed = fetch(cache, "s3://b/a.npy", 50, etag="e2", byte=2)
        assert changed.path != entry.path and cache.used_bytes() == 150
        assert fetch(cache, "s3://b/a.npy", 100) == entry        # complete already: the Entry
        assert os.listdir(tmp_path / "tmp") == []
    finally:
        cache.close()


def test_downloads_committed_together_are_each_complete_and_named(tmp_path):
    """commit_many: what the fetcher does with downloads that finish while
    another thread holds its lock; every one complete, under its own name,
    its bytes its own, nothing left in tmp/, and a second job sees them."""
    cache = ObjectCache(str(tmp_path), 1 << 20)
    try:
        reserved = [cache.reserve(f"s3://b/{i}.npy", f"e{i}", 100 + i) for i in range(6)]
        for i, res in enumerate(reserved):
            with open(res.tmp, "wb") as f:
                f.write(bytes([i + 1]) * (100 + i))
        entries = cache.commit_many(reserved)
        assert [e.id for e in entries] == [r.id for r in reserved]
        for i, entry in enumerate(entries):
            assert entry == cache.lookup(f"s3://b/{i}.npy", f"e{i}")
            with open(entry.path, "rb") as f:
                assert f.read() == bytes([i + 1]) * (100 + i)
        assert os.listdir(tmp_path / "tmp") == []
        assert cache.used_bytes() == sum(100 + i for i in range(6))
        states = {state for (state,) in cache.db.execute("SELECT state FROM objects")}
        assert states == {COMPLETE}
        other = ObjectCache(str(tmp_path), 1 << 20)
        try:
            assert [other.lookup(f"s3://b/{i}.npy", f"e{i}") for i in range(6)] == entries
        finally:
            other.close()
    finally:
        cache.close()


def test_a_batch_of_downloads_with_one_file_missing_names_none_of_them(tmp_path):
    """commit_many fails as a whole: the files it had renamed already are
    not left under their final names (outside the index, uncounted), and
    each reservation is aborted as a failed download is."""
    cache = ObjectCache(str(tmp_path), 1 << 20)
    try:
        reserved = [cache.reserve(f"s3://b/{i}.npy", "e", 10) for i in range(3)]
        for res in reserved[:2]:
            with open(res.tmp, "wb") as f:
                f.write(b"x" * 10)
        with pytest.raises(FileNotFoundError):
            cache.commit_many(reserved)                  # the third was never written
        assert [os.path.exists(r.path) for r in reserved] == [False, False, False]
        for res in reserved:
            cache.abort(res)
        assert cache.used_bytes() == 0 and os.listdir(tmp_path / "tmp") == []
        assert fetch(cache, "s3://b/0.npy", 10, etag="e") == cache.lookup("s3://b/0.npy", "e")
    finally:
        cache.close()


def test_an_epoch_of_fifty_thousand_objects_pins_exactly_the_complete_ones(tmp_path):
    """pin_epoch over a listing of 50,000 of which a scattered 7,000 are
    complete (and 50 only being fetched): their ids in the listing's
    order, -1 elsewhere, and those pins alone for the slot, replaced when
    the slot is pinned again."""
    import numpy as np

    cache = ObjectCache(str(tmp_path), 1 << 40)
    try:
        listing = [(f"s3://b/sims/{i:06d}.npy", f"e{i % 7}") for i in range(50_000)]
        rng = np.random.default_rng(5)
        cached = np.sort(rng.choice(50_000, 7_000, replace=False))
        cache.db.execute("BEGIN")
        cache.db.executemany("INSERT INTO objects (url, etag, size, state, fetched_at) "
                             "VALUES (?, ?, 10, ?, 0)", [(*listing[i], COMPLETE) for i in cached])
        fetching = sorted(set(range(50_000)) - set(cached.tolist()))[:50]
        cache.db.executemany("INSERT INTO objects (url, etag, size, state, fetcher) "
                             "VALUES (?, ?, 10, 0, ?)", [(*listing[i], cache.job) for i in fetching])
        cache.db.execute("INSERT INTO objects (url, etag, size, state) VALUES (?, 'other', 10, ?)",
                         (listing[int(cached[0])][0], COMPLETE))   # another version of one
        cache.db.execute("COMMIT")
        want = {url: obj for obj, url, etag in cache.db.execute(
            "SELECT id, url, etag FROM objects WHERE state = ? AND etag != 'other'", (COMPLETE,))}
        ids = cache.pin_epoch(1, listing)
        assert ids.dtype == np.int64 and len(ids) == 50_000
        assert np.flatnonzero(ids >= 0).tolist() == cached.tolist()
        assert [int(ids[i]) for i in cached] == [want[listing[i][0]] for i in cached]
        pinned = sorted(o for (o,) in cache.db.execute(
            "SELECT object FROM pins WHERE job = ? AND slot = 1", (cache.job,)))
        assert pinned == sorted(want.values())
        again = cache.pin_epoch(1, listing[:100])          # the slot's pins are replaced
        assert cache.db.execute("SELECT COUNT(*) FROM pins WHERE slot = 1").fetchone()[0] == \
            int((again >= 0).sum()) == int((cached < 100).sum())
    finally:
        cache.close()


def test_the_limit_holds_and_eviction_takes_the_most_trained_then_the_oldest(tmp_path):
    cache = ObjectCache(str(tmp_path), 10 * KiB)
    try:
        entries = [fetch(cache, f"s3://b/{i}", 2 * KiB) for i in range(5)]   # full
        cache.trained(0, [entries[3].id, entries[3].id, entries[1].id])
        cache.pin_epoch(0, [("s3://b/0", "e1")])                                # only 0 pinned
        new = fetch(cache, "s3://b/5", 3 * KiB)                                 # 2 must go: 3, 1
        assert cache.used_bytes() <= 10 * KiB and isinstance(new, Entry)
        left = {url for (url,) in cache.db.execute("SELECT url FROM objects")}
        assert left == {"s3://b/0", "s3://b/2", "s3://b/4", "s3://b/5"}
        assert not os.path.exists(entries[3].path) and not os.path.exists(entries[1].path)
        assert cache.evicted == 2
    finally:
        cache.close()


def test_pinned_objects_stay_and_one_overflow_object_per_job_gets_through(tmp_path):
    cache = ObjectCache(str(tmp_path), 4 * KiB)
    try:
        a, b = fetch(cache, "s3://b/a", 2 * KiB), fetch(cache, "s3://b/b", 2 * KiB)  # pinned
        over = cache.reserve("s3://b/c", "e1", 2 * KiB)
        assert isinstance(over, Reservation) and over.overflow   # past the limit by one object
        with pytest.raises(NoRoom, match="do not fit"):
            cache.reserve("s3://b/d", "e1", KiB)                  # and only one
        with open(over.tmp, "wb") as f:
            f.write(b"c" * 2 * KiB)
        c = cache.commit(over)
        cache.trained(0, [c.id])                                  # trained: it goes at once
        assert not os.path.exists(c.path) and cache.used_bytes() == 4 * KiB
        assert os.path.exists(a.path) and os.path.exists(b.path)
        with pytest.raises(NoRoom):
            cache.reserve("s3://b/big", "e1", 5 * KiB)            # larger than the cache
    finally:
        cache.close()


def _hold_a_reservation(cache_dir, ready, url):
    cache = ObjectCache(cache_dir, 1 << 20, "holder")
    res = cache.reserve(url, "e1", 100)
    with open(res.tmp, "wb") as f:
        f.write(b"x" * 50)   # half written
    ready.send(cache.job)
    signal.pause()


def test_a_job_killed_mid_fetch_leaves_nothing_a_later_job_would_serve(tmp_path):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_hold_a_reservation, args=(str(tmp_path), there, "s3://b/x"))
    p.start()
    try:
        job = here.recv()
        cache = ObjectCache(str(tmp_path), 1 << 20)
        try:
            assert cache.alive(job)
            assert cache.reserve("s3://b/x", "e1", 100) is None   # the other job fetches it
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            assert not cache.alive(job)
            assert cache.recover() == 1
            assert os.listdir(tmp_path / "tmp") == [] and os.listdir(tmp_path / "jobs") == [
                f"{cache.job}.lock"]
            entry = fetch(cache, "s3://b/x", 100)                   # fetched again, whole
            with open(entry.path, "rb") as f:
                assert f.read() == b"\x01" * 100
        finally:
            cache.close()
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)


@pytest.mark.parametrize("damage", ["deleted", "garbage"])
def test_a_lost_or_corrupt_index_is_rebuilt_from_the_files(tmp_path, damage):
    cache = ObjectCache(str(tmp_path), 1 << 20)
    entries = [fetch(cache, f"s3://b/{i}", 100 + i) for i in range(200)]
    cache.close()
    stray = tmp_path / "objects" / "ab" / ("ab" + "0" * 62)
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"not ours")
    index = tmp_path / "index.sqlite"
    if damage == "deleted":
        index.unlink()
    else:
        index.write_bytes(b"garbage" * 1000)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(str(index) + suffix):
            os.unlink(str(index) + suffix)
    again = ObjectCache(str(tmp_path), 1 << 20)
    try:
        rows = again.db.execute("SELECT url, size, state FROM objects ORDER BY id").fetchall()
        assert sorted(rows) == sorted((f"s3://b/{i}", 100 + i, COMPLETE) for i in range(200))
        assert again.lookup("s3://b/7", "e1").path == entries[7].path
        assert not stray.exists()
    finally:
        again.close()


def test_a_job_id_is_never_reused_so_a_late_temp_file_is_not_taken_for_ours(tmp_path):
    """A fetcher whose program died closes its cache while a download
    thread may still write a temp file (named by its job id).  The next
    job got that id back (SQLite reuses the largest rowid once deleted),
    took the file for its own and never removed it: 8 kill -9 runs in a
    row left `8.<digest>.part` for good.  Ids now only grow."""
    ids, late = [], []
    for _ in range(5):
        cache = ObjectCache(str(tmp_path), 1 << 20)
        res = cache.reserve(f"s3://b/{len(ids)}.npy", "e1", 10)
        ids.append(cache.job)
        cache.close()            # the job's row and its temp files go...
        with open(res.tmp, "wb") as f:   # ...and a thread still downloading writes one
            f.write(b"x" * 10)
        late.append(os.path.basename(res.tmp))
    assert ids == sorted(set(ids)) and len(ids) == 5
    cache = ObjectCache(str(tmp_path), 1 << 20)
    try:
        assert cache.job > ids[-1]
        cache.recover()
        assert os.listdir(tmp_path / "tmp") == []
    finally:
        cache.close()
