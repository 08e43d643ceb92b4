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
from loader.errors import ParquetFileChanged, ParquetFileError
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
    path: str
    index: int
    rows: int
    file: FileIdentity | None = None   # None: not checked (a snapshot made by hand)


class EpochRows(NamedTuple):
    """An epoch's snapshot: the row groups in their shuffled order, and
    the rows of that order each share gets (see the module docstring)."""
    groups: tuple          # RowGroup, in the epoch's order
    start: int             # this rank's first row of the order (padding wraps around)
    count: int             # rows this rank reads


class ParquetDataset:
    """Rows of Parquet files as a stream (an iterable dataset).

    paths_or_glob: a path, a glob pattern, or a list of them (matched again
    at the start of every epoch).  columns: the columns to read (None: all).
    shuffle: shuffle the order of the row groups at every epoch with the
    loader's seed."""

    # a worker thread's own: NOTE [ Datasets that change with the epoch ]
    rows_of_epoch = EpochView()

    def __init__(self, paths_or_glob, columns=None, shuffle=True):
        _pyarrow()
        if isinstance(paths_or_glob, (str, os.PathLike)):
            paths_or_glob = [paths_or_glob]
        self.patterns = [os.fspath(p) for p in paths_or_glob]
        self.columns = None if columns is None else list(columns)
        self.shuffle = shuffle
        self.rows_of_epoch: EpochRows | None = None
        self._groups_cache: dict = {}

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

    def epoch_snapshot(self, info: EpochInfo | None = None) -> EpochRows:
        info = info or EpochInfo(0, 0, 0, 1)
        groups = [g for path in self._files() for g in self._groups(path) if g.rows]
        if self.shuffle:
            order = np.random.default_rng([info.seed & ((1 << 63) - 1), info.epoch]).permutation(
                len(groups))
            groups = [groups[i] for i in order]
        total = sum(g.rows for g in groups)
        per_rank = -(-total // info.world_size) if info.world_size > 1 else total
        self.rows_of_epoch = EpochRows(tuple(groups), info.rank * per_rank, per_rank)
        return self.rows_of_epoch

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
        # this worker's part of this rank's rows: an even split
        base, extra = divmod(epoch.count, workers)
        first = epoch.start + worker * base + min(worker, extra)
        return self._rows(epoch.groups, first, base + (worker < extra))

    def _rows(self, groups, first: int, count: int):
        """count rows of the epoch's order from row `first` (wrapping
        around its end: the padding of the last rank)."""
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
            yield from self._read(g, lo, hi)
            left -= hi - lo
            k, pos = (k + 1) % len(groups), int(starts[(k + 1) % len(groups)])

    def _read(self, g: RowGroup, lo: int, hi: int):
        table = _read_group(g, self.columns)
        if lo or hi < table.num_rows:
            table = table.slice(lo, hi - lo)
        names = table.column_names
        columns = [_column_values(table.column(i)) for i in range(len(names))]
        for r in range(table.num_rows):
            yield {name: col[r] for name, col in zip(names, columns)}


@contextlib.contextmanager
def _open_parquet(path: str):
    """(pyarrow ParquetFile, FileIdentity) of path, opened without blocking
    (open_regular: a FIFO in its place is an error, not a hang).  Any
    failure to read it as Parquet is a ParquetFileError naming the file."""
    pa = _pyarrow()
    with os.fdopen(open_regular(path), "rb") as f:
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


def _read_group(g: RowGroup, columns):
    """Row group g of its file, checked against the epoch's snapshot of it:
    a file rewritten since then (the snapshot's rows are planned into this
    epoch's shares) is an error naming what changed, never fewer rows."""
    pa = _pyarrow()
    try:
        with _open_parquet(g.path) as (pf, ident):
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
