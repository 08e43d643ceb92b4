"""The object cache: a directory on the local disk that every loader, rank
and job of the node shares.

NOTE [ The object cache ]
=========================

    cache_dir/
      index.sqlite      the index: objects, jobs, pins (SQLite, WAL)
      bell              4 KiB: a futex eventcount rung on every change
      objects/ab/<sha256 of url NUL etag>   complete, verified objects only
      tmp/<job>.<random>.part               downloads in progress
      jobs/<job>.lock                       held (flock) while the job lives

An object is identified by its URL and its ETag (or version): a changed
remote object has another name, so it is fetched again, never served
stale.  A file under objects/ is complete and verified: it is written under
tmp/, its length and ETag checked, its identity stored in an extended
attribute, then renamed into place; only then is its row marked complete.
A kill -9 at any moment leaves at worst a temp file or a row that says
"fetching" for a dead job: the next job to open the cache removes both
(recover), and nothing is ever served from tmp/.

Jobs are the fetcher processes.  Each holds a flock on its lock file for
as long as it lives, so whether a job is alive is a question the kernel
answers (a flock dies with its process, in any pid namespace sharing the
disk): no pids, no heartbeats, no clean-up by hand after a crash.

What may be evicted: a complete object that no live job pins.  A job pins
what each of its epochs still needs (every object of the epoch not trained
yet: an epoch is a `slot`, and a job has two at a time while the next
epoch starts ahead); once trained in that epoch, an object is unpinned
for it.  Among the unpinned, the most
trained go first, then the oldest (for train_on="all" that is what this
epoch has trained already; for "cached", the rotation through the remote
data).  Every reservation counts against cache_limit_bytes, so the files
never pass it, except for one object per job: when the cache is full of
objects live jobs still need, a job may take one more (an *overflow*
object, evicted first once trained), so two jobs that each need what the
other pins still progress.

Concurrency: every change is one SQLite transaction (BEGIN IMMEDIATE,
bounded by busy_timeout); a process killed inside one leaves the index as
it was before it.  Waiters (an object another job is fetching, room the
others hold) sleep on the bell with a bounded timeout.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import sqlite3
import time
from typing import NamedTuple

import numpy as np

from loader.datasets.remote.board import Doorbell
from loader.errors import NoRoom

SCHEMA_VERSION = 2
FETCHING, COMPLETE = 0, 1
XATTR = "user.shmloader.object"   # "url NUL etag NUL size", on every complete file
BUSY_TIMEOUT_S = 10.0
BALLAST_BYTES = 8 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    id INTEGER PRIMARY KEY,
    url TEXT NOT NULL,
    etag TEXT NOT NULL,
    size INTEGER NOT NULL,
    state INTEGER NOT NULL,          -- FETCHING or COMPLETE
    fetcher INTEGER,                 -- the job fetching it (FETCHING)
    overflow INTEGER NOT NULL DEFAULT 0,
    trained INTEGER NOT NULL DEFAULT 0,
    fetched_at REAL NOT NULL DEFAULT 0,
    UNIQUE (url, etag));
CREATE INDEX IF NOT EXISTS objects_evictable ON objects (state, trained DESC, fetched_at);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: temp files are named by it
    label TEXT NOT NULL,
    started REAL NOT NULL);
CREATE TABLE IF NOT EXISTS pins (
    job INTEGER NOT NULL,
    slot INTEGER NOT NULL,           -- the job's epoch that needs it
    object INTEGER NOT NULL,
    PRIMARY KEY (job, slot, object)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pins_by_object ON pins (object);
"""


class Entry(NamedTuple):
    """A complete object of the cache."""
    id: int
    path: str
    size: int


class Reservation(NamedTuple):
    """Room for one object this job fetches: write it to `tmp`, then commit."""
    id: int
    url: str
    etag: str
    size: int
    tmp: str
    path: str
    overflow: bool


def object_name(url: str, etag: str) -> str:
    """The cache's file name of an object: the digest of its URL and ETag,
    and its URL's extension (decode(path) may go by it)."""
    return digest(url, etag).hex() + extension(url)


