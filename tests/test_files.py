"""FileDataset (issue 9): a map-style dataset over the files a glob
matches, matched again at the start of every epoch; .npy files read
straight into their row; other files as bytes, or with decode."""

import os
import warnings

import numpy as np
import pytest

from loader import FileArray, FileDataset, ShmLoader

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
