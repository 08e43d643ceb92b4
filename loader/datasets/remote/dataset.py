"""FileDataset over an object store (NOTE [ Remote data ]): main's and the
workers' side.  FileDataset("s3://...") makes a RemoteFiles."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from typing import NamedTuple

import numpy as np

from loader.datasets.files import FileDataset, npy_array, open_regular, raw_array
from loader.datasets.snapshot import EpochView
from loader.datasets.remote import board as B
from loader.datasets.remote import messages as M
from loader.errors import FetcherDied, RemoteError, remote_error_of
from loader.datasets.remote.footers import parse_footers
from loader.datasets.remote.store import endpoint_of, parse

_pidfds: dict[int, int] = {}   # the fetchers' pidfds, per process (_fetcher_alive)
WAIT_SLICE_S = 0.25        # a worker's wait for an object, between checks of the fetcher
REPLY_TIMEOUT_S = 60.0     # the fetcher's answer to main's Adopt (local work only)
EVICTED_RETRIES = 3        # an object evicted between its check and its open: fetched again
EVICTED_WAIT_S = 10.0      # for the fetcher to record an eviction it has made (microseconds)


class RemoteSnapshot(NamedTuple):
    """An epoch's objects, as every process of the loader sees them."""
    slot: int
    gen: int
    count: int                      # the listing's objects
    positions: np.ndarray | None    # train_on="cached": the objects of this epoch


