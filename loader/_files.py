"""FileDataset: a map-style dataset over the files a glob pattern matches,
matched again at the start of every epoch, whose `.npy` files are read
straight into their row of the batch slab.

A sample of a `.npy` file is a FileArray: its dtype and shape come from
the file's header; its bytes are read by the worker that writes the row,
with one preadv into the row itself (no decode buffer, no page faults on
a mapping: the kernel copies from the page cache into the slab).  Other
files are read the same way as uint8 arrays of their bytes, or given to
`decode(path)`.

The epoch's file list is made in main (epoch_snapshot) and handed to the
workers with the epoch's run, so every process loads the same list even
while files come and go (NOTE [ Datasets that change with the epoch ] in
_epochs.py).
"""

from __future__ import annotations

import glob
import os
import stat
import warnings

import numpy as np


class FileArray:
    """A file's array, read on demand into the place it is stored (see
    _layout.write_leaf: a leaf with read_into is deferred)."""

    __slots__ = ("path", "offset", "dtype", "shape", "fortran")

    def __init__(self, path: str, offset: int, dtype: np.dtype, shape: tuple, fortran=False):
        self.path, self.offset, self.dtype, self.shape = path, offset, dtype, shape
        self.fortran = fortran

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(np.prod(self.shape))

    def read_into(self, out: np.ndarray) -> None:
        """Fill out (this array's shape) with the file's data, converting
        to out's dtype if it differs."""
        direct = (out.dtype == self.dtype and out.flags.c_contiguous and not self.fortran)
        target = out if direct else np.empty(self.shape[::-1] if self.fortran else self.shape,
                                             self.dtype)
        buf = memoryview(target.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < len(buf):
                got = os.preadv(fd, [buf[done:]], self.offset + done)
                if got == 0:
                    raise EOFError(f"{self.path}: the file ends {len(buf) - done} bytes before "
                                   f"its {self.nbytes} bytes of data (was it truncated while "
                                   f"being read?)")
                done += got
        finally:
            os.close(fd)
        if not direct:
            out[...] = target.T if self.fortran else target

    def load(self) -> np.ndarray:
        """The array itself (a copy in memory)."""
        out = np.empty(self.shape, self.dtype)
        self.read_into(out)
        return out

    def __repr__(self):
        return f"FileArray({self.path!r}, {self.dtype}, {self.shape})"


def npy_array(path: str) -> FileArray:
    """A .npy file's array, from its header."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
        except ValueError as e:
            raise ValueError(f"{path} is not a .npy file numpy can read ({e})") from None
        if dtype.hasobject:
            raise ValueError(f"{path} holds Python objects (a pickled array): FileDataset reads "
                             f"numeric .npy files only; pass decode= to read it your way")
        return FileArray(path, f.tell(), dtype, tuple(shape), bool(fortran and len(shape) > 1))


def raw_array(path: str) -> FileArray:
    """A file's bytes, as a uint8 array."""
    return FileArray(path, 0, np.dtype(np.uint8), (os.stat(path).st_size,))


class FileDataset:
    """Map-style dataset over the files `pattern` matches (glob, `**` for
    subdirectories; sorted), matched again at the start of every epoch:
    files added between epochs are loaded from the next epoch on, and
    removed ones are dropped with one warning naming them.

    Sample i is file i: a `.npy` file's array (read straight into its row
    of the batch), any other file's bytes as a uint8 array, or with
    `decode`, whatever decode(path) returns."""

    def __init__(self, pattern: str, decode=None):
        if not isinstance(pattern, (str, os.PathLike)):
            raise TypeError(f"pattern must be a glob string, got {type(pattern).__name__}")
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable, got {type(decode).__name__}")
        self.pattern, self.decode = os.fspath(pattern), decode
        self.files = self._match()

    def _match(self) -> list[str]:
        found = []
        for path in glob.glob(self.pattern, recursive=True):
            try:
                if stat.S_ISREG(os.stat(path).st_mode):
                    found.append(path)
            except FileNotFoundError:
                pass  # removed while we looked
        return sorted(found)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path = self.files[i]
        if self.decode is not None:
            return self.decode(path)
        return npy_array(path) if path.endswith(".npy") else raw_array(path)

    # --- the loader's epoch protocol ----------------------------------------------------

    def epoch_snapshot(self, info=None) -> list[str]:
        """Called in the main process as each epoch starts: match the
        pattern again; the list is what every worker loads this epoch
        (NOTE [ Datasets that change with the epoch ] in _epochs.py)."""
        files = self._match()
        gone = sorted(set(self.files) - set(files))
        if gone:
            shown = ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
            warnings.warn(f"FileDataset({self.pattern!r}): {len(gone)} file(s) of the last epoch "
                          f"are gone and are not loaded any more: {shown}", RuntimeWarning,
                          stacklevel=3)
        self.files = files
        return files

    def restore_snapshot(self, files: list[str]) -> None:
        """Called in each worker with the epoch's list."""
        self.files = files
