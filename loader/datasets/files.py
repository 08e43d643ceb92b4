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
datasets/snapshot.py).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import stat
import warnings
from typing import NamedTuple

import numpy as np

from loader.datasets.snapshot import EpochView
from loader.errors import ArgumentTypeError, NotARegularFile


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISDIR, "directory")):
        if test(mode):
            return kind
    return "special file"


def open_regular(path: str) -> int:
    """An fd of the regular file at path, opened without ever blocking.

    A plain open() of a FIFO waits for a writer forever, and a device may
    block or have side effects on open or read; the path was a regular
    file when the epoch's list was made, but anything can have replaced it
    since.  O_NONBLOCK makes the open return at once whatever the path now
    is (it changes nothing for reads of a regular file), and the fstat of
    the opened fd, not a stat of the path, decides: no window between the
    check and the read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotARegularFile(f"{path} is a {_kind(mode)}, not a regular file: FileDataset reads "
                              f"regular files only (it was replaced after this epoch's file list "
                              f"was made?); the sample is skipped with this error, remove the "
                              f"entry or narrow the pattern")
    return fd


class FileArray:
    """A file's array, read on demand into the place it is stored (see
    _layout.write_leaf: a leaf with read_into is deferred).  With `fd`, the
    file is read through that descriptor (which it then owns and closes),
    not opened by path: a cached object stays readable if it is evicted
    (unlinked) meanwhile."""

    __slots__ = ("path", "offset", "dtype", "shape", "fortran", "fd")

    def __init__(self, path: str, offset: int, dtype: np.dtype, shape: tuple, fortran=False,
                 fd: int = -1):
        self.path, self.offset, self.dtype, self.shape = path, offset, dtype, shape
        self.fortran, self.fd = fortran, fd

    def __del__(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __reduce__(self):
        # Sent to another process (a sample the batcher lays out itself):
        # a descriptor means nothing there, so its data travels instead.
        if self.fd >= 0:
            return (_identity, (self.load(),))
        return (FileArray, (self.path, self.offset, self.dtype, self.shape, self.fortran))

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
        fd, self.fd = (self.fd, -1) if self.fd >= 0 else (open_regular(self.path), -1)
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


def _identity(x):
    return x


def npy_array(path: str, fd: int = -1) -> FileArray:
    """A .npy file's array, from its header (read through fd if given: the
    FileArray then owns it)."""
    if fd >= 0:
        try:
            head = _npy_header(os.fdopen(os.dup(fd), "rb"), path)
        except BaseException:
            os.close(fd)
            raise
        return FileArray(path, *head, fd=fd)
    return FileArray(path, *_npy_header(os.fdopen(open_regular(path), "rb"), path))


def _npy_header(f, path: str) -> tuple:
    """(data offset, dtype, shape, fortran) of the .npy file open as f (closed here)."""
    with f:
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
        return f.tell(), dtype, tuple(shape), bool(fortran and len(shape) > 1)


def raw_array(path: str, fd: int = -1) -> FileArray:
    """A file's bytes, as a uint8 array (read through fd if given: the
    FileArray then owns it)."""
    if fd >= 0:
        return FileArray(path, 0, np.dtype(np.uint8), (os.fstat(fd).st_size,), fd=fd)
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return FileArray(path, 0, np.dtype(np.uint8), (size,))


# --- matching a pattern: a bounded walk ------------------------------------------------

# A tree deeper than this is not data but a loop the (device, inode) check
# cannot see (a filesystem that reports no stable inodes); it is cut with a
# warning.  PATH_MAX (4096) leaves room for about 2000 levels of 1-char names.
MAX_DEPTH = 512


class Matched(NamedTuple):
    paths: list            # matched paths, sorted, each real file once
    unreadable: list       # directories the walk could not list (sorted)
    too_deep: list         # directories cut at MAX_DEPTH (sorted)


def _split_pattern(pattern: str) -> tuple[str, list]:
    """(the leading directory without wildcards, the components after it)."""
    parts = pattern.split(os.sep)
    fixed = 0
    while fixed < len(parts) - 1 and not glob.has_magic(parts[fixed]):
        fixed += 1
    root = os.sep.join(parts[:fixed])
    if pattern.startswith(os.sep) and not root:
        root = os.sep
    return root, [p for p in parts[fixed:] if p]


def _step(parts: list, states: frozenset, name: str) -> frozenset:
    """The pattern positions after one more path component `name` (an NFA
    over the components; `**` matches zero or more whole components).  As
    glob does, a name starting with '.' matches only a component that
    starts with '.' too, and never `**`."""
    hidden = name.startswith(".")
    out = set()
    for i in states:
        if i == len(parts):
            continue  # matched already: nothing more may follow
        comp = parts[i]
        if comp == "**":
            if not hidden:
                out.add(i)
        elif (not hidden or comp.startswith(".")) and fnmatch.fnmatchcase(name, comp):
            out.add(i + 1)
    return _closure(parts, out)


def _closure(parts: list, states) -> frozenset:
    out, todo = set(states), list(states)
    while todo:
        i = todo.pop()
        if i < len(parts) and parts[i] == "**" and i + 1 not in out:
            out.add(i + 1)
            todo.append(i + 1)
    return frozenset(out)


def match_files(pattern: str) -> Matched:
    """What glob.glob(pattern, recursive=True) would match, without its
    hang: each real directory (device, inode) is entered once.

    glob follows directory symlinks, so two links to `.` made it walk
    2**40 paths.  Here the tree of real directories is walked first, and
    the directory symlinks met on the way are followed afterwards, each
    only if the directory it leads to was not entered yet (so a path
    without symlinks is preferred, and a loop ends at once).  Every
    directory is listed once and the depth is capped (MAX_DEPTH), so the
    walk is bounded by the number of directories; directories that cannot
    be listed are returned, not skipped silently."""
    root, parts = _split_pattern(pattern)
    if not parts:  # no wildcard: the path itself
        return Matched([pattern] if os.path.lexists(pattern) else [], [], [])
    n, dirs_only = len(parts), pattern.endswith(os.sep)  # as glob: "a/*/" is directories
    found, unreadable, too_deep, seen = set(), [], [], set()
    start = _closure(parts, {0})
    pending = [(root, start, 0)]     # directories to enter: (path, pattern states, depth)
    links = []                       # directory symlinks met: entered once the real tree is done
    while pending or links:
        if not pending:
            pending.append(links.pop(0))
        path, states, depth = pending.pop()
        entries = _enter(path, depth, seen, unreadable, too_deep)
        for entry in entries:
            after = _step(parts, states, entry.name)
            if not after:
                continue
            child = os.path.join(path, entry.name)
            if n in after and (not dirs_only or _is_dir(entry)):
                found.add(child)
            if any(i < n for i in after) and _is_dir(entry):
                (links if entry.is_symlink() else pending).append((child, after, depth + 1))
    return Matched(sorted(found), sorted(unreadable), sorted(too_deep))


def _enter(path: str, depth: int, seen: set, unreadable: list, too_deep: list) -> list:
    """The entries of directory `path`, if it is entered now: not one
    already entered (by its device and inode), not past MAX_DEPTH (noted in
    too_deep) and readable (else noted in unreadable); else none."""
    try:
        st = os.stat(path or os.curdir)
    except OSError:
        return []  # removed meanwhile, or a dangling link
    if (st.st_dev, st.st_ino) in seen:
        return []
    seen.add((st.st_dev, st.st_ino))
    if depth >= MAX_DEPTH:
        too_deep.append(path)
        return []
    try:
        with os.scandir(path or os.curdir) as entries:
            return list(entries)
    except PermissionError:
        unreadable.append(path)
    except OSError:
        pass  # removed meanwhile, or not a directory any more
    return []


def _is_dir(entry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink: a link to a directory is one
    except OSError:
        return False


_REMOTE = re.compile(r"(s3|s3a|gs|az|abfss?|https?)://", re.IGNORECASE)


class FileDataset:
    """Map-style dataset over the files `pattern` matches (glob, `**` for
    subdirectories; sorted), matched again at the start of every epoch:
    files added between epochs are loaded from the next epoch on, and
    removed ones are dropped with one warning naming them.

    Sample i is file i: a `.npy` file's array (read straight into its row
    of the batch), any other file's bytes as a uint8 array, or with
    `decode`, whatever decode(path) returns.

    An object-store URL (s3://bucket/prefix/**/*.npy; gs://, az://,
    http(s)://) lists the store instead, and reads each object from a local
    cache that a fetcher process fills:

        FileDataset(url, decode=None, *, cache_dir=None, cache_limit_bytes=None,
                    train_on="all", storage_options=None)

    (NOTE [ Remote data ] in loader/datasets/remote/__init__.py; docs/object-stores.md)."""

    # a worker thread's own: NOTE [ Datasets that change with the epoch ]
    files = EpochView()

    def __new__(cls, pattern=None, decode=None, **remote):
        if isinstance(pattern, str) and _REMOTE.match(pattern):
            from loader.datasets.remote.dataset import RemoteFiles

            return super().__new__(RemoteFiles if cls is FileDataset else cls)
        if remote:
            raise ArgumentTypeError(f"FileDataset({pattern!r}): {', '.join(sorted(remote))} "
                                    f"appl{'y' if len(remote) > 1 else 'ies'} to object-store "
                                    f"URLs (s3://, gs://, az://, http(s)://) only")
        return super().__new__(cls)

    def __init__(self, pattern: str, decode=None):
        if not isinstance(pattern, (str, os.PathLike)):
            raise ArgumentTypeError(f"pattern must be a glob string, got {type(pattern).__name__}")
        if decode is not None and not callable(decode):
            raise ArgumentTypeError(f"decode must be callable, got {type(decode).__name__}")
        self.pattern, self.decode = os.fspath(pattern), decode
        self.files = self._match()

    def _match(self) -> list[str]:
        matched = match_files(self.pattern)
        self._warn_unwalked(matched)
        found = []
        for path in matched.paths:
            try:
                if stat.S_ISREG(os.stat(path).st_mode):
                    found.append(path)
            except OSError:
                pass  # removed while we looked (or a dangling symlink)
        return found

    def _warn_unwalked(self, matched: Matched) -> None:
        """One warning naming the directories the walk could not list (told
        again only if the list changes, not at every epoch)."""
        problem = (tuple(matched.unreadable), tuple(matched.too_deep))
        if problem == getattr(self, "_told", ((), ())):
            return
        self._told = problem
        for dirs, why in ((matched.unreadable, "cannot be listed (permission denied)"),
                          (matched.too_deep, f"are more than {MAX_DEPTH} levels deep")):
            if dirs:
                shown = ", ".join(dirs[:5]) + (f" and {len(dirs) - 5} more" if len(dirs) > 5 else "")
                warnings.warn(f"FileDataset({self.pattern!r}): {len(dirs)} director(ies) {why}; "
                              f"their files are not loaded: {shown}", RuntimeWarning, stacklevel=4)

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
        (NOTE [ Datasets that change with the epoch ] in datasets/snapshot.py)."""
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