def digest(url: str, etag: str) -> bytes:
    return hashlib.sha256(f"{url}\0{etag}".encode("utf-8", "surrogatepass")).digest()


_EXTENSION = re.compile(r"\.[A-Za-z0-9_-]{1,15}")


def extension(url: str) -> str:
    ext = os.path.splitext(url.rsplit("/", 1)[-1])[1]
    return ext if _EXTENSION.fullmatch(ext) else ""


def _room_for_the_index(method):
    """A change to the index that fails because the disk is full is tried
    once more after the ballast is given back; else it is an OSError(ENOSPC)."""
    def changed(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.OperationalError as e:
            if "full" not in str(e) or not self.release_ballast():
                raise _as_os_error(e) from e
        try:
            return method(self, *args, **kwargs)
        except sqlite3.OperationalError as e:
            raise _as_os_error(e) from e
    changed.__name__, changed.__doc__ = method.__name__, method.__doc__
    return changed


class ObjectCache:
    """One job's handle on a cache directory (NOTE [ The object cache ]).
    Made by the fetcher process, which alone writes the cache; a worker
    only computes paths (path_of) and opens complete files."""

    def __init__(self, cache_dir: str, limit_bytes: int, label: str = ""):
        self.dir, self.limit = os.path.abspath(cache_dir), int(limit_bytes)
        self.evicted = 0   # objects this job evicted
        self.last_evicted: list[int] = []   # ids the last reserve() or trained() evicted
        for sub in ("objects", "tmp", "jobs"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        self.bell = _open_bell(os.path.join(self.dir, "bell"))
        self.make_ballast()
        self.db = self._open_index()
        self.job, self._lock_fd = self._register(label)
        self.recover()

    # --- a full disk ------------------------------------------------------------------------

    def make_ballast(self) -> None:
        """A file of a few MiB the cache gives up when its disk is full, so
        that its index can still record what it evicts to make room (SQLite
        cannot even delete a row on a full disk).  Made again by the next job
        that opens the cache with room to spare."""
        path = os.path.join(self.dir, "ballast")
        disk = shutil.disk_usage(self.dir)
        size = int(min(BALLAST_BYTES, disk.total // 20))
        if os.path.exists(path) or disk.free < 4 * size:
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            _unlink(path)
            return
        os.close(fd)

    def release_ballast(self) -> bool:
        """The disk is full: give the ballast back.  True if there was one."""
        path = os.path.join(self.dir, "ballast")
        if not os.path.exists(path):
            return False
        _unlink(path)
        return True

    # --- paths -------------------------------------------------------------------------

    def path_of(self, url: str, etag: str) -> str:
        return path_of(self.dir, url, etag)

    # --- the index -----------------------------------------------------------------------

    def _open_index(self) -> sqlite3.Connection:
        path = os.path.join(self.dir, "index.sqlite")
        db = None
        try:
            db = _connect(path)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}, not {SCHEMA_VERSION}")
            db.execute("PRAGMA quick_check").fetchone()
            if version == 0:  # a new index (or one deleted): what the files say
                with _transaction(db):
                    if db.execute("PRAGMA user_version").fetchone()[0] == 0:  # (no other job did it)
                        _create_tables(db)
                        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                        self._rebuild(db, in_transaction=True)
            return db
        except sqlite3.DatabaseError:
            if db is not None:
                db.close()
            # A corrupt or foreign index: the files are the truth (their
            # extended attributes say what each is): start a new index from them.
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.unlink(path + suffix)
                except FileNotFoundError:
                    pass
            db = _connect(path)
            with _transaction(db):
                _create_tables(db)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                self._rebuild(db, in_transaction=True)
            return db

    def _rebuild(self, db: sqlite3.Connection, in_transaction: bool) -> int:
        """Rows for the complete files of objects/ (from their extended
        attribute); a file without one is removed.  Returns the rows made."""
        rows = []
        top = os.path.join(self.dir, "objects")
        for sub in os.scandir(top):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                identity = _identity(entry.path)
                if identity is None or object_name(identity[0], identity[1]) != entry.name:
                    _unlink(entry.path)
                    continue
                rows.append((identity[0], identity[1], identity[2], COMPLETE,
                             entry.stat(follow_symlinks=False).st_mtime))
        db.executemany("INSERT OR IGNORE INTO objects (url, etag, size, state, fetched_at) "
                       "VALUES (?, ?, ?, ?, ?)", rows)
        return len(rows)

    # --- jobs --------------------------------------------------------------------------

    def _register(self, label: str) -> tuple[int, int]:
        with _transaction(self.db):
            job = self.db.execute("INSERT INTO jobs (label, started) VALUES (?, ?)",
                                  (label, time.time())).lastrowid
        fd = os.open(self._lock_path(job), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
        return job, fd

    def _lock_path(self, job: int) -> str:
        return os.path.join(self.dir, "jobs", f"{job}.lock")

    def alive(self, job: int) -> bool:
        """Whether job's process still holds its lock (ours is alive)."""
        if job == self.job:
            return True
        try:
            fd = os.open(self._lock_path(job), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        finally:
            os.close(fd)  # (a lock taken here goes with the fd)
        return False

    def recover(self) -> int:
        """Remove what dead jobs left: their rows being fetched and their
        temp files, their pins, their lock files; and rows whose file is
        gone.  Returns the dead jobs found."""
        dead = [job for (job,) in self.db.execute("SELECT id FROM jobs") if not self.alive(job)]
        for job in dead:
            self._forget_job(job)
        for name in os.listdir(os.path.join(self.dir, "tmp")):
            job = name.split(".", 1)[0]
            if not job.isdigit() or not self.alive(int(job)):
                _unlink(os.path.join(self.dir, "tmp", name))
        missing = [(i,) for i, url, etag in self.db.execute(
                   "SELECT id, url, etag FROM objects WHERE state = ?", (COMPLETE,))
                   if not os.path.exists(self.path_of(url, etag))]
        if missing:
            with _transaction(self.db):
                self.db.executemany("DELETE FROM objects WHERE id = ?", missing)
                self.db.executemany("DELETE FROM pins WHERE object = ?", missing)
        if dead or missing:
            self.bell.ring()
        return len(dead)

    def _forget_job(self, job: int) -> None:
        with _transaction(self.db):
            self.db.execute("DELETE FROM pins WHERE job = ?", (job,))
            fetching = self.db.execute("SELECT id, url, etag, size FROM objects WHERE state = ? "
                                       "AND fetcher = ?", (FETCHING, job)).fetchall()
            for obj, url, etag, size in fetching:
                if _identity(self.path_of(url, etag)) == (url, etag, size):
                    # renamed into place, then killed before its row said so
                    self.db.execute("UPDATE objects SET state = ?, fetcher = NULL, fetched_at = ? "
                                    "WHERE id = ?", (COMPLETE, time.time(), obj))
                else:
                    self.db.execute("DELETE FROM objects WHERE id = ?", (obj,))
            self.db.execute("DELETE FROM jobs WHERE id = ?", (job,))
        _unlink(self._lock_path(job))

    def close(self) -> None:
        """This job is over: its pins, its unfinished fetches and its temp
        files go (the complete objects stay for the next job)."""
        if self._lock_fd < 0:
            return
        for name in os.listdir(os.path.join(self.dir, "tmp")):
            if name.startswith(f"{self.job}."):
                _unlink(os.path.join(self.dir, "tmp", name))
        try:
            self._forget_job(self.job)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1
            self.db.close()
            self.bell.ring()

    # --- objects -----------------------------------------------------------------------

    def lookup(self, url: str, etag: str) -> Entry | None:
        row = self.db.execute("SELECT id, size FROM objects WHERE url = ? AND etag = ? AND "
                              "state = ?", (url, etag, COMPLETE)).fetchone()
        return None if row is None else Entry(row[0], self.path_of(url, etag), row[1])

    def used_bytes(self) -> int:
        return self.db.execute("SELECT COALESCE(SUM(size), 0) FROM objects").fetchone()[0]

    @_room_for_the_index
    def reserve(self, url: str, etag: str, size: int, slot: int = 0, spare=()
                ) -> Entry | Reservation | None:
        """This job fetches (url, etag) for its epoch `slot`: its
        Reservation, room made for it (pinned for that epoch).  `spare`:
        ids of objects this job pins but needs later than this one, the
        latest first: evicted too if unpinned ones are not enough (and no
        other live job pins them).  Or the Entry if it is complete already
        (pinned now), or None if another live job is fetching it (wait on
        the bell).  NoRoom if it does not fit, not even as this job's
        overflow object."""
        self.last_evicted = []
        with _transaction(self.db):
            row = self.db.execute("SELECT id, state, fetcher, size FROM objects WHERE url = ? "
                                  "AND etag = ?", (url, etag)).fetchone()
            if row is not None:
                obj, state, fetcher, known = row
                if state == COMPLETE:
                    self.db.execute("INSERT OR IGNORE INTO pins VALUES (?, ?, ?)",
                                    (self.job, slot, obj))
                    return Entry(obj, self.path_of(url, etag), known)
                if fetcher != self.job and self.alive(fetcher):
                    return None
                self.db.execute("DELETE FROM objects WHERE id = ?", (obj,))  # a dead job's
                self.db.execute("DELETE FROM pins WHERE object = ?", (obj,))
            overflow, gone = self._make_room(size, spare)
            obj = self.db.execute(
                "INSERT INTO objects (url, etag, size, state, fetcher, overflow) "
                "VALUES (?, ?, ?, ?, ?, ?)", (url, etag, size, FETCHING, self.job,
                                              int(overflow))).lastrowid
            self.db.execute("INSERT OR IGNORE INTO pins VALUES (?, ?, ?)", (self.job, slot, obj))
        self.last_evicted = [obj for obj, _ in gone]
        for _, path in gone:  # after the commit: a rolled back eviction keeps its files
            _unlink(path)  # (a worker that opened one reads on: its fd keeps the data)
        tmp = os.path.join(self.dir, "tmp", f"{self.job}.{secrets.token_hex(8)}.part")
        return Reservation(id=obj, url=url, etag=etag, size=size, tmp=tmp,
                           path=self.path_of(url, etag), overflow=overflow)

    def _make_room(self, size: int, spare=()) -> tuple[bool, list[str]]:
        """Evict unpinned complete objects until size fits, then this job's
        `spare` ones (inside the caller's transaction): (whether it fits
        only as this job's overflow object, the files to remove once
        committed).  NoRoom if it does not fit even so."""
        used = self.db.execute("SELECT COALESCE(SUM(size), 0) FROM objects").fetchone()[0]
        if used + size <= self.limit:
            return False, []
        victims = self.db.execute(
            "SELECT id, url, etag, size FROM objects WHERE state = ? AND id NOT IN "
            "(SELECT object FROM pins) ORDER BY overflow DESC, trained DESC, fetched_at",
            (COMPLETE,)).fetchall()
        if spare:
            spare = list(spare)
            others = {obj for (obj,) in self.db.execute(
                f"SELECT object FROM pins WHERE job != ? AND object IN "
                f"({','.join('?' * len(spare))})", (self.job, *spare))}
            rows = {row[0]: row for row in self.db.execute(
                f"SELECT id, url, etag, size FROM objects WHERE state = ? AND id IN "
                f"({','.join('?' * len(spare))})", (COMPLETE, *spare))}
            victims += [rows[obj] for obj in spare if obj in rows and obj not in others]
        gone = []
        for obj, url, etag, n in victims:
            if used + size <= self.limit:
                break
            gone.append((obj, self.path_of(url, etag)))
            used -= n
        if used + size > self.limit:
            mine = self.db.execute(
                "SELECT COUNT(*) FROM objects WHERE overflow = 1 AND (fetcher = ? OR id IN "
                "(SELECT object FROM pins WHERE job = ?))", (self.job, self.job)).fetchone()[0]
            if mine or size > self.limit:
                raise NoRoom(size, used, self.limit)
        self.db.executemany("DELETE FROM objects WHERE id = ?", [(obj,) for obj, _ in gone])
        self.db.executemany("DELETE FROM pins WHERE object = ?", [(obj,) for obj, _ in gone])
        self.evicted += len(gone)
        return used + size > self.limit, gone

    def commit(self, res: Reservation) -> Entry:
        """The object is in res.tmp, whole (the caller checked its length
        and ETag): name it, then mark it complete."""
        return self.commit_many([res])[0]

    def commit_many(self, done: list[Reservation]) -> list[Entry]:
        """commit() for several objects in one transaction: what the index
        costs is its transactions (a commit, and a checkpoint now and then),
        not the rows, so a fetcher whose downloads finish together commits
        them together."""
        named = []
        try:
            for res in done:
                _set_identity(res.tmp, res.url, res.etag, res.size)
                os.makedirs(os.path.dirname(res.path), exist_ok=True)
                os.rename(res.tmp, res.path)
                named.append(res)
            with _transaction(self.db):
                now = time.time()
                self.db.executemany(
                    "UPDATE objects SET state = ?, fetcher = NULL, fetched_at = ? WHERE id = ?",
                    [(COMPLETE, now, res.id) for res in done])
        except BaseException as e:
            for res in named:
                _unlink(res.path)   # not complete in the index: not in the cache
            if isinstance(e, sqlite3.OperationalError):
                raise _as_os_error(e) from e
            raise
        self.bell.ring()
        return [Entry(res.id, res.path, res.size) for res in done]

    @_room_for_the_index
    def shrink(self, limit: int) -> None:
        """The cache may hold `limit` bytes from now on (its disk filled up
        first): unpinned objects are evicted until it does, as far as they go."""
        self.limit = limit
        gone = []
        with _transaction(self.db):
            used = self.used_bytes()
            for obj, url, etag, n in self.db.execute(
                    "SELECT id, url, etag, size FROM objects WHERE state = ? AND id NOT IN "
                    "(SELECT object FROM pins) ORDER BY overflow DESC, trained DESC, fetched_at",
                    (COMPLETE,)).fetchall():
                if used <= limit:
                    break
                gone.append((obj, self.path_of(url, etag)))
                used -= n
            self.db.executemany("DELETE FROM objects WHERE id = ?", [(obj,) for obj, _ in gone])
        self.evicted += len(gone)
        self.last_evicted = [obj for obj, _ in gone]
        for _, path in gone:
            _unlink(path)

    @_room_for_the_index
    def abort(self, res: Reservation) -> None:
        """The fetch failed: its room and temp file go."""
        _unlink(res.tmp)
        with _transaction(self.db):
            self.db.execute("DELETE FROM objects WHERE id = ? AND state = ?", (res.id, FETCHING))
            self.db.execute("DELETE FROM pins WHERE object = ?", (res.id,))
        self.bell.ring()

    # --- pins and training ---------------------------------------------------------------

    @_room_for_the_index
    def pin_epoch(self, slot: int, objects: list[tuple[str, str]]) -> np.ndarray:
        """This job's epoch `slot` needs these (url, etag): pin the complete
        ones for it (replacing what that slot pinned before).  Returns each
        one's id in the cache (int64), -1 where it is not complete."""
        # The complete objects of the cache matched in a dict: one pass over
        # what the cache holds (bounded by its size).  Joining a table of the
        # listing's urls, and naming each object's file, took 17 s at an
        # epoch's start for a million objects.
        with _transaction(self.db):
            self.db.execute("DELETE FROM pins WHERE job = ? AND slot = ?", (self.job, slot))
            complete = dict(((url, etag), obj) for obj, url, etag in self.db.execute(
                "SELECT id, url, etag FROM objects WHERE state = ?", (COMPLETE,)))
            ids = np.fromiter((complete.get(key, -1) for key in objects), np.int64, len(objects))
            found = ids[ids >= 0]
            self.db.executemany("INSERT OR IGNORE INTO pins VALUES (?, ?, ?)",
                                ((self.job, slot, obj) for obj in found.tolist()))
        return ids

    @_room_for_the_index
    def unpin(self, slot: int, objects: list[int]) -> None:
        """This job's epoch `slot` no longer holds these objects (ids) in the
        cache: it gives them up to make room for one needed sooner (it
        fetches them again when their turn comes)."""
        with _transaction(self.db):
            self.db.executemany("DELETE FROM pins WHERE job = ? AND slot = ? AND object = ?",
                                [(self.job, slot, obj) for obj in objects])

    @_room_for_the_index
    def unpin_slot(self, slot: int) -> None:
        """This job's epoch `slot` is over: nothing is pinned for it."""
        with _transaction(self.db):
            self.db.execute("DELETE FROM pins WHERE job = ? AND slot = ?", (self.job, slot))
        self.bell.ring()

    @_room_for_the_index
    def trained(self, slot: int, objects: list[int]) -> None:
        """This job's epoch `slot` trained on these objects (ids): counted,
        and unpinned for that epoch; an overflow object nobody pins goes at
        once."""
        if not objects:
            return
        with _transaction(self.db):
            self.db.executemany("UPDATE objects SET trained = trained + 1 WHERE id = ?",
                                [(obj,) for obj in objects])
            self.db.executemany("DELETE FROM pins WHERE job = ? AND slot = ? AND object = ?",
                                [(self.job, slot, obj) for obj in objects])
            gone = self.db.execute(
                f"SELECT id, url, etag FROM objects WHERE overflow = 1 AND state = ? AND id IN "
                f"({','.join('?' * len(objects))}) AND id NOT IN (SELECT object FROM pins)",
                (COMPLETE, *objects)).fetchall()
            self.db.executemany("DELETE FROM objects WHERE id = ?", [(obj,) for obj, _, _ in gone])
        self.last_evicted = [obj for obj, _, _ in gone]
        for _, url, etag in gone:
            _unlink(self.path_of(url, etag))
        self.bell.ring()


def path_of(cache_dir: str, url: str, etag: str) -> str:
    name = object_name(url, etag)
    return os.path.join(cache_dir, "objects", name[:2], name)


# --- helpers ----------------------------------------------------------------------------

def _create_tables(db: sqlite3.Connection) -> None:
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                         check_same_thread=False)
    try:
        _configure(db)
    except BaseException:
        db.close()   # (a corrupt file fails here: the caller rebuilds, leaving no connection)
        raise
    return db


def _configure(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = NORMAL")  # a crash of the machine may lose the last commits,
                                               # never leave the index inconsistent
    # The log is folded into the index every 1 MiB (not 4 MiB) and cut back
    # after: on a full disk it is the index's log that needs room (the
    # ballast's).  Folded every 256 KiB, a checkpoint's fsyncs came every few
    # objects and took most of the fetcher's time.
    db.execute("PRAGMA wal_autocheckpoint = 256")
    db.execute("PRAGMA journal_size_limit = 1048576")


class _transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception): the write lock
    at once, waited for at most busy_timeout."""

    def __init__(self, db):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, value, tb):
        self.db.execute("ROLLBACK" if kind is not None else "COMMIT")
        return False


def _open_bell(path: str) -> Doorbell:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size < 4096:
            os.ftruncate(fd, 4096)
        words = np.memmap(path, np.int32, "r+", shape=(16,))
    finally:
        os.close(fd)
    return Doorbell(words, 0)


def _as_os_error(e: sqlite3.OperationalError) -> OSError:
    """SQLite's "database or disk is full" as the ENOSPC it is."""
    if "full" in str(e):
        return OSError(errno.ENOSPC, f"the cache's index: {e}")
    return OSError(errno.EIO, f"the cache's index: {e}")


def _set_identity(path: str, url: str, etag: str, size: int) -> None:
    try:
        os.setxattr(path, XATTR, f"{url}\0{etag}\0{size}".encode("utf-8", "surrogatepass"))
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        # (a file system without user xattrs: the file cannot be identified
        # if the index is lost, and is then removed by a rebuild)


def _identity(path: str) -> tuple[str, str, int] | None:
    try:
        url, etag, size = os.getxattr(path, XATTR).decode("utf-8", "surrogatepass").split("\0")
        return url, etag, int(size)
    except (OSError, ValueError):
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
