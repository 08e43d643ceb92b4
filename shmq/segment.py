"""Names and lifetimes of shmq segments in /dev/shm.

Names are ``/shmq-<creator pid>-<random>``: the pid makes stale segments easy
to attribute, the random part makes collisions impossible in practice.  Only
the creating process unlinks a name (see Queue.close); a segment whose
creator died is *stale* and ``python -m shmq clean`` removes it.  A segment
whose creator is alive (same pid and same start time, so a reused pid does
not count) is never touched.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets

import posix_ipc

from shmq import _core
from shmq.errors import ShmFull

PREFIX = "shmq-"
SHM_DIR = "/dev/shm"

__all__ = ["PREFIX", "SHM_DIR", "new_name", "free_bytes", "shm_size_option", "create",
           "create_anonymous", "open_existing", "unlink",
           "SegmentInfo", "list_segments", "remove_stale"]


def new_name(kind: str = "") -> str:
    """A fresh segment name for this process; ``kind`` tags its use."""
    tag = f"{kind}-" if kind else ""
    return f"/{PREFIX}{tag}{os.getpid()}-{secrets.token_hex(6)}"


def free_bytes() -> int:
    """Bytes free in /dev/shm for this user."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def shm_size_option(nbytes: int) -> str:
    """The docker option that leaves room for nbytes of segments, twice over."""
    return f"--shm-size={max(1, -(-2 * nbytes // (1 << 30)))}g"


def _shm_full(name: str, nbytes: int) -> ShmFull:
    return ShmFull(
        f"/dev/shm has {free_bytes()} bytes free but shmq segment {name!r} needs {nbytes}; "
        f"free space in /dev/shm (stale segments: `python -m shmq clean`), use a smaller "
        f"capacity_bytes, or give the container more shared memory (docker run "
        f"{shm_size_option(nbytes)})")


def create(name: str, nbytes: int) -> int:
    """Create the segment and reserve all of its pages now.

    Returns an fd the caller closes.  Reserving with posix_fallocate makes a
    full /dev/shm fail here with ShmFull instead of delivering SIGBUS on the
    first write into a page that has no backing; on failure the name is
    removed again, so nothing half-built is left behind."""
    if nbytes > free_bytes():
        raise _shm_full(name, nbytes)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    fd = os.dup(shm.fd)
    shm.close_fd()
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        unlink(name)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _shm_full(name, nbytes) from e
        raise
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    return fd


def create_anonymous(nbytes: int) -> int:
    """An fd of nbytes of unnamed shared memory (memfd), every page reserved.

    It never appears in /dev/shm, so no crash can leave it behind and
    /dev/shm's size does not limit it; it is freed when the last process
    that maps it unmaps it or exits."""
    fd = os.memfd_create("shmq-anonymous", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise ShmFull(
                f"cannot reserve {nbytes} bytes of memory for an anonymous shmq queue "
                f"({os.strerror(e.errno)}); free memory or use a smaller capacity_bytes") from e
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_existing(name: str) -> tuple[int, int, bytes]:
    """(fd, size in bytes, first bytes of the header) of an existing segment."""
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"no shmq queue named {name!r} in /dev/shm: it was closed by its creator, removed "
            f"with Queue.unlink(), or the name is mistyped", name) from None
    fd = os.dup(shm.fd)
    shm.close_fd()
    size = os.fstat(fd).st_size
    return fd, size, os.pread(fd, _core.HEADER_BYTES, 0)


def unlink(name: str) -> bool:
    """Remove the name; True if it existed."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    name: str
    size_bytes: int
    creator_pid: int | None
    alive: bool


def _pid_from_name(entry: str) -> int | None:
    for part in entry[len(PREFIX):].split("-"):
        if part.isdigit():
            return int(part)
    return None


def list_segments() -> list[SegmentInfo]:
    """Every shmq segment in /dev/shm with whether its creator still runs."""
    found = []
    for entry in sorted(os.listdir(SHM_DIR)):
        if not entry.startswith(PREFIX):
            continue
        path = os.path.join(SHM_DIR, entry)
        try:
            with open(path, "rb") as f:
                head = f.read(_core.HEADER_BYTES)
            size = os.stat(path).st_size
        except OSError:
            continue
        creator = _core.read_creator(head)
        if creator is not None:
            pid, starttime = creator
            now = _core.proc_starttime(pid)
            alive = now != 0 and (starttime == 0 or now == starttime)
        else:
            pid = _pid_from_name(entry)
            alive = pid is not None and _core.proc_starttime(pid) != 0
        found.append(SegmentInfo("/" + entry, size, pid, alive))
    return found


def remove_stale(dry_run: bool = False) -> list[SegmentInfo]:
    """Unlink segments whose creator is dead; return what was (or would be)
    removed."""
    stale = [s for s in list_segments() if not s.alive]
    if not dry_run:
        for s in stale:
            unlink(s.name)
    return stale
