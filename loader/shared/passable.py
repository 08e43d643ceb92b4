"""Shared memory a process started clean (start_method="spawn") can open:
every region behind a memfd whose descriptor the new process is given,
and the pickling that sends the loader's objects over by those
descriptors instead of by value.  See NOTE [ Starting clean ].

NOTE [ Starting clean ]
A forked child inherits main's mappings; a process started by exec (a
fresh interpreter) inherits only descriptors.  So with start_method=
"spawn" every piece of memory the loader's processes share is made
behind a memfd: the arena and the spill heap (always memfds), the rings
(shmq.Queue(anonymous=True, keep_fd=True)) and the small word arrays
(`shared_array` here: its memfd stays open while the array lives).
Main pickles each child's (role, target, args) with `dumps`: an array
that lies in one of these regions travels as (descriptor, offset, dtype,
shape, strides) and the child maps the same pages again (`loads`), so a
batch's rows are written into the very memory main views, as with fork;
a ring travels as its descriptor and a producer slot reserved for the
child (shmq.Queue.__reduce__).  The child is started with exactly the
descriptors `dumps` found (plus the plain descriptors the shared state
names), at the same numbers.  Nothing has a name: a SIGKILL leaves
nothing in /dev/shm, as with fork.
"""

from __future__ import annotations

import io
import os
import pickle
import weakref

import numpy as np

import shmq
from loader._native import arena_array

# address of a region's first byte -> (its size in bytes, its memfd)
_regions: dict[int, tuple[int, int]] = {}


def shared_array(shape, dtype, passable: bool) -> np.ndarray:
    """A zero-filled array of shared memory.  passable=False: shmq's
    anonymous mapping (processes forked after this share it); True: a
    memfd a spawned process can map too (see NOTE [ Starting clean ])."""
    if not passable:
        return shmq.sync.shared_array(shape, dtype)
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(1, dt.itemsize * int(np.prod(shape, dtype=np.int64)))
    fd = os.memfd_create("shmloader-words", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        base = arena_array(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    register(base, fd)
    return base[:dt.itemsize * int(np.prod(shape, dtype=np.int64))].view(dt).reshape(shape)


def register(base: np.ndarray, fd: int) -> None:
    """base (a whole mapping of the memfd fd, from its start) may be sent
    to a spawned process; fd is closed when base and every view of it are
    gone."""
    address = base.__array_interface__["data"][0]
    _regions[address] = (base.nbytes, fd)
    weakref.finalize(base, _forget, address, fd)


def _forget(address: int, fd: int) -> None:
    if _regions.get(address, (0, -1))[1] == fd:
        del _regions[address]
    os.close(fd)


def _region_of(arr: np.ndarray):
    """(address, nbytes, fd) of the registered region arr lies in, or None."""
    start = arr.__array_interface__["data"][0]
    for address, (nbytes, fd) in _regions.items():
        if address <= start < address + nbytes:
            return address, nbytes, fd
    return None


class _Pickler(pickle.Pickler):
    """Sends arrays of registered regions by descriptor; notes every
    descriptor the child must be given.  `early`: an object pickled apart
    (by another _Pickler), referred to here by a marker."""

    def __init__(self, file, early=None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: set[int] = set()
        self.early = early

    def persistent_id(self, obj):
        if obj is self.early and obj is not None:
            return ("early",)
        if type(obj) is np.ndarray:
            found = _region_of(obj)
            if found is None:
                _refuse_unpassable(obj)
                return None
            address, nbytes, fd = found
            self.fds.add(fd)
            start = obj.__array_interface__["data"][0]
            return ("region", fd, nbytes, start - address, obj.dtype, obj.shape, obj.strides)
        if type(obj) is shmq.Queue and obj.fd is not None:
            self.fds.add(obj.fd)  # pickled by its own __reduce__, attaching by this fd
        return None


def _refuse_unpassable(arr: np.ndarray) -> None:
    """An array of shared memory that is not behind a registered memfd
    would travel by value: the child would write into a copy nobody
    reads.  A loader bug, never the user's: say so rather than hang."""
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if type(base).__name__ in ("Mapping", "ArenaMap"):
        raise RuntimeError(f"ShmLoader: an array of shared memory ({arr.dtype}, shape "
                           f"{arr.shape}) is not behind a memfd a spawned process can open: a "
                           f"bug of the loader's start_method='spawn'; use start_method='fork'")


def dumps(obj, early=None) -> tuple[bytes, set[int]]:
    """(obj pickled for a spawned process, the descriptors it needs).
    early: an object within obj that travels apart (dumps(early)), loaded
    first; obj's pickle refers to it."""
    buf = io.BytesIO()
    p = _Pickler(buf, early)
    p.dump(obj)
    return buf.getvalue(), p.fds


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, early):
        super().__init__(file)
        self.mapped: dict[int, np.ndarray] = {}  # fd -> its mapping here, made once
        self.early = early

    def persistent_load(self, pid):
        if pid == ("early",):
            return self.early
        kind, fd, nbytes, offset, dtype, shape, strides = pid
        if kind != "region":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        base = self.mapped.get(fd)
        if base is None:
            base = self.mapped[fd] = arena_array(fd, nbytes)
        return np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)


def loads(data: bytes, early=None):
    """dumps's object again, in the spawned process (early: the object
    dumps was given as early, loaded already)."""
    return _Unpickler(io.BytesIO(data), early).load()
