"""FileDataset (issue 9): a map-style dataset over the files a glob
matches, matched again at the start of every epoch; .npy files read
straight into their row; other files as bytes, or with decode."""

import os
import threading
import warnings

import numpy as np
import pytest

from loader import FileArray, FileDataset, ShmLoader, get_worker_info

pytestmark = pytest.mark.timeout(60)


def write(dirpath, i, shape=(64, 32), dtype=np.float32, order="C"):
    a = np.asarray(np.arange(np.prod(shape)).reshape(shape) + 1000 * i, dtype=dtype, order=order)
    np.save(os.path.join(dirpath, f"s{i:04d}.npy"), a)
    return a


def epoch(loader):
    return [b for b in loader]


def test_npy_files_come_back_exactly_in_sorted_order(tmp_path):
    arrays = [write(tmp_path, i) for i in range(37)]
    ds = FileDataset(str(tmp_path / "*.npy"))
    assert len(ds) == 37 and isinstance(ds[0], FileArray)
    with ShmLoader(ds, batch_size=8, num_workers=2) as loader:
        for _ in range(2):
            got = np.concatenate(epoch(loader))
            np.testing.assert_array_equal(got, np.stack(arrays))
            assert got.dtype == np.float32
        assert loader.stats()["samples_written_by_workers"] == 37  # read into the rows


def test_fortran_files_mixed_dtypes_and_raw_files(tmp_path):
    a = [write(tmp_path, i, (5, 3), np.float32 if i % 2 else np.float64,
               order="F" if i % 3 == 0 else "C") for i in range(12)]
    with ShmLoader(FileDataset(str(tmp_path / "*.npy")), batch_size=4, num_workers=2) as loader:
        got = epoch(loader)
    assert [b.dtype for b in got] == [np.float64] * 3       # promoted over each batch
    np.testing.assert_array_equal(np.concatenate(got), np.stack(a).astype(np.float64))
    for i in range(6):
        (tmp_path / f"r{i}.bin").write_bytes(bytes([i] * 10))
    with ShmLoader(FileDataset(str(tmp_path / "*.bin")), batch_size=3, num_workers=2) as loader:
        assert [b.tolist() for b in loader] == [[[i] * 10 for i in range(3)],
                                               [[i] * 10 for i in range(3, 6)]]


def test_decode_gives_the_sample(tmp_path):
    for i in range(5):
        (tmp_path / f"t{i}.txt").write_text(f"{i},{i * i}")
    ds = FileDataset(str(tmp_path / "*.txt"),
                     decode=lambda p: np.array(open(p).read().split(","), np.int64))
    with ShmLoader(ds, batch_size=5, num_workers=2) as loader:
        (b,) = epoch(loader)
    assert b.tolist() == [[i, i * i] for i in range(5)]


def test_files_added_and_removed_between_epochs(tmp_path):
    for i in range(10):
        write(tmp_path, i, (4,))
    ds = FileDataset(str(tmp_path / "*.npy"))
    with ShmLoader(ds, batch_size=4, num_workers=2) as loader:
        first = np.concatenate(epoch(loader))[:, 0].tolist()
        assert first == [1000 * i for i in range(10)]
        for i in range(10, 15):
            write(tmp_path, i, (4,))
        os.remove(tmp_path / "s0003.npy")
        os.remove(tmp_path / "s0007.npy")
        with pytest.warns(RuntimeWarning, match=r"2 file\(s\).*gone.*s0003.npy.*s0007.npy"):
            second = np.concatenate(epoch(loader))[:, 0].tolist()
        assert second == [1000 * i for i in range(15) if i not in (3, 7)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # told once: nothing more is gone
            third = np.concatenate(epoch(loader))[:, 0].tolist()
        assert third == second


def test_files_added_during_an_epoch_wait_for_the_next(tmp_path):
    for i in range(40):
        write(tmp_path, i, (4,))
    with ShmLoader(FileDataset(str(tmp_path / "*.npy")), batch_size=4, num_workers=2,
                   shuffle=True, seed=1) as loader:
        it = iter(loader)
        got = [next(it)]
        for i in range(40, 60):  # written while the workers read this epoch's list
            write(tmp_path, i, (4,))
        got += list(it)
        assert sorted(np.concatenate(got)[:, 0].tolist()) == [1000 * i for i in range(40)]
        assert sorted(np.concatenate(epoch(loader))[:, 0].tolist()) == [1000 * i for i in range(60)]


def test_a_file_truncated_after_its_header_was_read_is_an_error_naming_it(tmp_path):
    for i in range(8):
        write(tmp_path, i)
    ds = FileDataset(str(tmp_path / "*.npy"))
    bad = ds.files[5]
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) - 100)
    with ShmLoader(ds, batch_size=4, num_workers=2) as loader:
        with pytest.raises(EOFError, match="s0005.npy: the file ends 100 bytes before"):
            epoch(loader)


