"""ParquetDataset: Parquet files read as a stream of rows, on pyarrow (the
optional [parquet] extra).

Each epoch (NOTE [ Datasets that change with the epoch ] in datasets/snapshot.py)
main lists the files' row groups and shuffles their order with the
loader's seed and the epoch.  The rows of that order are then cut into
equal contiguous shares: one per rank (padded, as torch's
DistributedSampler pads, by repeating the epoch's first rows, so every
rank gets the same count), and within a rank one per worker (the same
split on every rank, so every rank makes the same number of batches and
no collective waits for a rank that has run out).  A worker reads the
row groups its share overlaps, one at a time, and yields rows as dicts of
numpy values: numbers as numpy scalars, fixed-size lists as arrays
(nested ones as multi-dimensional arrays), strings as str, binary as
bytes, nulls as None.  ShmLoader(shuffle_buffer=N) mixes rows across row
groups.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import numpy as np

from loader.datasets.snapshot import EpochInfo, EpochView
from loader.errors import ParquetFileChanged, ParquetFileError, remote_error_of
from loader.datasets.files import match_files, open_regular


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError("ParquetDataset needs pyarrow: pip install 'shmq[parquet]' "
                          "(or pip install pyarrow)") from None
    return pyarrow


class FileIdentity(NamedTuple):
    """What the snapshot saw of a file: a rewrite changes at least one."""
    size: int
    mtime_ns: int
    schema: str            # the Arrow schema, without metadata


class RowGroup(NamedTuple):
    path: str              # (an object's URL, for one in an object store)
    index: int
    rows: int
    file: FileIdentity | None = None   # None: not checked (a snapshot made by hand, or an
                                       # object: its cache file is of its listed ETag)
    object: int = -1       # an object's index in the epoch's listing (-1: a local file)


class EpochRows(NamedTuple):
    """An epoch's snapshot: the row groups in their shuffled order, and
    the rows of that order each share gets (see the module docstring)."""
    groups: tuple          # RowGroup, in the epoch's order
    start: int             # this rank's first row of the order (padding wraps around)
    count: int             # rows this rank reads
    objects: object = None  # files in an object store: the listing's RemoteSnapshot


class ParquetDataset:
    """Rows of Parquet files as a stream (an iterable dataset).

    paths_or_glob: a path, a glob pattern, or a list of them (matched again
    at the start of every epoch); or one object-store URL pattern
    ("s3://bucket/tables/**/*.parquet"), listed again at every epoch, its
    objects fetched into a local cache ahead of the workers as a remote
    FileDataset's are (docs/object-stores.md; the keyword arguments after
    shuffle are FileDataset's for a URL).  columns: the columns to read
    (None: all).  shuffle: shuffle the order of the row groups at every
    epoch with the loader's seed."""

    # a worker thread's own: NOTE [ Datasets that change with the epoch ]
    rows_of_epoch = EpochView()

    def __init__(self, paths_or_glob, columns=None, shuffle=True, *, cache_dir=None,
                 cache_limit_bytes=None, storage_options=None, requests_in_flight=32,
                 request_deadline=60.0, listing_timeout=600.0):
        from loader.datasets.remote.store import is_remote

        _pyarrow()
        if isinstance(paths_or_glob, (str, os.PathLike)):
            paths_or_glob = [paths_or_glob]
        self.patterns = [os.fspath(p) for p in paths_or_glob]
        self.columns = None if columns is None else list(columns)
        self.shuffle = shuffle
        self.rows_of_epoch: EpochRows | None = None
        self._groups_cache: dict = {}
        self._remote = None
        self._planned: dict = {}   # EpochInfo -> its EpochRows (an object-store URL's)
        remote = [p for p in self.patterns if is_remote(p)]
        if remote and len(self.patterns) > 1:
            raise ValueError(f"ParquetDataset: an object-store URL is given alone (one pattern: "
                             f"use ** or a common prefix), got {self.patterns}")
        if remote:
            from loader.datasets.remote.dataset import RemoteFiles

            self._remote = RemoteFiles(
                remote[0], cache_dir=cache_dir, cache_limit_bytes=cache_limit_bytes,
                storage_options=storage_options, requests_in_flight=requests_in_flight,
                request_deadline=request_deadline, listing_timeout=listing_timeout)
            # what the fetcher did (ShmLoader.stats()["remote"]): only a URL's has one
            self.remote_stats = self._remote.remote_stats
        elif cache_dir is not None or cache_limit_bytes is not None or storage_options:
            raise ValueError("ParquetDataset: cache_dir, cache_limit_bytes and storage_options "
                             "are for an object-store URL (s3://...); these paths are local")

    def forget_epochs(self) -> None:
        """The loader dropped its runs (load_state_dict): epochs are planned
        anew (an object-store URL's counts of rows to read are a run's)."""
        self._planned = {}
        if self._remote is not None:
            self._remote.forget_epochs()

    def close(self) -> None:
        """Stop the fetcher of an object-store URL (it also stops when the
        dataset is collected, and with the process)."""
        if self._remote is not None:
            self._remote.close()

    # --- the epoch's row groups (main) ----------------------------------------------

    def _files(self) -> list[str]:
        found = []
        for pattern in self.patterns:
            # a bounded walk, not glob: directory symlinks that loop made glob hang
            found += [p for p in match_files(pattern).paths if os.path.isfile(p)]
        if not found:
            raise FileNotFoundError(f"ParquetDataset: no file matches {self.patterns}")
        return sorted(set(found))

    def _groups(self, path: str) -> list[RowGroup]:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in self._groups_cache:
            with _open_parquet(path) as (pf, ident):
                meta = pf.metadata
                self._groups_cache[key] = [RowGroup(path, i, meta.row_group(i).num_rows, ident)
                                           for i in range(meta.num_row_groups)]
        return self._groups_cache[key]

    def _objects(self, info: EpochInfo):
        """(The RemoteSnapshot of an object-store URL's listing for the epoch,
        its row groups, in the listing's order)."""
        snap = self._remote.epoch_snapshot(info)
        groups = []
        for i, found in enumerate(self._remote.footers(snap)):
            if "failed" in found:
                kind, status, url, text = found["failed"]
                raise remote_error_of(kind, text, url, self._remote.endpoint, status)
            if "error" in found:
                raise ParquetFileError(f"{found['url']} cannot be read as Parquet "
                                       f"({found['error']}); it is corrupt, truncated or not a "
                                       f"Parquet file: rewrite it, or leave it out of the URL's "
                                       f"pattern")
            groups += [RowGroup(path=found["url"], index=k, rows=rows, object=i)
                       for k, rows in enumerate(found["rows"])]
        return snap, groups

    def epoch_snapshot(self, info: EpochInfo | None = None) -> EpochRows:
        info = info or EpochInfo(0, 0, 0, 1)
        objects = None
        if self._remote is not None:
            objects, groups = self._objects(info)
            planned = self._planned.get(info)
            if planned is not None and planned.objects == objects:
                # the same epoch asked again (a run started ahead): its fetches are
                # planned, and its rows may be in the workers' hands already
                self.rows_of_epoch = planned
                return planned
        else:
            groups = [g for path in self._files() for g in self._groups(path)]
        groups = [g for g in groups if g.rows]
        if self.shuffle:
            rng = np.random.default_rng([info.seed & ((1 << 63) - 1), info.epoch])
            groups = _shuffled(groups, rng, by_file=objects is not None)
        total = sum(g.rows for g in groups)
        per_rank = -(-total // info.world_size) if info.world_size > 1 else total
        self.rows_of_epoch = EpochRows(tuple(groups), info.rank * per_rank, per_rank, objects)
        if objects is not None:
            self._plan_fetches(self.rows_of_epoch, max(1, info.num_workers or 0))
            self._planned = {k: v for k, v in self._planned.items() if k.epoch >= info.epoch - 1}
            self._planned[info] = self.rows_of_epoch
        return self.rows_of_epoch

    def _plan_fetches(self, epoch: EpochRows, workers: int) -> None:
        """Tell the fetcher which objects this rank's rows read, in the
        order they are needed (each worker reads its share from its start,
        and the batches come from the workers in turn: an object's place is
        how far into its share a worker first reads it), and how many rows
        of each, so that each is unpinned once read."""
        snap, groups = epoch.objects, epoch.groups
        rows = np.array([g.rows for g in groups], np.int64)
        obj = np.array([g.object for g in groups], np.int64)
        starts = np.concatenate([[0], np.cumsum(rows)])
        total = int(starts[-1])
        per_object = np.zeros(snap.count, np.int64)
        never = np.iinfo(np.int64).max
        first_at = np.full(snap.count, never)
        for first, count in _shares(epoch.start, epoch.count, workers):
            for lo, hi, offset in _spans(first, count, total):
                read = np.clip(np.minimum(starts[1:], hi) - np.maximum(starts[:-1], lo), 0, None)
                np.add.at(per_object, obj, read)
                at = np.where(read > 0, np.maximum(starts[:-1], lo) - lo + offset, never)
                np.minimum.at(first_at, obj, at)
        self._remote.rows_to_read(snap, per_object)
        needed = np.flatnonzero(per_object > 0)
        self._remote.epoch_order(snap, needed[np.argsort(first_at[needed], kind="stable")])

    def restore_snapshot(self, snapshot: EpochRows) -> None:
        self.rows_of_epoch = snapshot

    # --- rows (workers) ----------------------------------------------------------------

    def __iter__(self):
        """This worker's rows of the epoch, as iter() is called (not at the
        first next(): the epoch's rows are the ones restored before it)."""
        from loader.worker.seeding import get_worker_info

        epoch = self.rows_of_epoch if self.rows_of_epoch is not None else self.epoch_snapshot()
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        first, count = _shares(epoch.start, epoch.count, workers)[worker]
        return self._rows(epoch, first, count)

    def _rows(self, epoch: EpochRows, first: int, count: int):
        """count rows of the epoch's order from row `first` (wrapping
        around its end: the padding of the last rank)."""
        groups = epoch.groups
        total = sum(g.rows for g in groups)
        if total == 0 or count == 0:
            return
        pos, left = first % total, count
        starts = np.cumsum([0] + [g.rows for g in groups])
        k = int(np.searchsorted(starts, pos, side="right")) - 1
        while left:
            g = groups[k]
            lo = pos - int(starts[k])
            hi = min(g.rows, lo + left)
            yield from self._read(g, lo, hi, epoch.objects)
            left -= hi - lo
            k, pos = (k + 1) % len(groups), int(starts[(k + 1) % len(groups)])

    def _read(self, g: RowGroup, lo: int, hi: int, snap=None):
        if g.object >= 0:
            path, fd = self._remote.open_object(snap, g.object)
            table = _read_group(g, self.columns, fd)
            self._remote.read_rows(snap, g.object, hi - lo)
        else:
            table = _read_group(g, self.columns)
        if lo or hi < table.num_rows:
            table = table.slice(lo, hi - lo)
        names = table.column_names
        columns = [_column_values(table.column(i)) for i in range(len(names))]
        for r in range(table.num_rows):
            yield {name: col[r] for name, col in zip(names, columns)}


def _shares(start: int, count: int, workers: int) -> list[tuple[int, int]]:
    """(first row, rows) of each worker's part of a rank's rows: an even split."""
    base, extra = divmod(count, workers)
    return [(start + w * base + min(w, extra), base + (w < extra)) for w in range(workers)]


def _spans(first: int, count: int, total: int) -> list[tuple[int, int, int]]:
    """Rows [first, first + count) of an order of total rows, wrapping
    around its end (the last rank's padding): (lo, hi, rows before it)."""
    out, done, pos = [], 0, first % total if total else 0
    while done < count and total:
        hi = min(total, pos + count - done)
        out.append((pos, hi, done))
        done += hi - pos
        pos = 0
    return out


def _shuffled(groups: list, rng, by_file: bool) -> list:
    """The row groups in a random order; by_file (objects of a store): the
    files in a random order, each one's groups together in a random order
    of their own, so that a file is fetched once an epoch and read whole
    before it can be evicted (ShmLoader(shuffle_buffer=N) mixes rows
    across files)."""
    if not by_file:
        return [groups[i] for i in rng.permutation(len(groups))]
    files: dict = {}
    for g in groups:
        files.setdefault(g.object, []).append(g)
    out = []
    for k in rng.permutation(sorted(files)):
        mine = files[int(k)]
        out += [mine[i] for i in rng.permutation(len(mine))]
    return out


@contextlib.contextmanager
def _open_parquet(path: str, fd: int | None = None):
    """(pyarrow ParquetFile, FileIdentity) of path (or of fd, opened for
    it, which is then closed), opened without blocking (open_regular: a
    FIFO in its place is an error, not a hang).  Any failure to read it as
    Parquet is a ParquetFileError naming the file."""
    pa = _pyarrow()
    with os.fdopen(open_regular(path) if fd is None else fd, "rb") as f:
        st = os.fstat(f.fileno())
        try:
            pf = pa.parquet.ParquetFile(f)
            schema = str(pf.schema_arrow.remove_metadata())
        except (pa.ArrowException, OSError) as e:
            raise ParquetFileError(
                f"{path} cannot be read as Parquet ({type(e).__name__}: {e}); it is corrupt, "
                f"truncated or not a Parquet file: rewrite it, or remove it from "
                f"ParquetDataset's paths") from e
        yield pf, FileIdentity(st.st_size, st.st_mtime_ns, schema)


def _read_group(g: RowGroup, columns, fd: int | None = None):
    """Row group g of its file (or of fd, its cached object's, closed
    after), checked against the epoch's snapshot of it: a file rewritten
    since then (the snapshot's rows are planned into this epoch's shares)
    is an error naming what changed, never fewer rows."""
    pa = _pyarrow()
    try:
        with _open_parquet(g.path, fd) as (pf, ident):
            if g.file is not None and ident != g.file:
                _raise_changed(g, ident, pf)
            try:
                table = pf.read_row_group(g.index, columns=columns)
            except (pa.ArrowException, OSError) as e:
                raise ParquetFileError(f"{g.path}: row group {g.index} cannot be read "
                                       f"({type(e).__name__}: {e}); the file is corrupt or was "
                                       f"truncated: rewrite it, or remove it from "
                                       f"ParquetDataset's paths") from e
    except ParquetFileError as e:
        _raise_if_rewritten_meanwhile(g, e)
        raise
    if table.num_rows != g.rows:
        raise ParquetFileChanged(f"{g.path}: row group {g.index} has {table.num_rows} rows but "
                                 f"this epoch planned {g.rows} (the file was rewritten during the "
                                 f"epoch?); write new files under new names, or rewrite them "
                                 f"between epochs")
    return table


def _raise_if_rewritten_meanwhile(g: RowGroup, error: ParquetFileError) -> None:
    """A file rewritten in place WHILE it is read (after the identity check
    on the open fd) reads as torn: if it is no longer the snapshot's file,
    say that, not "corrupt"."""
    if g.object >= 0:
        return   # (an object's cache file is never rewritten: a new ETag, a new file)
    try:
        st = os.stat(g.path)
    except OSError:
        return
    if g.file is None or (st.st_size, st.st_mtime_ns) == (g.file.size, g.file.mtime_ns):
        return
    raise ParquetFileChanged(
        f"{g.path} was rewritten during the epoch: it is now {st.st_size} bytes, mtime "
        f"{st.st_mtime_ns} ns (the epoch's snapshot: {g.file.size} bytes, mtime "
        f"{g.file.mtime_ns} ns); row group {g.index} could not be read while it changed "
        f"({error.__cause__}) and this epoch planned {g.rows} rows from it; write new files "
        f"under new names, or rewrite them between epochs") from error


def _raise_changed(g: RowGroup, now: FileIdentity, pf) -> None:
    groups = pf.metadata.num_row_groups
    rows = pf.metadata.row_group(g.index).num_rows if g.index < groups else 0
    what = (f"its schema changed from {g.file.schema!r} to {now.schema!r}"
            if now.schema != g.file.schema else
            f"it is now {now.size} bytes, mtime {now.mtime_ns} ns (the epoch's snapshot: "
            f"{g.file.size} bytes, mtime {g.file.mtime_ns} ns)")
    raise ParquetFileChanged(
        f"{g.path} was rewritten during the epoch: {what}; row group {g.index} now has {rows} "
        f"rows ({groups} row group(s)) but this epoch planned {g.rows}; write new files under "
        f"new names, or rewrite them between epochs")


def _column_values(column) -> list:
    """A column's values, one per row, as numpy-friendly Python objects."""
    pa = _pyarrow()
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    t = arr.type
    if pa.types.is_fixed_size_list(t) and arr.null_count == 0:
        shape = []
        flat = arr
        while pa.types.is_fixed_size_list(flat.type):
            shape.append(flat.type.list_size)
            flat = flat.flatten()
        if flat.null_count == 0 and _numeric(pa, flat.type):
            values = flat.to_numpy(zero_copy_only=False).reshape([len(arr)] + shape)
            return list(values)  # one array per row (views of the block)
    if _numeric(pa, t) and arr.null_count == 0:
        return list(arr.to_numpy(zero_copy_only=False))  # numpy scalars
    return arr.to_pylist()  # strings, binary, nulls, nested lists


def _numeric(pa, t) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
