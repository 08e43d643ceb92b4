"""Names and lifetimes of shmq segments in /dev/shm.

Names are ``/shmq-<creator pid>-<random>``: the pid makes stale segments easy
to attribute, the random part makes collisions impossible in practice.  Only
the creating process unlinks a name (see Queue.close); a segment whose
creator died is *stale* and ``python -m shmq clean`` removes it.  A segment
whose creator is alive (same pid and same start time, so a reused pid does
not count) is never touched, nor is one whose creator ran in another pid
namespace (NOTE [pid namespaces] in shmq_ring.h) unless --force says so.

NOTE [ Whose segment ]
~~~~~~~~~~~~~~~~~~~~~~
A consumer unpickles the structure of every TREE record (any message but a
single plain array), and a pickle can call any importable function: whoever
can write a segment can run code as its consumer.  /dev/shm is writable by
every local user, and names are public (`ls /dev/shm`): once a queue is
gone, anyone may create a segment under its name.  So shmq creates
segments 0600 (shm_open's mode, less the umask), and open_existing, the
one place a segment is opened by name (Queue.attach, and a queue sent to a
spawned process), refuses with UntrustedSegment a segment that another uid
owns, or that its mode lets the group or others write (an ACL granting
another user write shows as group write: the mode's group bits are the
ACL mask).  It checks the open descriptor with fstat, so the checked file
is the one mapped.  list_segments reads the headers of other users'
segments, but only their creator's pid and start time, never a record.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pwd
import re
import secrets
import stat
from typing import NamedTuple

import posix_ipc

from shmq import _core
from shmq.errors import IncompatibleRing, ShmFull, UntrustedSegment

PREFIX = "shmq-"
SHM_DIR = "/dev/shm"

__all__ = ["PREFIX", "SHM_DIR", "NAME_RULE", "check_name", "new_name", "free_bytes", "shm_size_option", "create",
           "create_anonymous", "open_existing", "unlink",
           "LIVE", "STALE", "OTHER_PIDNS", "UNRECORDED", "SegmentInfo", "list_segments",
           "own_pidns", "user_name", "Cleaned", "remove_stale"]


# The naming rule of shmq_ring.h ("Segment names"): checked before any
# system call sees a name, because posix_ipc hands it to shm_open as a C
# string (a NUL byte crashed it) and a name from outside (a config file,
# another program, an entry of /dev/shm) can carry any byte.
NAME_RULE = ("a shmq name is '/' followed by 1 to 255 characters from A-Z a-z 0-9 . _ - "
             "(the '/' may be left out, as `ls /dev/shm` shows it; no NUL byte, no other '/', "
             "not '.' or '..')")
_NAME = re.compile(r"/[A-Za-z0-9._-]{1,255}")


def check_name(name) -> str:
    """The name with its leading '/' (added if left out, as
    multiprocessing.shared_memory does), if it follows NAME_RULE;
    TypeError or ValueError otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"a shmq name must be a str, not {type(name).__name__}")
    full = name if name.startswith("/") else "/" + name
    if not _NAME.fullmatch(full) or full in ("/.", "/.."):
        raise ValueError(f"invalid shmq name {name!r}: {NAME_RULE}")
    return full


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
    """(fd, size in bytes, first bytes of the header) of an existing
    segment of this process's user that no other user can write; raises
    UntrustedSegment otherwise (NOTE [ Whose segment ])."""
    name = check_name(name)
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"no shmq queue named {name!r} in /dev/shm: it was closed by its creator, removed "
            f"with Queue.unlink(), or the name is mistyped", name) from None
    except posix_ipc.PermissionsError:
        raise _not_permitted(name) from None
    fd = os.dup(shm.fd)
    shm.close_fd()
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        # shm_open does not follow symlinks, but it opens a FIFO or a
        # socket; neither is a segment (and a FIFO cannot be read with pread).
        os.close(fd)
        raise IncompatibleRing(f"cannot attach to {name!r}: it is not a shared-memory segment "
                               f"but a {_kind(st.st_mode)} named like one; remove it if it is "
                               f"not yours")
    try:
        _check_trusted(name, st)
    except UntrustedSegment:
        os.close(fd)
        raise
    return fd, st.st_size, os.pread(fd, _core.HEADER_BYTES, 0)


def _not_permitted(name: str) -> PermissionError:
    """Why this process may not open the segment: another user's (an
    UntrustedSegment, as if it could: whoever can open it must not), or its
    own whose mode denies its owner."""
    try:
        st = os.lstat(SHM_DIR + name)
        _check_trusted(name, st)
    except UntrustedSegment as e:
        return e
    except OSError:
        st = None
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}" if st is not None else "mode unknown"
    return PermissionError(errno.EACCES, f"cannot open shmq segment {name!r} ({mode}): permission "
                                         f"denied; shmq creates segments 0600 for its owner")