class RemoteFiles(FileDataset):
    """FileDataset(url) for an object store: see FileDataset's docstring."""

    current = EpochView()   # the epoch's RemoteSnapshot: a worker thread's own

    def __init__(self, pattern: str, decode=None, *, cache_dir=None, cache_limit_bytes=None,
                 train_on: str = "all", storage_options: dict | None = None,
                 requests_in_flight: int = 32, listing_timeout: float = 600.0,
                 request_deadline: float = 60.0, first_batch_timeout: float = 600.0):
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable, got {type(decode).__name__}")
        if train_on not in ("all", "cached"):
            raise ValueError(f"train_on must be 'all' or 'cached', got {train_on!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self.pattern, self.decode, self.train_on = pattern, decode, train_on
        self.store_pattern = parse(pattern)
        self.endpoint = endpoint_of(self.store_pattern, storage_options)
        self.cache_dir = os.path.abspath(cache_dir or _default_cache_dir())
        os.makedirs(self.cache_dir, exist_ok=True)
        if cache_limit_bytes is None:
            cache_limit_bytes = shutil.disk_usage(self.cache_dir).free // 2
        if not isinstance(cache_limit_bytes, int) or cache_limit_bytes <= 0:
            raise ValueError(f"cache_limit_bytes must be a positive int, got {cache_limit_bytes!r}")
        self.cache_limit_bytes = cache_limit_bytes
        self.first_batch_timeout = first_batch_timeout
        self._owner = os.getpid()
        self._by_epoch: dict = {}  # epoch -> its snapshot (asked again for a run started ahead)
        self._resumed: dict = {}   # epoch -> its snapshot, of a state's record (resume_epoch)
        self._records: dict = {}   # (slot, gen, count) -> epoch_record()
        self._footers: dict = {}   # cache name -> Parquet footer (a remote ParquetDataset)
        self.listing_timeout = listing_timeout
        self._board = B.Board.create()
        self._turn = -1            # the slot last adopted
        self._gen = 0              # the listing last asked for
        self._listed = None        # ListDone of the newest listing
        self._listing_pending = False
        self._start_fetcher(storage_options, requests_in_flight, request_deadline)
        self._closer = weakref.finalize(self, _stop, self._proc, self._sock, self._board,
                                        self._stderr)
        try:
            self._list_now(listing_timeout)
            self.current = self._adopt()
            if train_on == "all":   # the first epoch's, unless a listing comes first
                self._by_epoch["first"] = self.current
            self._ask_listing()
        except BaseException:
            self._closer()   # (the error's traceback may keep this object alive)
            raise

    # --- the fetcher --------------------------------------------------------------------

    def _start_fetcher(self, storage_options, in_flight: int, deadline: float) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = {"url": self.pattern, "cache_dir": self.cache_dir,
               "cache_limit_bytes": self.cache_limit_bytes, "train_on": self.train_on,
               "storage_options": storage_options or {}, "in_flight": in_flight,
               "deadline_s": deadline, "parent": os.getpid(), "board_fd": self._board.fd,
               "sock_fd": theirs.fileno()}
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "loader.datasets.remote.fetcher", json.dumps(cfg)],
                pass_fds=(self._board.fd, theirs.fileno()), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self._stderr, env=_child_env())
        finally:
            theirs.close()
        self._sock = mine

    def _last_words(self) -> str:
        """The end of what the fetcher wrote to its stderr (any process of
        the loader can read it: the file is inherited; pread moves no
        offset another process relies on)."""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        tail = os.pread(fd, 3000, max(0, size - 3000))
        return tail.decode("utf-8", "replace").strip()

    def _reply(self, kinds: tuple, timeout: float):
        """(message, fds) of the fetcher's next message of one of these kinds
        (others are handled on the way), waiting at most timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(self._proc.pid, signal.SIGUSR1)  # its stacks, into its stderr
                time.sleep(0.2)
                raise FetcherDied(f"the fetcher (pid {self._proc.pid}) did not answer within "
                                  f"{timeout:.0f} s; its stacks:\n{self._last_words()}")
            self._sock.settimeout(min(left, WAIT_SLICE_S))
            try:
                msg, fds = M.receive(self._sock)
            except socket.timeout:
                if self._proc.poll() is not None:
                    raise self._died() from None
                continue
            if msg is None:
                raise self._died()
            if type(msg) is M.Fatal:
                raise FetcherDied(f"the fetcher (pid {self._proc.pid}) failed:\n{msg.text}")
            if type(msg) is M.ListDone:
                self._listing_pending = False
                self._listed = msg
            if type(msg) in kinds:
                return msg, fds
            for fd in fds:
                os.close(fd)

    def _died(self) -> FetcherDied:
        self._proc.wait(5)
        return FetcherDied(f"the fetcher (pid {self._proc.pid}) ended with status "
                           f"{self._proc.returncode}; it said:\n{self._last_words()}")

    def _ask_listing(self) -> None:
        if not self._listing_pending:
            self._gen += 1
            self._listing_pending = True
            M.send(self._sock, M.ListRequest(gen=self._gen))

    def _list_now(self, timeout: float) -> None:
        self._ask_listing()
        done, _ = self._reply((M.ListDone,), timeout)
        if done.error is not None:
            kind, status, url, text = done.error
            raise remote_error_of(kind, f"FileDataset({self.pattern!r}): {text}", url,
                                  self.endpoint, status)

    def _drain(self) -> None:
        """Take what the fetcher said meanwhile (a listing done), without waiting."""
        self._sock.setblocking(False)
        try:
            while True:
                try:
                    msg, fds = M.receive(self._sock)
                except (BlockingIOError, socket.timeout):
                    return
                for fd in fds:   # (a late answer's memfd)
                    os.close(fd)
                if msg is None:
                    raise self._died()
                if type(msg) is M.ListDone:
                    self._listing_pending = False
                    if msg.error is None:
                        self._listed = msg
                elif type(msg) is M.Fatal:
                    raise FetcherDied(f"the fetcher (pid {self._proc.pid}) failed:\n{msg.text}")
        finally:
            self._sock.setblocking(True)

    def _adopt(self, gen: int | None = None) -> RemoteSnapshot:
        """The newest listing (or listing gen: all of its objects), in the
        next slot: this epoch's objects."""
        self._turn = (self._turn + 1) % B.SLOTS
        M.send(self._sock, M.Adopt(slot=self._turn, gen=self._listed.gen if gen is None else gen))
        done, _ = self._reply((M.Adopted,), REPLY_TIMEOUT_S)
        positions = None
        if gen is not None:
            positions = np.arange(done.count)
        elif self.train_on == "cached":
            state = self._board.slot(done.slot).state
            positions = np.flatnonzero((state & B.STATUS_MASK) == B.COMPLETE)
        return RemoteSnapshot(slot=done.slot, gen=done.gen, count=done.count, positions=positions)

    # --- an exact resume of a train_on="cached" epoch (NOTE [ Datasets that change
    # with the epoch ]): its set is the cache's as it began, which a new job does not see

    def epoch_record(self, snapshot: RemoteSnapshot) -> dict | None:
        """The epoch's set of objects (keys, ETags and sizes, compressed), for
        a state taken now; None for train_on="all" (every listed object).
        Asked of the fetcher once per epoch."""
        if snapshot.positions is None or os.getpid() != self._owner:
            return None
        key = (snapshot.slot, snapshot.gen, len(snapshot.positions))
        record = self._records.get(key)
        if record is None:
            objects = self._ask_about(snapshot, snapshot.positions, M.Describe, M.Described,
                                      REPLY_TIMEOUT_S)
            if objects is None:
                raise RuntimeError(f"FileDataset({self.pattern!r}): the epoch's listing "
                                   f"(board slot {snapshot.slot}) was retired before its "
                                   f"state was taken (more than {B.SLOTS - 1} epochs live)")
            record = {"url": self.pattern, "count": len(snapshot.positions), "objects": objects}
            self._records = {k: v for k, v in self._records.items() if k[0] != snapshot.slot}
            self._records[key] = record
        return record

    def _ask_about(self, snap: RemoteSnapshot, positions, ask, answer, timeout: float):
        """The fetcher's record about the objects at these positions of the
        epoch's listing (ask: Describe or Footers), as bytes; None if its
        slot holds another listing by now."""
        at = np.ascontiguousarray(positions, np.int64)
        with M.memfd_of(memoryview(at).cast("B")) as fd:
            M.send(self._sock, ask(slot=snap.slot, gen=snap.gen, count=len(at)), fds=[fd])
        said, fds = self._reply((answer,), timeout)
        try:
            return M.read_bytes(fds[0], said.nbytes) if fds else None
        finally:
            for fd in fds:
                os.close(fd)

    def record_len(self, record) -> int:
        """The length of the epoch epoch_record() described (ValueError if
        it is not such a record of this dataset)."""
        if not (isinstance(record, dict) and set(record) == {"url", "count", "objects"}):
            raise ValueError("it must be a dict of 'url', 'count' and 'objects' "
                             "(FileDataset.epoch_record)")
        if record["url"] != self.pattern:
            raise ValueError(f"it is an epoch of FileDataset({record['url']!r}), and this "
                             f"dataset is FileDataset({self.pattern!r})")
        count = record["count"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 0 or \
                not isinstance(record["objects"], bytes):
            raise ValueError("its 'count' must be an int >= 0 and its 'objects' bytes")
        if len(M.parse_record(record["objects"])[0]) != count:
            raise ValueError(f"its 'objects' do not hold {count} objects")
        return count

    def forget_epochs(self) -> None:
        """The loader dropped its runs (load_state_dict): an epoch asked for
        from now on gets a listing adopted anew, not one a dropped run read
        part of (its objects' TRAINED flags and counts are that run's), and
        the fetcher lets go of what the dropped runs' slots pinned (a small
        cache full of them could fetch nothing for the new run: a hang)."""
        self._by_epoch = {}
        self._resumed = {}
        if os.getpid() == self._owner:
            self._drain()
            M.send(self._sock, M.Forget())

    def resume_epoch(self, epoch: int, record: dict) -> None:
        """The epoch trains the objects of the record, whatever the cache
        holds now (those not in it are fetched; one gone from the store is
        the batch's ObjectNotFound, one changed its ObjectChanged, as in
        an epoch of train_on="all")."""
        self.record_len(record)
        self._drain()
        self._gen += 1
        gen = self._gen
        with M.memfd_of(record["objects"]) as fd:
            M.send(self._sock, M.Install(gen=gen, nbytes=len(record["objects"])), fds=[fd])
        self._reply((M.Installed,), REPLY_TIMEOUT_S)
        snap = self._adopt(gen)
        self._by_epoch = {e: v for e, v in self._by_epoch.items() if e != "first"}
        self._by_epoch[epoch] = self._resumed[epoch] = snap
        self.current = snap

    def close(self) -> None:
        """Stop the fetcher (it also stops when the dataset is collected, and
        with the process); the cache keeps what it holds for the next job."""
        if os.getpid() == self._owner:
            self._closer()

    # --- the dataset --------------------------------------------------------------------

    def __len__(self) -> int:
        snap = self.current
        return snap.count if snap.positions is None else len(snap.positions)

    @property
    def files(self):
        raise AttributeError("a remote FileDataset has no local file list: "
                             "its objects are in the cache under their digests")

    def epoch_snapshot(self, info=None) -> RemoteSnapshot:
        """In main, as an epoch starts: the newest finished listing (a new
        one is asked for in the background: it never holds the epoch up),
        put into the next slot of the board.  Asked again for the same epoch
        (a run started ahead, checked at its iter()), the same snapshot,
        unless a newer listing came meanwhile.  train_on="cached": the
        objects complete in the cache now, and at least one batch of them
        (waited for, if the cache has less)."""
        self._drain()
        epoch = None if info is None else info.epoch
        if epoch in self._resumed:   # (resume_epoch: exactly the state's set)
            self.current = self._resumed[epoch]
            return self.current
        known = self._by_epoch.get(epoch) or self._by_epoch.pop("first", None)
        if known is not None and known.gen == self._listed.gen and (
                self.train_on == "all" or known.positions is not None):
            self.current = known
            return known
        snap = self._adopt()
        if self.train_on == "cached":
            least = max(1, (info.batch_size or 1) if info is not None else 1)
            snap = self._at_least(snap, min(least, snap.count))
        self.current = snap
        if epoch is not None:
            self._by_epoch = {e: v for e, v in self._by_epoch.items() if e >= epoch - 1}
            self._by_epoch[epoch] = snap
        self._ask_listing()
        return snap

    def _at_least(self, snap: RemoteSnapshot, least: int) -> RemoteSnapshot:
        """train_on="cached": the epoch's objects once `least` are complete
        (the first epoch starts as soon as one batch is cached)."""
        slot = self._board.slot(snap.slot)
        deadline = time.monotonic() + self.first_batch_timeout

        def complete():
            return int(np.count_nonzero((slot.state & B.STATUS_MASK) == B.COMPLETE))

        while complete() < least:
            if time.monotonic() > deadline:
                raise RemoteError(f"FileDataset({self.pattern!r}, train_on='cached'): fewer than "
                                  f"{least} objects (a batch) reached the cache in "
                                  f"{self.first_batch_timeout:.0f} s; {self._board.get(B.W_ERRORS)} "
                                  f"fetches failed")
            if self._board.get(B.W_STATE) in (B.FAILED, B.STOPPED) or self._proc.poll() is not None:
                raise self._died()
            self._board.arrived.wait(lambda: complete() >= least, WAIT_SLICE_S)
        positions = np.flatnonzero((slot.state & B.STATUS_MASK) == B.COMPLETE)
        return snap._replace(positions=positions)

    def epoch_order(self, snapshot: RemoteSnapshot, indices: np.ndarray) -> None:
        """In main, as a run starts: the order its workers will ask for the
        objects in, for the fetcher to follow (NOTE [ Datasets that change
        with the epoch ]).  train_on="cached": the epoch's objects are local
        already, and the order tells the fetcher which ones its epoch still
        needs, and when (it never evicts those to make room)."""
        if os.getpid() != self._owner:
            return
        if snapshot.positions is not None:
            indices = snapshot.positions[np.asarray(indices, np.int64)]
        order = np.ascontiguousarray(indices, np.int64)
        with M.memfd_of(memoryview(order).cast("B")) as fd:
            M.send(self._sock, M.Order(slot=snapshot.slot, count=len(order)), fds=[fd])

    def restore_snapshot(self, snapshot: RemoteSnapshot) -> None:
        self.current = snapshot

    def __getitem__(self, i: int):
        snap = self.current
        index = int(i) if snap.positions is None else int(snap.positions[i])
        if not 0 <= index < snap.count:
            raise IndexError(f"FileDataset({self.pattern!r}) has {len(self)} objects; got {i}")
        if self.decode is not None:
            return self._use(snap, index, self.decode)
        path, fd = self._use(snap, index, lambda path: (path, open_regular(path)))
        return npy_array(path, fd) if path.endswith(".npy") else raw_array(path, fd)

    def _use(self, snap: RemoteSnapshot, index: int, use, trained: bool = True):
        """use(path) of object index of the epoch, once it is in the cache
        (waited for; asked for again if it was evicted between the look and
        the open); then, if `trained`, marked trained (an opened file stays
        readable through its fd once evicted)."""
        slot = self._slot_of(snap)
        for attempt in range(EVICTED_RETRIES + 1):
            self._wait_for(slot, index)
            path = self._path(slot, index)
            try:
                out = use(path)
            except FileNotFoundError:
                if attempt == EVICTED_RETRIES or not self._evicted_meanwhile(slot, index, path):
                    raise
                continue
            if trained:
                self._trained(slot, index)
            return out

    def _slot_of(self, snap: RemoteSnapshot) -> B.Slot:
        slot = self._board.slot(snap.slot)
        if slot.gen != snap.gen:
            raise RemoteError(f"FileDataset({self.pattern!r}): the epoch's listing was replaced "
                              f"in the board while it was read (more than {B.SLOTS - 1} epochs "
                              f"or iterators live at once)")
        return slot

    # --- a remote ParquetDataset's objects (loader/datasets/parquet.py) ----------------

    def footers(self, snap: RemoteSnapshot) -> list[dict]:
        """Each object's Parquet footer (footers.footer(), with its "url"),
        read by the fetcher for those not known yet (known by their name in
        the cache, which holds the ETag)."""
        slot = self._slot_of(snap)
        names = [slot.name(i) for i in range(snap.count)]
        missing = np.array([i for i, name in enumerate(names) if name not in self._footers],
                           np.int64)
        if len(missing):
            found = self._ask_about(snap, missing, M.Footers, M.Footed, self.listing_timeout)
            if found is None:
                raise RemoteError(f"FileDataset({self.pattern!r}): the epoch's listing was "
                                  f"retired before its footers were read")
            found = parse_footers(found)
            got = {names[i]: f for i, f in zip(missing, found)}
            self._footers.update((k, f) for k, f in got.items() if "rows" in f)
            return [self._footers.get(name) or got[name] for name in names]
        return [self._footers[name] for name in names]

    def rows_to_read(self, snap: RemoteSnapshot, rows: np.ndarray) -> None:
        """In main, as a ParquetDataset's epoch starts: rows[i] of object i
        this rank reads.  An object it reads none of is trained now (not
        needed: unpinned, never fetched); the others once their last row is
        read (read_rows)."""
        slot = self._slot_of(snap)
        slot.left[:] = rows
        for i in np.flatnonzero(rows == 0):
            slot.mark(int(i), B.TRAINED)
        self._board.work.ring()

    def open_object(self, snap: RemoteSnapshot, index: int) -> tuple[str, int]:
        """(path, fd) of object index in the cache, not yet marked trained."""
        return self._use(snap, index, lambda path: (path, open_regular(path)), trained=False)

    def read_rows(self, snap: RemoteSnapshot, index: int, rows: int) -> None:
        """A worker read rows of object index: trained once this rank's
        epoch has read all it reads of it."""
        slot = self._slot_of(snap)
        if slot.read_rows(index, rows):
            self._trained(slot, index)

    def _evicted_meanwhile(self, slot: B.Slot, index: int, path: str) -> bool:
        """The object was complete when looked at and its file gone when
        opened: the fetcher evicted it in between (it may evict objects of
        this epoch needed later than the one it fetches, and a worker reading
        ahead may be just then opening one).  Asked for now (WANTED: never
        evicted again), it is fetched again; True once the fetcher has
        recorded the eviction.  False if the board still says complete after
        EVICTED_WAIT_S: the file was removed behind the cache's back."""
        slot.mark(index, B.WANTED)
        self._board.work.ring()

        def recorded():
            return slot.status(index) & B.STATUS_MASK != B.COMPLETE or os.path.exists(path)

        deadline = time.monotonic() + EVICTED_WAIT_S
        while not recorded():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._board.arrived.wait(recorded, left)
        return True

    def _path(self, slot: B.Slot, index: int) -> str:
        name = slot.name(index)
        return os.path.join(self.cache_dir, "objects", name[:2], name)

    def _wait_for(self, slot: B.Slot, index: int) -> None:
        """Until object index is in the cache (or failed, or the fetcher is gone)."""
        status = slot.status(index) & B.STATUS_MASK
        if status == B.COMPLETE:
            return
        asked = False
        t0 = time.perf_counter_ns()
        try:
            while status == B.ABSENT:
                if not asked:
                    slot.mark(index, B.WANTED)
                    self._board.work.ring()
                    self._board.add(B.W_ASKED)
                    asked = True
                state = self._board.get(B.W_STATE)
                if state in (B.FAILED, B.STOPPED) or not self._fetcher_alive():
                    how = {B.FAILED: "failed", B.STOPPED: "was stopped"}.get(state, "was killed")
                    raise FetcherDied(f"FileDataset({self.pattern!r}): the fetcher (pid "
                                      f"{self._proc.pid}) {how} before object {index} arrived; "
                                      f"it said:\n{self._last_words()}")
                self._board.arrived.wait(
                    lambda: slot.status(index) & B.STATUS_MASK != B.ABSENT, WAIT_SLICE_S)
                status = slot.status(index) & B.STATUS_MASK
        finally:
            self._board.add(B.W_WAIT_NS, time.perf_counter_ns() - t0)
        if status == B.FAILED_OBJECT:
            kind, code, url, text = self._board.error(slot.status(index) >> B.ERROR_SHIFT)
            raise remote_error_of(kind, text, url, self.endpoint, code)

    def _fetcher_alive(self) -> bool:
        """Whether the fetcher process still runs: its pidfd, opened once in
        each process that waits (main's child, a worker's sibling), is
        readable once it has exited."""
        pid = self._proc.pid
        fd = _pidfds.get(pid)
        if fd is None:
            try:
                fd = _pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
        return not select.select([fd], [], [], 0)[0]

    def _trained(self, slot: B.Slot, index: int) -> None:
        slot.mark(index, B.TRAINED)
        if self._board.get(B.W_PARKED):  # it waits for room that this may free
            self._board.work.ring()

    # --- stats ----------------------------------------------------------------------------

    def remote_stats(self) -> dict:
        """What the fetcher did since the dataset was made (ShmLoader.stats()
        shows it as "remote"): objects and bytes fetched, objects an epoch
        found in the cache as it began, evictions by this job, failed
        fetches, listings made, the objects a worker found missing and asked
        for (train_on="cached": none, unless a file went from the cache
        behind its back), the workers' total wait for them, and
        for train_on="cached" how many objects were trained how many times
        ({times: objects})."""
        b = self._board
        if os.getpid() == self._owner and self._proc.poll() is None:
            self._drain()
            M.send(self._sock, M.Count())
            self._reply((M.Counted,), REPLY_TIMEOUT_S)
        out = {"objects_fetched": b.get(B.W_FETCHED), "bytes_fetched": b.get(B.W_FETCHED_BYTES),
               "cache_hits": b.get(B.W_HITS), "evictions": b.get(B.W_EVICTED),
               "fetch_errors": b.get(B.W_ERRORS), "listings": b.get(B.W_LISTINGS),
               "objects_waited_for": b.get(B.W_ASKED), "fetch_wait_s": b.get(B.W_WAIT_NS) / 1e9,
               "cache_limit_bytes": b.get(B.W_LIMIT)}   # (lowered if the disk filled up first)
        times = {k: b.get(B.W_HISTOGRAM + k) for k in range(1, B.HISTOGRAM)}
        out["times_trained"] = {k: n for k, n in times.items() if n}
        return out


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shmloader", "objects")


def _child_env() -> dict:
    """The fetcher's environment: this one, with the loader importable."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _stop(proc, sock, board, stderr) -> None:
    try:
        M.send(sock, M.Stop())
    except OSError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    sock.close()
    board.close()
    stderr.close()