def test_not_npy_and_pickled_npy_are_refused(tmp_path):
    (tmp_path / "x.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match="not a .npy file"):
        FileDataset(str(tmp_path / "*.npy"))[0]
    np.save(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="Python objects"):
        FileDataset(str(tmp_path / "*.npy"))[0]
    with pytest.raises(TypeError, match="glob"):
        FileDataset(3)


# --- files from outside (issue 15, items 4 and 5) ----------------------------------------

def test_directory_symlinks_that_loop_are_walked_once(tmp_path):
    """repro_files_symlink_loop.py: glob(recursive=True) followed two links
    to `.` for 2**40 paths.  Each real directory is entered once: the
    files come back once each, under their path without symlinks."""
    for i in range(4):
        write(tmp_path, i, (4,))
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", 4, (4,))
    os.symlink(".", tmp_path / "a")
    os.symlink(".", tmp_path / "b")
    os.symlink("..", tmp_path / "sub" / "up")
    os.symlink(tmp_path / "sub", tmp_path / "alias")
    ds = FileDataset(str(tmp_path / "**" / "*.npy"))
    assert ds.files == [str(tmp_path / f"s{i:04d}.npy") for i in range(4)] + \
        [str(tmp_path / "sub" / "s0004.npy")]
    with ShmLoader(ds, batch_size=5, num_workers=2, timeout=30) as loader:
        for _ in range(2):  # the walk again at the second epoch's start
            (b,) = epoch(loader)
            assert b[:, 0].tolist() == [0, 1000, 2000, 3000, 4000]


def test_a_symlink_to_a_directory_outside_the_tree_is_followed(tmp_path):
    """Following links once per real directory still follows them: a link
    to data elsewhere (data/current -> /elsewhere/v3) is read through."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root").mkdir()
    for i in range(3):
        write(tmp_path / "elsewhere", i, (2,))
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "current")
    ds = FileDataset(str(tmp_path / "root" / "**" / "*.npy"))
    assert ds.files == [str(tmp_path / "root" / "current" / f"s{i:04d}.npy") for i in range(3)]


def test_the_walk_matches_what_glob_matches_without_symlinks(tmp_path):
    import glob
    from loader.datasets.files import match_files
    for d in ("a/b/c", ".h/x", "d"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("x.npy", "a/y.npy", "a/b/z.npy", "a/b/c/w.npy", ".h/x/q.npy", ".h/r.npy",
              "d/.hid.npy", "a/b/c/t.txt", ".top.npy"):
        (tmp_path / f).write_bytes(b"")
    pats = ["*.npy", "**/*.npy", "a/**/*.npy", "**", "*/b/*.npy", ".h/**/*.npy", "**/.*.npy",
            "[ad]/*.npy", "a/b/c/w.npy", "a/b/**/*", "nope/*.npy", "**/c/*", "a/?/*.npy"]
    files = lambda paths: [p for p in paths if os.path.isfile(p)]  # "root/**" also gives "root/"
    for p in pats:
        p = str(tmp_path / p)
        assert files(match_files(p).paths) == files(sorted(glob.glob(p, recursive=True))), p
    assert len(match_files(str(tmp_path / "**" / "*.npy")).paths) == 4


def test_an_unreadable_directory_gives_one_warning_naming_it(tmp_path, monkeypatch):
    """We run as root, whom chmod 000 does not stop: os.scandir is made to
    refuse one directory as it would for another user."""
    for d in ("ok", "locked"):
        (tmp_path / d).mkdir()
        write(tmp_path / d, 0 if d == "ok" else 1, (2,))
    real_scandir = os.scandir
    locked = str(tmp_path / "locked")

    def scandir(path="."):
        if os.fspath(path) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return real_scandir(path)
    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.warns(RuntimeWarning) as told:
        ds = FileDataset(str(tmp_path / "**" / "*.npy"))
    assert [str(w.message) for w in told] == [
        f"FileDataset({str(tmp_path / '**' / '*.npy')!r}): 1 director(ies) cannot be listed "
        f"(permission denied); their files are not loaded: {locked}"]
    assert ds.files == [str(tmp_path / "ok" / "s0000.npy")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once, not at every epoch
        assert ds.epoch_snapshot() == [str(tmp_path / "ok" / "s0000.npy")]


def test_the_walk_is_cut_at_max_depth_with_a_warning(tmp_path, monkeypatch):
    from loader.datasets import files as _files
    monkeypatch.setattr(_files, "MAX_DEPTH", 3)
    deep = tmp_path / "1" / "2" / "3" / "4"
    deep.mkdir(parents=True)
    write(tmp_path / "1" / "2", 0, (2,))
    write(deep, 1, (2,))
    with pytest.warns(RuntimeWarning, match=r"1 director\(ies\) are more than 3 levels deep; "
                                            r"their files are not loaded: .*/1/2/3$"):
        ds = FileDataset(str(tmp_path / "**" / "*.npy"))
    assert ds.files == [str(tmp_path / "1" / "2" / "s0000.npy")]


@pytest.mark.parametrize("replace", ["fifo", "device"])
def test_a_path_replaced_by_a_fifo_or_device_mid_epoch_is_an_error_and_the_epoch_goes_on(
        tmp_path, replace):
    """repro_files_fifo_midepoch.py: the worker blocked in open() forever.
    The open never blocks; the fd's fstat refuses what is not a regular
    file; the error names the path and the sample, and the rest of the
    epoch arrives."""
    from loader import NotARegularFile
    for i in range(64):
        write(tmp_path, i, (8,))
    with ShmLoader(FileDataset(str(tmp_path / "*.npy")), batch_size=4, num_workers=2,
                   prefetch=1, timeout=30) as loader, warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        it = iter(loader)
        got, errors = [next(it)], []
        p = str(tmp_path / "s0060.npy")
        os.unlink(p)
        os.mkfifo(p) if replace == "fifo" else os.symlink("/dev/zero", p)
        while True:
            try:
                got.append(next(it))
            except StopIteration:
                break
            except NotARegularFile as e:
                errors.append(str(e))
    # the next epoch's list, if made before this one ended, leaves the FIFO out and says so
    assert {str(w.message).rsplit(": ", 1)[-1] for w in told} <= {p}
    kind = "FIFO" if replace == "fifo" else "character device"
    assert len(errors) == 1 and f"{p} is a {kind}, not a regular file" in errors[0]
    assert "sample index 60" in errors[0]
    assert len(got) == 15  # every batch but the one of sample 60
    assert np.concatenate(got)[:, 0].tolist() == [1000 * i for i in range(60)]


def test_dataset_getitem_refuses_a_fifo_without_blocking(tmp_path):
    from loader import NotARegularFile
    write(tmp_path, 0, (2,))
    (tmp_path / "r.bin").write_bytes(b"abc")
    ds, raw = FileDataset(str(tmp_path / "*.npy")), FileDataset(str(tmp_path / "*.bin"))
    os.unlink(ds.files[0])
    os.mkfifo(ds.files[0])
    os.unlink(raw.files[0])
    os.mkfifo(raw.files[0])
    for d in (ds, raw):
        with pytest.raises(NotARegularFile, match=f"^{d.files[0]} is a FIFO, not a regular file"):
            d[0]


# --- thread workers: each run through its own epoch's list (R161) ------------------------

HELD_S = 30.0  # bound on a held sample's wait for the next epoch's snapshot


class GrowsInFront(FileDataset):
    """A directory whose list grows in front: each epoch's first snapshot
    (in main) adds `per_epoch` files whose names sort before every earlier
    one, so index i names another file in every epoch.  A file's array is
    8 copies of its value: the first n0 files 0..n0-1, epoch e's
    100_000 * e + j.

    With hold=True, in thread workers, the first sample of each epoch's
    second-to-last batch waits (at most HELD_S) until the next epoch's snapshot is taken:
    the other worker claims the rest of the epoch meanwhile, so main starts
    the next epoch's run ahead and the held sample is read after it, every
    time (what a slow sample or a step slower than loading does now and
    then).  `held` records, per hold, whether that snapshot came.  (Not
    first-ready: there a run is all claimed once its last row is read, so
    the next one starts after every sample of this one is loaded.)"""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, root, n0: int, per_epoch: int, batch_size: int, hold: bool):
        self.root, self.per_epoch, self.batch_size, self.hold = root, per_epoch, batch_size, hold
        self.values = list(range(n0))      # the files' values, in sorted order
        self.by_epoch = {}                 # epoch -> its values, in sorted order
        self.holds, self.held = {}, []     # index -> the Event it waits for; waits' outcomes
        self.taken = {}                    # epoch -> Event: its snapshot is taken
        for j in range(n0):
            np.save(os.path.join(root, f"z{j:06d}.npy"), np.full(8, j, np.int64))
        super().__init__(os.path.join(root, "*.npy"))

    def epoch_snapshot(self, info=None):
        e = info.epoch
        if e not in self.by_epoch:
            added = [100_000 * e + j for j in range(self.per_epoch)]
            for j, v in enumerate(added):
                np.save(os.path.join(self.root, f"y{999 - e:03d}_{j:04d}.npy"), np.full(8, v, np.int64))
            self.values = added + self.values
            self.by_epoch[e] = list(self.values)
            n = len(self.values)
            self.holds[(-(-n // self.batch_size) - 2) * self.batch_size] = \
                self.taken.setdefault(e + 1, threading.Event())
            files = super().epoch_snapshot(info)
            self.taken.setdefault(e, threading.Event()).set()   # (once the list is taken)
            return files
        return super().epoch_snapshot(info)

    def __getitem__(self, i):
        info = get_worker_info()
        hold = self.holds.pop(i, None) if self.hold and info is not None and \
            info.worker_method == "thread" else None
        if hold is not None:
            self.held.append(hold.wait(HELD_S))
        return super().__getitem__(i)


@pytest.mark.parametrize("mode,workers,in_order", [
    ("thread", 2, True), ("thread", 2, False), ("thread", 3, True),
    ("process", 2, True), ("process", 2, False), ("process", 0, True)])
def test_each_epoch_is_its_own_list_while_the_next_epoch_runs_ahead(tmp_path, mode, workers,
                                                                    in_order):
    """R161.  Files added between epochs, sorted in front (index i is
    another file every epoch), the next epoch's run started ahead while
    this one's samples still load: every epoch delivers its own list
    exactly, each file once.  Thread workers share one dataset object: main
    took the next epoch's list into it and this epoch's held sample read
    through it (before the fix: a file of the next epoch, another one
    twice or missed, in every epoch)."""
    held = mode == "thread" and in_order
    ds = GrowsInFront(str(tmp_path), n0=1000, per_epoch=48, batch_size=16, hold=held)
    got = []
    with ShmLoader(ds, batch_size=16, num_workers=workers, worker_mode=mode,
                   in_order=in_order, timeout=60) as loader:
        for _ in range(5):
            batches = epoch(loader)
            assert all((b == b[:, :1]).all() for b in batches), "a row mixes two files"
            got.append(np.concatenate(batches)[:, 0].tolist())
    want = [ds.by_epoch[e] for e in sorted(ds.by_epoch)][:5]
    assert [len(g) for g in got] == [len(w) for w in want] == [1048 + 48 * k for k in range(5)]
    for g, w in zip(got, want):
        assert (g if in_order else sorted(g)) == (w if in_order else sorted(w))
    if held:   # the overlap happened in every epoch (no hold timed out)
        assert len(ds.held) >= 5 and all(ds.held), ds.held