def user_name(uid: int) -> str:
    """'uid N (name)', or 'uid N' for a uid with no passwd entry."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _check_trusted(name: str, st: os.stat_result) -> None:
    """Refuse a segment whose records someone else could have written
    (NOTE [ Whose segment ])."""
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    path = SHM_DIR + name
    why = ("its records would be unpickled here, and a pickle can run any code as this "
           "process: shmq attaches only to segments of your own user that no other user can "
           "write (docs/guarantees.md, \"Trust\")")
    if st.st_uid != me:
        raise UntrustedSegment(
            f"refusing to attach to {name!r}: it belongs to {user_name(st.st_uid)}, not to this "
            f"process's {user_name(me)} (mode {mode:04o}); {why}. Attach from a process "
            f"running as its owner; if its owner did not make this queue, the name was taken "
            f"after the queue was gone: have its creator make a new queue (its owner or root "
            f"can remove this one: rm {path})")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedSegment(
            f"refusing to attach to {name!r}: its mode {mode:04o} lets users other than its "
            f"owner ({user_name(st.st_uid)}) write it (shmq creates segments 0600); {why}. "
            f"Make a new queue, and remove this one (rm {path})")


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


def _read_head(path: str) -> tuple[os.stat_result, bytes] | None:
    """(fstat, first header bytes) of the regular file at path, or None for
    anything else.  Anyone can create entries in /dev/shm (mode 1777), so
    nothing that is not a regular file is opened: a FIFO would block a
    plain open() forever, a symlink could point anywhere.  lstat first, then
    open with O_NOFOLLOW | O_NONBLOCK and check again with fstat, in case
    the entry was replaced in between."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return st, os.pread(fd, _core.HEADER_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def unlink(name: str) -> bool:
    """Remove the name; True if it existed.  PermissionError if this
    process may not remove it (another user's, in sticky /dev/shm)."""
    name = check_name(name)
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError as e:
        raise PermissionError(errno.EPERM, f"cannot remove shmq segment {name!r}: {e}; only its "
                              f"owner or root may", SHM_DIR + name) from None


# SegmentInfo.state: what is known of the creator, in the terms `clean` uses.
LIVE, STALE, OTHER_PIDNS, UNRECORDED = ("live", "stale", "unknown: other pid namespace",
                                        "unknown: pid namespace not recorded")


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    name: str
    size_bytes: int
    creator_pid: int | None
    state: str                 # LIVE, STALE, OTHER_PIDNS or UNRECORDED
    pidns: int | None = None   # the creator's pid namespace (inode), None if not recorded
    owner_uid: int | None = None  # the file's owner: attach refuses another's (NOTE [ Whose segment ])

    @property
    def alive(self) -> bool:
        """False only when the creator is provably gone (state STALE)."""
        return self.state != STALE


def _pid_from_name(entry: str) -> int | None:
    for part in entry[len(PREFIX):].split("-"):
        if part.isdigit():
            return int(part)
    return None


def _creator_state(head: bytes, entry: str, own_pidns: int) -> tuple[int | None, int | None, str]:
    """(creator pid, its pid namespace, state) of a segment's header.  A
    pid means something only in its own namespace (NOTE [pid namespaces]
    in shmq_ring.h): a creator in another one, or in one not recorded
    (an earlier layout, a header never finished), is never judged dead."""
    creator = _core.read_creator(head)
    if creator is None:  # no header: its creator died, or is still creating it
        return _pid_from_name(entry), None, UNRECORDED
    pid, starttime, pidns = creator
    if not pidns or not own_pidns:
        return pid, pidns or None, UNRECORDED
    if pidns != own_pidns:
        return pid, pidns, OTHER_PIDNS
    now = _core.proc_starttime(pid)
    alive = now != 0 and (starttime == 0 or now == starttime
                          or now == _core.STARTTIME_UNKNOWN)  # never remove if unsure
    return pid, pidns, LIVE if alive else STALE


def own_pidns() -> int:
    """This process's pid namespace (inode of /proc/self/ns/pid), 0 if unknown."""
    return _core.self_pidns()


def list_segments() -> list[SegmentInfo]:
    """Every shmq segment in /dev/shm and what is known of its creator.
    Entries named like one that are not regular files (FIFOs, symlinks...)
    or whose names break NAME_RULE are not segments: they are neither
    listed nor opened."""
    own = own_pidns()
    found = []
    for entry in sorted(os.listdir(SHM_DIR)):
        if not entry.startswith(PREFIX) or not _NAME.fullmatch("/" + entry):
            continue  # not a name shmq makes or accepts: not ours to open or remove
        got = _read_head(os.path.join(SHM_DIR, entry))
        if got is None:
            continue
        st, head = got
        pid, pidns, state = _creator_state(head, entry, own)
        found.append(SegmentInfo(name="/" + entry, size_bytes=st.st_size, creator_pid=pid,
                                 state=state, pidns=pidns, owner_uid=st.st_uid))
    return found


class Cleaned(NamedTuple):
    """What remove_stale did: the segments it removed (or, in a dry run,
    would try to remove), and those it was not permitted to remove
    (another user's, in sticky /dev/shm: only their owner or root may)."""
    removed: list[SegmentInfo]
    not_permitted: list[SegmentInfo]


def remove_stale(dry_run: bool = False, force: bool = False) -> Cleaned:
    """Unlink segments whose creator is provably gone; with force, also
    those whose creator cannot be checked from here (another pid
    namespace, or none recorded).  A segment this process may not remove
    is skipped, not an error: the rest are removed all the same."""
    doomed = [s for s in list_segments() if s.state == STALE or (force and s.state != LIVE)]
    if dry_run:
        return Cleaned(removed=doomed, not_permitted=[])
    removed, not_permitted = [], []
    for s in doomed:
        try:
            unlink(s.name)
        except PermissionError:
            not_permitted.append(s)
        else:
            removed.append(s)
    return Cleaned(removed=removed, not_permitted=not_permitted)
