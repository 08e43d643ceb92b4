"""The fetcher: the process that lists the store and fills the cache
(NOTE [ Remote data ] in loader/datasets/remote/__init__.py).

Started by the dataset with subprocess (a fresh interpreter: never a fork
of a process whose network client may be in use), with the board's memfd
and one end of a socketpair as inherited fds.  It ends when main says
Stop, when the socket closes, or when main's process dies.

Threads, not asyncio: obstore's blocking calls release the GIL, so a pool
of `in_flight` threads keeps that many requests going (faster than its
async API on small objects, and its async runtime could abort the
interpreter at exit).  One scheduler thread decides what to fetch next,
under one lock, and wakes on a Condition that every event notifies:

  messages from main  ListRequest -> list the store (a thread) -> ListDone;
                      Adopt -> put a listing into a board slot, each
                      object's state from the cache -> Adopted; Order -> the
                      order in which a slot's epoch reads its objects
  the next object     1. one a worker waits for (WANTED)
                      2. train_on="all": the next of an active slot's order
                         not complete, ahead of the workers, bounded by the
                         cache (a reservation that does not fit parks the
                         fetcher until trained objects are unpinned)
                      3. train_on="cached": objects of the newest listing not
                         cached yet, evicting the most trained
  trained objects     a worker marks TRAINED on the board (and rings WORK if
                      the fetcher is parked); the fetcher counts them and
                      unpins them in the cache
"""

from __future__ import annotations

import concurrent.futures
import errno
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import NamedTuple

import numpy as np

from loader.datasets.remote import board as B
from loader.datasets.remote.messages import (
    Adopt, Adopted, Count, Counted, Describe, Described, Fatal, Footed, Footers, Forget,
    Install, Installed, ListDone, ListRequest, Order, Stop, listing_record, memfd_of,
    parse_record, read_bytes, read_int64, receive, send)
from loader.datasets.remote.cache import Entry, ObjectCache, Reservation, digest, extension
from loader.datasets.remote.footers import footers_record
from loader.errors import CacheFull, NoRoom, RemoteError

WAIT_SLICE_S = 1.0      # the scheduler's bounded wait (it is notified of every event)
COUNT_EVERY_S = 0.1     # trained objects are counted at most this often, unless parked
WINDOW_SHARE = 4        # read ahead at most a 1/WINDOW_SHARE of the cache's objects (_window)
FOOTER_THREADS = 16     # Parquet footers read at once (a remote ParquetDataset's epoch plan)


# --- the fetcher --------------------------------------------------------------------------

class Listing(NamedTuple):
    gen: int
    keys: list
    sizes: np.ndarray
    etags: list
    digests: np.ndarray     # (n, 32) uint8 and
    exts: np.ndarray        # (n, 16) uint8: the cache's file names


class Active:
    """What the fetcher does for one board slot."""

    def __init__(self, slot: B.Slot, listing: Listing):
        self.slot, self.listing = slot, listing
        self.ids = np.full(slot.count, -1, np.int64)    # cache object id, once known
        self.order: np.ndarray | None = None             # object indices, in the epoch's order
        self.place: np.ndarray | None = None             # object index -> its place in order
        self.next = 0                                    # the next place in order (or listing)
        self.reported = np.zeros(slot.count, bool)       # TRAINED counted in the cache
        self.same_as: dict = {}                          # older Active -> _same_objects()
        self.trained = 0                                 # objects of the order counted TRAINED
        self.window: int | None = None                   # Fetcher._window(), once known


def _same_objects(older: Active, newer: Active) -> bool:
    """Whether object i of both slots is the same object, for every i (the
    same listing; epochs list again, usually with nothing changed)."""
    if older.listing is newer.listing:
        return True
    same = newer.same_as.get(older)
    if same is None:
        a, b = older.listing, newer.listing
        same = newer.same_as[older] = a.keys == b.keys and a.etags == b.etags
    return same


