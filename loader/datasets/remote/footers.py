"""Parquet footers read from the store (in the fetcher): a remote
ParquetDataset plans its epoch's row groups from them before any file is
fetched whole.  One ranged GET of an object's tail (If-Match its listed
ETag), a second if its metadata is longer than that tail."""

from __future__ import annotations

import io
import json
import zlib

TAIL_BYTES = 64 << 10   # pyarrow reads this much of a file's end to find its footer


def footer(store, key: str, etag: str, size: int, url: str, endpoint: str) -> dict:
    """{"rows": rows of each row group, "schema": the Arrow schema} of a
    Parquet object, or {"error": why it is not one}.  A RemoteError if the
    store does not give its tail."""
    import pyarrow
    import pyarrow.parquet as pq

    start = max(0, size - TAIL_BYTES)
    tail = _range(store, key, etag, start, size, url, endpoint)
    if size < 12 or tail[-4:] != b"PAR1":
        return {"error": "it is not a Parquet file (it does not end in PAR1)"}
    need = int.from_bytes(tail[-8:-4], "little") + 8
    if need > size - 4:
        return {"error": f"its footer says its metadata is {need - 8} bytes, more than the file"}
    if need > len(tail):
        start = size - need
        tail = _range(store, key, etag, start, size, url, endpoint)
    try:
        pf = pq.ParquetFile(_Tail(tail, start, size))
        meta = pf.metadata
        return {"rows": [meta.row_group(i).num_rows for i in range(meta.num_row_groups)],
                "schema": str(pf.schema_arrow.remove_metadata())}
    except (pyarrow.ArrowException, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _range(store, key: str, etag: str, start: int, end: int, url: str, endpoint: str) -> bytes:
    import obstore

    from loader.datasets.remote.store import classify

    try:
        got = obstore.get(store, key, options={"if_match": etag, "range": (start, end)})
        return bytes(got.bytes())
    except Exception as e:
        raise classify(e, url, endpoint, "reading the Parquet footer of") from e


class _Tail(io.RawIOBase):
    """A file of `size` bytes of which only the bytes from `start` are
    here: what pyarrow reads of a Parquet file to parse its footer."""

    def __init__(self, tail: bytes, start: int, size: int):
        self.tail, self.start, self.size, self.pos = tail, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        if self.pos < self.start:
            raise OSError(f"read at {self.pos}, before the footer's bytes (from {self.start})")
        data = self.tail[self.pos - self.start:self.pos - self.start + len(buf)]
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


def footers_record(footers: list[dict]) -> bytes:
    return zlib.compress(json.dumps(footers, separators=(",", ":")).encode(), 6)


def parse_footers(record: bytes) -> list[dict]:
    return json.loads(zlib.decompress(record))
