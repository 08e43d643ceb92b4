"""The messages between a remote dataset's main and its fetcher (NOTE
[ Remote data ]): named records, pickled over their socketpair, with what
does not fit one packet (an order, positions, a record of objects) passed
as a memfd beside it.  What each asks and answers is in the fetcher's
docstring."""

from __future__ import annotations

import json
import os
import pickle
import socket
import zlib
from typing import NamedTuple

import numpy as np


class ListRequest(NamedTuple):
    gen: int


class ListDone(NamedTuple):
    gen: int
    count: int
    error: tuple | None    # (kind, status, url, text) of a RemoteError


class Adopt(NamedTuple):
    slot: int
    gen: int


class Adopted(NamedTuple):
    slot: int
    gen: int
    count: int


class Order(NamedTuple):
    slot: int
    count: int             # positions; the order's int64 object indices come as an fd


class Describe(NamedTuple):
    """What the objects at these positions of a slot's listing are (the
    positions come as an fd of int64): for a state that resumes the epoch
    in a new job (RemoteFiles.epoch_record)."""
    slot: int
    gen: int
    count: int


class Described(NamedTuple):
    nbytes: int            # the record (an fd; 0 and no fd: the slot holds another listing)


class Install(NamedTuple):
    """A listing main has (a record of Described, as an fd), under gen:
    adopted next, as an epoch resumed from a state trains exactly it."""
    gen: int
    nbytes: int


class Installed(NamedTuple):
    gen: int
    count: int


class Footers(NamedTuple):
    """The Parquet footers of the objects at these positions of a slot's
    listing (positions as an fd of int64; a remote ParquetDataset)."""
    slot: int
    gen: int
    count: int


class Footed(NamedTuple):
    nbytes: int            # footers.footers_record() (an fd; 0 and no fd: the slot moved on)


class Forget(NamedTuple):
    """The loader dropped its runs (load_state_dict): no slot's epoch is
    live; what they pinned is unpinned, and what their workers still wait
    for fails (their runs are dropped: nobody sees it)."""


class Count(NamedTuple):
    """Count what the workers trained now (stats() reads it next)."""


class Counted(NamedTuple):
    pass


class Stop(NamedTuple):
    pass


class Fatal(NamedTuple):
    text: str


MAX_MESSAGE = 1 << 16


def send(sock: socket.socket, msg, fds=()) -> None:
    sock.sendmsg([pickle.dumps(msg)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        np.array(fds, np.int32).tobytes())] if fds else [])


def receive(sock: socket.socket):
    """(message, fds) of the next packet; (None, []) once the peer closed."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
    except ConnectionResetError:
        return None, []
    if not data:
        return None, fds
    return pickle.loads(data), fds


# --- what travels as a memfd -------------------------------------------------------------

def listing_record(listing, positions: np.ndarray) -> bytes:
    """The objects at these positions of a listing (keys, ETags, sizes),
    compressed: what a state keeps of a train_on="cached" epoch's set."""
    objects = {"keys": [listing.keys[i] for i in positions],
               "etags": [listing.etags[i] for i in positions],
               "sizes": [int(listing.sizes[i]) for i in positions]}
    return zlib.compress(json.dumps(objects, separators=(",", ":")).encode(), 6)


def parse_record(record: bytes) -> tuple[list, list, list]:
    """(keys, etags, sizes) of listing_record()'s bytes; ValueError if they
    are not such a record."""
    try:
        objects = json.loads(zlib.decompress(record))
        keys, etags, sizes = objects["keys"], objects["etags"], objects["sizes"]
    except (zlib.error, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"not a record of an epoch's objects ({type(e).__name__}: {e})") from None
    if not (isinstance(keys, list) and isinstance(etags, list) and isinstance(sizes, list)
            and len(keys) == len(etags) == len(sizes)
            and all(isinstance(k, str) for k in keys) and all(isinstance(t, str) for t in etags)
            and all(isinstance(n, int) and n >= 0 for n in sizes)):
        raise ValueError("not a record of an epoch's objects (its keys, ETags and sizes differ "
                         "in kind or count)")
    return keys, etags, sizes


class memfd_of:
    """A memfd holding these bytes, closed on exit (sent as an fd: an order
    or a record can be larger than one message)."""

    def __init__(self, data):
        self.fd = os.memfd_create("shmloader-record", os.MFD_CLOEXEC)
        try:
            _write_all(self.fd, data)
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _write_all(fd: int, data) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.write(fd, view[done:])


def read_bytes(fd: int, nbytes: int) -> bytes:
    """nbytes from the start of the memfd fd (its writer moved the shared offset)."""
    out = bytearray(nbytes)
    view, done = memoryview(out), 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], done)
        if got == 0:
            raise EOFError(f"the record ends after {done} of {nbytes} bytes")
        done += got
    return bytes(out)


def read_int64(fd: int, count: int) -> np.ndarray:
    """count int64 from the start of the memfd fd (an order, positions:
    its writer moved the descriptor's offset, which the passed fd shares)."""
    out = np.empty(count, np.int64)
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], done)
        if got == 0:
            raise EOFError(f"the epoch's order ends after {done} of {len(view)} bytes")
        done += got
    return out