class Fetcher:
    def __init__(self, cfg: dict, board: B.Board, sock: socket.socket):
        from loader.datasets.remote import store as S

        self.cfg, self.board, self.sock = cfg, board, sock
        self.pattern = S.parse(cfg["url"])
        self.endpoint = S.endpoint_of(self.pattern, cfg["storage_options"])
        self.store = S.open_store(self.pattern, cfg["storage_options"], cfg["deadline_s"])
        self.cache = ObjectCache(cfg["cache_dir"], cfg["cache_limit_bytes"],
                                 label=f"pid {os.getpid()} {cfg['url']}")
        self.board.set(B.W_LIMIT, self.cache.limit)
        self.cached_mode = cfg["train_on"] == "cached"
        self.pool = concurrent.futures.ThreadPoolExecutor(cfg["in_flight"], "fetch")
        self.in_flight_max = cfg["in_flight"]
        self.lock = threading.Condition()   # guards everything below, and the cache
        self.to_commit: list = []           # (Reservation, _Done): downloads to commit,
        self.to_commit_lock = threading.Lock()   # guarded by this lock alone
        self.listings: dict[int, Listing] = {}
        self.latest: Listing | None = None
        self.active: dict[int, Active] = {}              # slot -> what it needs
        self.newest_slot = -1
        self.in_flight: set = set()                      # (slot, index) being fetched
        self.fetching: dict = {}                         # (url, etag) -> Event of its fetch
        self.parked = False                              # waiting for room or another job
        self.wanted: list = []                           # (slot, Active, index) asked for,
        self.wanted_rang = -1                            # as of this count of WORK's rings
        self.counted_at = 0.0
        self.times_trained: dict = {}                    # (key, etag) -> epochs it was trained in
        self.stopping = False
        self.failure: BaseException | None = None        # a bug in a thread: the fetcher's end

    # --- main loop ----------------------------------------------------------------------

    def run(self) -> None:
        threads = [threading.Thread(target=self._messages, daemon=True, name="messages")]
        threads += [threading.Thread(target=self._watch, args=(bell,), daemon=True, name=name)
                    for bell, name in ((self.board.work, "work"), (self.cache.bell, "cache"))]
        for t in threads:
            t.start()
        self.board.set(B.W_STATE, B.RUNNING)
        with self.lock:
            while not self.stopping and self.failure is None:
                self._count_trained()
                while len(self.in_flight) < self.in_flight_max:
                    job = self._next_job()
                    if job is None:
                        break
                    self.in_flight.add(job)
                    self.pool.submit(self._fetch, *job)
                self.board.set(B.W_PARKED, int(self.parked))
                self.lock.wait(WAIT_SLICE_S)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.failure is not None:
            raise self.failure

    def _notify(self) -> None:
        with self.lock:
            self.lock.notify()

    def _watch(self, bell) -> None:
        """A thread: wake the scheduler on every ring of bell (a Doorbell)."""
        seen = bell.changes()
        while not self.stopping:
            bell.wait_change(seen, WAIT_SLICE_S)
            now = bell.changes()
            if now != seen:
                seen = now
                self._notify()

    def _messages(self) -> None:
        """A thread: main's messages, one at a time."""
        try:
            while not self.stopping:
                msg, fds = receive(self.sock)
                try:
                    self._handle(msg, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except BaseException as e:
            self._fail(e)

    def _handle(self, msg, fds) -> None:
        kind = type(msg)
        if msg is None or kind is Stop:
            with self.lock:
                self.stopping = True
                self.lock.notify()
        elif kind is ListRequest:
            threading.Thread(target=self._list, args=(msg.gen,), daemon=True,
                             name="listing").start()
        elif kind is Adopt:
            with self.lock:
                self._adopt(msg.slot, msg.gen)
                self.lock.notify()
        elif kind is Forget:
            with self.lock:
                self._forget()
                self.lock.notify()
        elif kind is Count:
            with self.lock:
                self.counted_at = 0.0
                self._count_trained()
            send(self.sock, Counted())
        elif kind is Describe:
            self._answer_about(msg, fds, Described, listing_record)
        elif kind is Footers:
            self._answer_about(msg, fds, Footed,
                               lambda listing, at: footers_record(self._footers(listing, at)))
        elif kind is Install:
            keys, etags, sizes = parse_record(read_bytes(fds[0], msg.nbytes))
            listing = self._listing(msg.gen, keys, etags, sizes)
            with self.lock:
                self.listings[msg.gen] = listing
            send(self.sock, Installed(gen=msg.gen, count=len(keys)))
        elif kind is Order:
            order = read_int64(fds[0], msg.count) if fds else None
            with self.lock:
                active = self.active.get(msg.slot)
                if active is not None and order is not None:
                    place = np.full(active.slot.count, len(order), np.int64)
                    valid = (order >= 0) & (order < active.slot.count)
                    place[order[valid]] = np.flatnonzero(valid)
                    active.order, active.place = order, place
                    if not self.cached_mode:   # (which walks the listing, for later epochs)
                        active.next = 0
                    active.trained = _in_order(active, np.flatnonzero(active.reported))
                self.lock.notify()

    def _answer_about(self, msg, fds, answer, record_of) -> None:
        """A question about the objects at some positions of a slot's
        listing (Describe, Footers: the positions as an fd): answer(nbytes)
        with record_of(listing, positions) as a memfd, or answer(0) without
        one if the slot no longer holds that listing."""
        positions = read_int64(fds[0], msg.count)
        with self.lock:
            active = self.active.get(msg.slot)
            listing = active.listing if active is not None and \
                active.slot.gen == msg.gen else None
        if listing is None:
            send(self.sock, answer(nbytes=0))
            return
        record = record_of(listing, positions)
        with memfd_of(record) as fd:
            send(self.sock, answer(nbytes=len(record)), fds=[fd])

    def _fail(self, e: BaseException) -> None:
        with self.lock:
            if self.failure is None and not self.stopping:
                self.failure = e
            self.lock.notify()

    # --- listing ------------------------------------------------------------------------

    def _list(self, gen: int) -> None:
        from loader.datasets.remote import store as S

        try:
            try:
                listed = S.list_objects(self.store, self.pattern, self.endpoint)
            except RemoteError as e:
                send(self.sock, ListDone(gen=gen, count=0, error=(e.kind, e.status, e.url, str(e))))
                return
            listing = self._listing(gen, listed.keys, listed.etags, listed.sizes)
            n = len(listing.keys)
            with self.lock:
                latest = self.latest
                if latest is not None and latest.keys == listing.keys and \
                        latest.etags == listing.etags:
                    gen = latest.gen   # nothing changed: the epoch keeps its listing
                else:
                    self.listings[gen] = self.latest = listing
            self.board.add(B.W_LISTINGS)
            send(self.sock, ListDone(gen=gen, count=n, error=None))
        except BaseException as e:
            self._fail(e)

    def _footers(self, listing: Listing, positions: np.ndarray) -> list[dict]:
        """footers.footer() of each object, FOOTER_THREADS requests at once;
        a RemoteError of the store's becomes that object's {"failed": ...}
        (its error's kind, status, url and text): the worker that reads
        the object raises it."""
        from loader.datasets.remote.footers import footer

        def one(i: int) -> dict:
            key = listing.keys[i]
            url = f"{self.pattern.root}/{key}"
            try:
                out = footer(self.store, key, listing.etags[i], int(listing.sizes[i]), url,
                             self.endpoint)
            except RemoteError as e:
                out = {"failed": [e.kind, e.status, e.url, str(e)]}
            return dict(out, url=url)

        with concurrent.futures.ThreadPoolExecutor(FOOTER_THREADS, "footers") as pool:
            return list(pool.map(one, (int(i) for i in positions)))

    def _forget(self) -> None:
        """(Under the lock.)  Every live slot retired: main dropped the runs
        that read them (a fetch in flight for one is dropped as it ends)."""
        k = None
        for s, active in self.active.items():
            self.cache.unpin_slot(s)
            state = active.slot.state
            for i in np.flatnonzero((state & (B.WANTED | B.STATUS_MASK)) == B.WANTED):
                if k is None:
                    k = self.board.record_error("remote", None, self.pattern.root,
                                                "its run was dropped (load_state_dict) before "
                                                "the object was fetched")
                active.slot.settle(int(i), B.FAILED_OBJECT, k)
        self.active, self.newest_slot, self.wanted = {}, -1, []
        self.board.arrived.ring()

    def _listing(self, gen: int, keys: list, etags: list, sizes) -> Listing:
        """A Listing of these objects, with their names in the cache."""
        urls = [f"{self.pattern.root}/{k}" for k in keys]
        n = len(urls)
        digests = np.frombuffer(b"".join(digest(u, t) for u, t in zip(urls, etags)),
                                np.uint8).reshape(n, B.DIGEST)
        exts = np.frombuffer(b"".join(extension(u).encode().ljust(B.EXT, b"\0")
                                      for u in urls), np.uint8).reshape(n, B.EXT)
        return Listing(gen=gen, keys=list(keys), sizes=np.array(sizes, np.int64),
                       etags=list(etags), digests=digests, exts=exts)

    def _adopt(self, s: int, gen: int) -> None:
        listing = self.listings[gen]
        urls = [f"{self.pattern.root}/{k}" for k in listing.keys]
        ids = self.cache.pin_epoch(s, list(zip(urls, listing.etags)))
        state = np.where(ids >= 0, B.COMPLETE, B.ABSENT).astype(np.int32)
        slot = self.board.fill(s, gen, listing.digests, listing.exts, listing.sizes, state)
        active = Active(slot, listing)
        active.ids[:] = ids
        self.board.add(B.W_HITS, int((state == B.COMPLETE).sum()))
        previous = (s - 1) % B.SLOTS
        for k in [k for k in self.active if k not in (previous, s)]:
            self.cache.unpin_slot(k)   # two epochs back: over
        self.active = {k: a for k, a in self.active.items() if k == previous}
        self.active[s] = active
        self.newest_slot = s
        keep = {a.listing.gen for a in self.active.values()} | {self.latest.gen}
        self.listings = {g: l for g, l in self.listings.items() if g in keep}
        self.board.arrived.ring()
        send(self.sock, Adopted(slot=s, gen=gen, count=slot.count))

    # --- what to fetch next (under the lock) ----------------------------------------------

    def _next_job(self):
        """(slot, index) of the next object to fetch, or None."""
        job = self._next_wanted()
        if job is not None:
            return job
        if self.parked:
            return None
        if not self.cached_mode:
            for s, active in self._by_age():
                job = self._next_absent(s, active, active.order)
                if job is not None:
                    return job
        elif self.newest_slot >= 0:
            return self._next_absent(self.newest_slot, self.active[self.newest_slot], None)
        return None

    def _next_wanted(self):
        """The next object a worker asked for: not here, not being fetched,
        and not trained this epoch already (a trained object evicted since
        keeps its flags: it is not needed again).  The slots' state words
        are read again only after a worker rang WORK (it marks WANTED
        before it rings), not for every job: a listing of a million objects
        took 1.3 ms a read."""
        rang = self.board.work.changes()
        if rang != self.wanted_rang:
            self.wanted_rang = rang
            self.wanted = []
            for s, active in self._by_age():
                state = active.slot.state
                asked = np.flatnonzero((state & (B.WANTED | B.TRAINED | B.STATUS_MASK))
                                       == B.WANTED)
                self.wanted += [(s, active, int(i)) for i in asked]
            self.wanted.reverse()   # (popped from the end: the older slot's first)
        while self.wanted:
            s, active, i = self.wanted.pop()
            if self.active.get(s) is active and (s, i) not in self.in_flight and \
                    active.slot.state[i] & (B.TRAINED | B.STATUS_MASK) == B.ABSENT:
                return s, i
        return None

    def _by_age(self):
        """Active slots, the older epoch first (it is the one being trained)."""
        if self.newest_slot < 0:
            return []
        older = (self.newest_slot - 1) % B.SLOTS
        return [(s, self.active[s]) for s in (older, self.newest_slot) if s in self.active]

    def _cursor(self, active: Active, i: int) -> int:
        """Where _next_absent() finds object i: its place in the epoch's
        order, or for train_on="cached" (which fetches the listing's absent
        objects, for the epochs to come) its index in the listing."""
        return i if self.cached_mode else _place(active, i)

    def _next_absent(self, s: int, active: Active, order):
        """The next object of the slot (in `order`, else in the listing's)
        that is neither complete nor being fetched."""
        state, n = active.slot.state, active.slot.count
        end = len(order) if order is not None else n
        while active.next < end:
            i = int(order[active.next]) if order is not None else active.next
            active.next += 1
            if 0 <= i < n and state[i] & (B.STATUS_MASK | B.TRAINED) == B.ABSENT and \
                    (s, i) not in self.in_flight:
                return s, i
        return None

    # --- one object (a pool thread) ---------------------------------------------------------

    def _fetch(self, s: int, i: int) -> None:
        """Object i of slot s into the cache, and its status onto the board.
        The same object wanted by two slots (this epoch's and the next's) is
        fetched once: the second waits for the first."""
        try:
            with self.lock:
                active = self.active.get(s)
                if active is None:
                    return
                listing, slot = active.listing, active.slot
                key, etag, size = listing.keys[i], listing.etags[i], int(listing.sizes[i])
                url = f"{self.pattern.root}/{key}"
                other = self.fetching.get((url, etag))
                if other is None:
                    done = self.fetching[(url, etag)] = _Done()
            if other is not None:
                got = other.wait()
            else:
                got = None
                try:
                    got = self._get(url, key, etag, size, s, i, active)
                finally:
                    with self.lock:
                        del self.fetching[(url, etag)]
                    done.set(got)   # (None after an exception: the other parks)
            with self.lock:
                if self.active.get(s) is not active:
                    # its epoch was retired meanwhile, and the slot may hold a newer
                    # listing (adopted into it again): object i there is another
                    # object, or none.  What was fetched is in the cache, found
                    # there by the newer epochs.
                    return
                if got is None:
                    # parked: not fetched now; go back to it when the cache changes
                    if slot.state[i] & B.WANTED:
                        self.wanted_rang = -1   # (read the asked-for objects again)
                    elif active.next > 0:
                        active.next = min(active.next, self._cursor(active, i))
                    return
                if isinstance(got, RemoteError):
                    k = self.board.record_error(got.kind, got.status, got.url, str(got))
                    slot.settle(i, B.FAILED_OBJECT, k)
                else:
                    active.ids[i] = got.id
                    slot.settle(i, B.COMPLETE)
            self.board.arrived.ring()
        except BaseException as e:
            self._fail(e)
        finally:
            with self.lock:
                self.in_flight.discard((s, i))
                active = self.active.get(s)
                if active is not None and active.slot.state[i] & (
                        B.WANTED | B.TRAINED | B.STATUS_MASK) == B.WANTED:
                    # still asked for, and no longer in flight: the list of asked-for
                    # objects may have dropped it while it was (read them again)
                    self.wanted_rang = -1
                self.lock.notify()

    def _get(self, url: str, key: str, etag: str, size: int, slot: int, index: int,
             active: Active):
        """The object's cache Entry (fetched now, or found complete), its
        RemoteError, or None: parked until the cache changes (no room, or
        another job is fetching it).  `active`: the adoption of `slot` the
        fetch is for (its index means something in that listing only)."""
        from loader.datasets.remote import store as S

        with self.lock:
            if self.active.get(slot) is not active:
                # its epoch was retired by a newer one's adoption meanwhile; after
                # SLOTS adoptions the slot number is active again with another
                # listing, so the adoption itself is compared, not its number
                return None
            try:
                got = self.cache.reserve(url, etag, size, slot, self._spare(slot, index, size))
            except NoRoom:
                got = None
            except OSError as e:   # the disk is full: the index could not take the change
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                got = None
                self._lower_limit(size, e.strerror or str(e))
            self._evicted(self.cache.last_evicted)
            if got is None:
                self.parked = True
                return None
        if isinstance(got, Entry):
            self.board.add(B.W_HITS)
            return got
        res: Reservation = got
        try:
            S.download(self.store, key, etag, size, res.tmp, url, self.endpoint)
            entry = self._commit(res)
        except RemoteError as e:
            with self.lock:
                self.cache.abort(res)
            self.board.add(B.W_ERRORS)
            return e
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                with self.lock:
                    self.cache.abort(res)
                raise
            return self._disk_full(res, url, e, slot, index, active)
        except BaseException:
            with self.lock:
                self.cache.abort(res)
            raise
        self.board.add(B.W_FETCHED)
        self.board.add(B.W_FETCHED_BYTES, size)
        self.board.set(B.W_EVICTED, self.cache.evicted)
        return entry

    def _commit(self, res: Reservation) -> Entry:
        """cache.commit(res), combined: downloads that finish while another
        thread holds the lock queue up, and whoever takes the lock next
        commits all of them in one transaction (the index's cost is per
        transaction)."""
        mine = _Done()
        with self.to_commit_lock:
            self.to_commit.append((res, mine))
        with self.lock:
            with self.to_commit_lock:
                batch, self.to_commit = self.to_commit, []
            if batch:
                try:
                    for (_, done), entry in zip(batch, self.cache.commit_many([r for r, _ in batch])):
                        done.set(entry)
                except BaseException as e:
                    for _, done in batch:
                        done.set(e)
        # Set by now: queued before this thread took the lock, so committed
        # by it or by a thread that held the lock before it.
        got = mine.value
        if isinstance(got, OSError):
            raise OSError(got.errno, got.strerror)   # (each thread its own)
        if isinstance(got, BaseException):
            raise got
        return got

    def _disk_full(self, res: Reservation, url: str, err: OSError, s: int, i: int,
                   active: Active):
        """The disk filled up before cache_limit_bytes (a disk shared with
        other programs, or smaller than the limit): the limit comes down
        below what the cache holds now, and this object waits for the room
        that eviction makes (parked).  If the limit was lowered already, the
        disk is still full, no object is needed later than this one and none
        this job cached is still to be trained, a CacheFull for the object."""
        with self.lock:
            try:
                self.cache.abort(res)
            except OSError as e:   # (not even its room could be recorded: the next job's recover)
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
            # (room may also come from objects needed later than this one:
            # the next reserve() evicts them down to the lower limit)
            if self._lower_limit(res.size, err.strerror or str(err)) or \
                    (self.active.get(s) is active and self._needed_later(s, i, res.size)) or \
                    self._holds_untrained():
                return None
        self.board.add(B.W_ERRORS)
        return CacheFull(f"the disk of cache_dir {self.cache.dir} is full ({err.strerror}) with "
                         f"{self.cache.used_bytes()} bytes cached, all still needed",
                         url=url, endpoint=self.endpoint)

    def _holds_untrained(self) -> bool:
        """(Under the lock.)  Whether an object this job has cached is still
        to be trained: once it is, its room is free (so waiting ends)."""
        for active in self.active.values():
            state = active.slot.state
            if np.any(((state & B.STATUS_MASK) == B.COMPLETE) & ((state & B.TRAINED) == 0)
                      & (active.ids >= 0)):
                return True
        return False

    def _lower_limit(self, nbytes: int, why: str) -> bool:
        """(Under the lock.)  The cache's limit lowered to what it holds less
        room for a few more objects and its index; False if nothing could be
        evicted for it."""
        used = self.cache.used_bytes()
        limit = max(0, min(self.cache.limit, used - 2 * nbytes))
        self.cache.shrink(limit)
        for active in self.active.values():
            active.window = None   # (a share of what the cache holds: less now)
        self._evicted(self.cache.last_evicted)
        self.cache.make_ballast()   # again, from the room just made
        self.parked = True
        self.board.set(B.W_LIMIT, self.cache.limit)
        print(f"fetcher: the disk of {self.cache.dir} is full ({why}) with {used} bytes cached: "
              f"cache_limit_bytes lowered to {limit}", file=sys.stderr, flush=True)
        return bool(self.cache.last_evicted) or used > self.cache.used_bytes()

    def _spare(self, s: int, i: int, nbytes: int) -> list[int]:
        """Cache ids of objects this job holds but needs after object i of
        slot s, the latest first: what it may evict to fetch i (under the
        lock).  The next epoch's objects come after every one of this
        epoch's; within an epoch, by their place in its order.  Never one
        a worker has asked for, is reading, or trained."""
        wanted = self.active[s].slot.state[i] & B.WANTED
        if self.cached_mode and not wanted:
            # The rotation: an object for the epochs to come.  Its room comes
            # from objects no live epoch still needs (unpinned), never from an
            # epoch's set: a worker would find that one missing, and with both
            # live epochs' sets waiting and the cache full, nothing is left to
            # evict (the fetcher parked for ever: a hang).
            return []
        active = self.active[s]
        ahead = _place(active, i) - active.trained
        if not self.cached_mode and ahead > self._window(active) and not wanted:
            # Every object of the cache is trained again this epoch: reading
            # further ahead than the window would evict one the epoch still
            # trains (a miss later) for one it needs no sooner.
            # Beyond that, room comes from objects trained (NOTE [ Remote data ]).
            return []
        return self._needed_later(s, i, nbytes)

    def _window(self, active: Active) -> int:
        """How far past what the workers trained the fetcher reads ahead by
        evicting objects needed later: requests_in_flight places, and at
        most a quarter of what the cache holds (a cache of a few large objects,
        Parquet files, otherwise had its objects for the next places evicted
        for nearer ones over and over: 38 fetches of 20 files in an epoch
        through a cache of 10)."""
        if active.window is None:
            mean = float(active.slot.sizes.mean()) if active.slot.count else 1.0
            active.window = int(min(self.in_flight_max, max(1, self.cache.limit // max(mean, 1)
                                                            // WINDOW_SHARE)))
        return active.window

    def _needed_later(self, s: int, i: int, nbytes: int) -> list[int]:
        """_spare() however far ahead object i is."""
        ages = self._by_age()
        here = next(k for k, (slot, _) in enumerate(ages) if slot == s)
        mine = _place(self.active[s], i)
        out, total = [], 0
        for k in range(len(ages) - 1, here - 1, -1):
            slot, active = ages[k]
            state = active.slot.state
            held = np.flatnonzero(((state & B.STATUS_MASK) == B.COMPLETE)
                                  & ((state & (B.TRAINED | B.WANTED)) == 0) & (active.ids >= 0))
            for _, older in ages[:k]:
                # An object the older epoch has still to train is needed then,
                # not at its place in this one: evicting it costs that epoch a
                # fetch (a cache of a quarter of the data served 0.61 of it so)
                if len(held) and _same_objects(older, active):
                    held = held[(older.slot.state[held] & B.TRAINED) != 0]
            places = active.place[held] if active.place is not None else held
            if slot == s:
                keep = places > mine
                held, places = held[keep], places[keep]
            for j in held[np.argsort(-places, kind="stable")]:
                out.append(int(active.ids[j]))
                total += int(active.slot.sizes[j])
                if total >= 4 * nbytes:   # enough to choose from
                    return out
        return out

    def _count_trained(self) -> None:
        """Objects the workers opened since the last look (under the lock):
        counted and unpinned in the cache, so they may be evicted and room
        is free.  At most every COUNT_EVERY_S unless parked: it reads every
        object's state word."""
        now = time.monotonic()
        if not self.parked and now - self.counted_at < COUNT_EVERY_S:
            return
        self.counted_at = now
        freed = False
        for active in self.active.values():
            marked = (active.slot.state & B.TRAINED) != 0
            new = np.flatnonzero(marked & ~active.reported & (active.ids >= 0))
            if len(new):
                try:
                    self.cache.trained(active.slot.index, [int(x) for x in active.ids[new]])
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    self._lower_limit(0, e.strerror or str(e))
                    continue   # counted at the next look, once the room is made
                self._histogram(active, new)
                self._evicted(self.cache.last_evicted)
                active.reported[new] = True
                active.trained += _in_order(active, new)
                freed = True
        if freed or self.parked:
            self.parked = False   # try again: room may have been made, or another job finished


    def _histogram(self, active: Active, new: np.ndarray) -> None:
        """How many objects this job trained how many times (stats())."""
        for i in new:
            key = (active.listing.keys[i], active.listing.etags[i])
            k = self.times_trained.get(key, 0) + 1
            self.times_trained[key] = k
            if k > 1 and k - 1 < B.HISTOGRAM:
                self.board.add(B.W_HISTOGRAM + k - 1, -1)
            if k < B.HISTOGRAM:
                self.board.add(B.W_HISTOGRAM + k, 1)

    def _evicted(self, ids: list[int]) -> None:
        """Objects the cache just evicted are absent again in every slot
        that has them (under the lock; a slot pins what its epoch still
        needs, so no worker of it is about to open one)."""
        if not ids:
            return
        gone = np.array(ids, np.int64)
        for active in self.active.values():
            evicted = np.flatnonzero(np.isin(active.ids, gone))
            for i in evicted:
                active.ids[i] = -1
                active.slot.settle(int(i), B.ABSENT)
                if active.slot.state[i] & (B.WANTED | B.TRAINED) == B.WANTED:
                    self.wanted_rang = -1   # (asked for before, and absent again)
            if len(evicted):   # fetched again when their turn comes
                active.next = min(active.next, min(self._cursor(active, int(i)) for i in evicted))
        self.board.set(B.W_EVICTED, self.cache.evicted)
        self.board.arrived.ring()   # (a worker whose open lost the race waits for this)


    def describe(self) -> str:
        """What the fetcher is doing, in words (SIGUSR2 writes it to its
        stderr; read without the lock: for people, not for decisions)."""
        lines = [f"fetcher pid {os.getpid()}: parked={self.parked} in_flight={len(self.in_flight)}"
                 f" stopping={self.stopping} cache used {self.cache.used_bytes()} of "
                 f"{self.cache.limit} bytes, evicted {self.cache.evicted}"]
        for s, active in self._by_age():
            state = active.slot.state
            status = state & B.STATUS_MASK
            lines.append(
                f"  slot {s} gen {active.slot.gen}: {active.slot.count} objects, "
                f"{int((status == B.COMPLETE).sum())} complete, {int((status == B.FAILED_OBJECT).sum())} "
                f"failed, {int(((state & B.WANTED) != 0).sum())} wanted, "
                f"{int(((state & B.TRAINED) != 0).sum())} trained, next {active.next}, "
                f"order {'known' if active.order is not None else 'not known'}")
        pins = self.cache.db.execute("SELECT slot, COUNT(*) FROM pins WHERE job = ? GROUP BY slot",
                                     (self.cache.job,)).fetchall()
        lines.append(f"  pins by slot: {dict(pins)}")
        return "\n".join(lines)


class _Done:
    """A result one thread sets for another: a fetch's, for a thread that
    wants the same object; a commit's, for the thread that queued it."""

    def __init__(self):
        self.event, self.value = threading.Event(), None

    def set(self, value) -> None:
        self.value = value
        self.event.set()

    def wait(self):
        self.event.wait()
        return self.value


def _in_order(active: Active, objects: np.ndarray) -> int:
    """How many of these objects the slot's epoch reads (all, before its
    order is known): what counts toward `trained`, against which places in
    the order are measured (a rank of several marks the objects it reads
    none of trained at once)."""
    if active.place is None:
        return len(objects)
    return int(np.count_nonzero(active.place[objects] < len(active.order)))


def _place(active: Active, i: int) -> int:
    """Where object i is in the slot's order (or listing)."""
    if active.place is None:
        return i
    return int(active.place[i])


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is main's to handle
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # its stacks, when main asks
    from loader import _native
    from loader.main.procs import PARENT_DEATH_SIGNAL

    _native.die_with_parent(cfg["parent"], PARENT_DEATH_SIGNAL)
    board = B.Board(cfg["board_fd"])
    sock = socket.socket(fileno=cfg["sock_fd"])
    code = 1
    fetcher = None
    try:
        fetcher = Fetcher(cfg, board, sock)
        signal.signal(signal.SIGUSR2, lambda *_: print(fetcher.describe(), file=sys.stderr,
                                                       flush=True))
        fetcher.run()
        code = 0
    except BaseException:
        board.set(B.W_STATE, B.FAILED)
        board.arrived.ring()
        try:
            send(sock, Fatal(traceback.format_exc()))
        except OSError:
            pass
        traceback.print_exc()
    finally:
        if fetcher is not None:
            fetcher.stopping = True
            fetcher.cache.close()
        if code == 0:
            board.set(B.W_STATE, B.STOPPED)
            board.arrived.ring()
        sys.stderr.flush()
        os._exit(code)   # (no interpreter teardown under a client's threads)


if __name__ == "__main__":
    # Run as the module loader.datasets.remote.fetcher, not as __main__: one
    # module object, whoever imports it (tests/support/fetcher_pause hooks it).
    from loader.datasets.remote.fetcher import main as fetcher_main

    fetcher_main()
