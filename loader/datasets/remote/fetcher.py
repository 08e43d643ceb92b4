"""The fetcher: the process that lists the store and fills the cache
(NOTE [ Remote data ] in loader/datasets/remote/__init__.py).

Started by the dataset with subprocess (a fresh interpreter: never a fork
of a process whose network client may be in use), with the board's memfd
and one end of a socketpair as inherited fds.  It ends when main says
Stop, when the socket closes, or when main's process dies.

Its loop (asyncio: obstore's requests are awaited, up to `in_flight` at
once):

  messages from main  ListRequest -> list the store in the background ->
                      ListDone; Adopt -> put a listing into a board slot,
                      each object's state from the cache -> Adopted; Order ->
                      the order in which a slot's epoch will read its objects
  the next object     1. one a worker waits for (WANTED)
                      2. the next of an active slot's order not complete
                         (train_on="all": ahead of the workers, bounded by
                         the cache: a reservation that does not fit waits
                         until trained objects are unpinned)
                      3. train_on="cached": objects of the newest listing
                         not cached yet, evicting the most trained
  trained objects     a worker marks TRAINED on the board and rings WORK;
                      the fetcher counts them and unpins them in the cache
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from typing import NamedTuple

import numpy as np

from loader.datasets.remote import board as B
from loader.datasets.remote.cache import Entry, ObjectCache, Reservation, digest, extension
from loader.errors import NoRoom, RemoteError


# --- messages (both directions; pickled over the socketpair) ------------------------------

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
        self.next = 0                                    # the next place in order (or listing)
        self.reported = np.zeros(slot.count, bool)       # TRAINED counted in the cache


class Fetcher:
    def __init__(self, cfg: dict, board: B.Board, sock: socket.socket):
        from loader.datasets.remote import store as S

        self.cfg, self.board, self.sock = cfg, board, sock
        self.pattern = S.parse(cfg["url"])
        self.endpoint = S.endpoint_of(self.pattern, cfg["storage_options"])
        self.store = S.open_store(self.pattern, cfg["storage_options"], cfg["deadline_s"])
        self.cache = ObjectCache(cfg["cache_dir"], cfg["cache_limit_bytes"],
                                 label=f"pid {os.getpid()} {cfg['url']}")
        self.cached_mode = cfg["train_on"] == "cached"
        self.in_flight_max = cfg["in_flight"]
        self.listings: dict[int, Listing] = {}
        self.latest: Listing | None = None
        self.active: dict[int, Active] = {}              # slot -> what it needs
        self.newest_slot = -1
        self.in_flight: set = set()                      # (slot, index) being fetched
        self.parked = False                              # waiting for room or another job
        self.wake = asyncio.Event()
        self.background: set = set()                     # listings under way
        self.fetching: dict = {}                         # (url, etag) -> its fetch's future
        self.stopping = False

    # --- main loop ----------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._on_message)
        for bell in (self.board.work, self.cache.bell):
            threading.Thread(target=self._watch, args=(bell,), daemon=True).start()
        self.board.set(B.W_STATE, B.RUNNING)
        tasks: set = set()
        while not self.stopping:
            self.wake.clear()
            self._count_trained()
            while len(tasks) < self.in_flight_max:
                job = self._next_job()
                if job is None:
                    break
                tasks.add(asyncio.ensure_future(self._fetch(*job)))
            woken = asyncio.ensure_future(self.wake.wait())
            done, _ = await asyncio.wait(tasks | {woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            for t in done - {woken}:
                tasks.discard(t)
                t.result()   # (a bug here is the fetcher's death, reported to main)
        for t in tasks:
            t.cancel()

    def _watch(self, bell) -> None:
        """A thread: wake the loop on every ring of bell (a Doorbell)."""
        seen = bell.changes()
        while not self.stopping:
            bell.wait_change(seen, 0.25)
            now = bell.changes()
            if now != seen:
                seen = now
                self.loop.call_soon_threadsafe(self.wake.set)

    def _on_message(self) -> None:
        try:
            msg, fds = receive(self.sock)
        except BlockingIOError:
            return
        if msg is None or type(msg) is Stop:
            self.stopping = True
        elif type(msg) is ListRequest:
            task = asyncio.ensure_future(self._list(msg.gen))
            self.background.add(task)          # (a task nobody holds may be collected)
            task.add_done_callback(self.background.discard)
        elif type(msg) is Adopt:
            self._adopt(msg.slot, msg.gen)
        elif type(msg) is Order:
            self._order(msg, fds)
        for fd in fds:
            os.close(fd)
        self.wake.set()

    # --- listing ------------------------------------------------------------------------

    async def _list(self, gen: int) -> None:
        from loader.datasets.remote import store as S

        try:
            listed = await S.list_objects(self.store, self.pattern, self.endpoint)
        except RemoteError as e:
            send(self.sock, ListDone(gen, 0, (e.kind, e.status, e.url, str(e))))
            return
        urls = [f"{self.pattern.root}/{k}" for k in listed.keys]
        n = len(urls)
        digests = np.frombuffer(b"".join(digest(u, t) for u, t in zip(urls, listed.etags)),
                                np.uint8).reshape(n, B.DIGEST)
        exts = np.frombuffer(b"".join(extension(u).encode().ljust(B.EXT, b"\0") for u in urls),
                             np.uint8).reshape(n, B.EXT)
        listing = Listing(gen=gen, keys=listed.keys, sizes=np.array(listed.sizes, np.int64),
                          etags=listed.etags, digests=digests, exts=exts)
        self.listings[gen] = self.latest = listing
        self.board.add(B.W_LISTINGS)
        send(self.sock, ListDone(gen, len(listed.keys), None))

    def _adopt(self, s: int, gen: int) -> None:
        listing = self.listings[gen]
        urls = [f"{self.pattern.root}/{k}" for k in listing.keys]
        entries = self.cache.pin_epoch(list(zip(urls, listing.etags)))
        state = np.array([B.COMPLETE if e is not None else B.ABSENT for e in entries], np.int32)
        slot = self.board.fill(s, gen, listing.digests, listing.exts, listing.sizes, state)
        active = Active(slot, listing)
        for i, e in enumerate(entries):
            if e is not None:
                active.ids[i] = e.id
        self.board.add(B.W_HITS, int((state == B.COMPLETE).sum()))
        self.active[s] = active
        self.newest_slot = s
        for old in [k for k in self.active if k not in (s, (s - 1) % B.SLOTS)]:
            del self.active[old]   # two epochs back: its slot is reused
        for g in [g for g in self.listings if g != gen and g != self.latest.gen
                  and all(a.listing.gen != g for a in self.active.values())]:
            del self.listings[g]
        self.board.arrived.ring()
        send(self.sock, Adopted(s, gen, slot.count))

    def _order(self, msg: Order, fds) -> None:
        active = self.active.get(msg.slot)
        if active is None or not fds:
            return
        size = msg.count * 8
        with os.fdopen(os.dup(fds[0]), "rb") as f:
            order = np.frombuffer(f.read(size), np.int64)
        active.order, active.next = order, 0

    # --- what to fetch next -------------------------------------------------------------

    def _next_job(self):
        """(slot, index) of the next object to fetch, or None."""
        for s, active in self._by_age():
            state = active.slot.state
            wanted = np.flatnonzero((state & (B.WANTED | B.STATUS_MASK)) == B.WANTED)
            for i in wanted:
                if (s, int(i)) not in self.in_flight:
                    return s, int(i)
        if self.parked:
            return None
        for s, active in self._by_age():
            if self.cached_mode:
                continue  # its epoch's objects are all local
            job = self._next_in_order(s, active)
            if job is not None:
                return job
        if self.cached_mode and self.newest_slot >= 0:
            return self._next_uncached()
        return None

    def _by_age(self):
        """Active slots, the older epoch first (it is the one being trained)."""
        if self.newest_slot < 0:
            return []
        older = (self.newest_slot - 1) % B.SLOTS
        return [(s, self.active[s]) for s in (older, self.newest_slot) if s in self.active]

    def _next_in_order(self, s: int, active: Active):
        state, n = active.slot.state, active.slot.count
        order = active.order
        while active.next < (len(order) if order is not None else n):
            i = int(order[active.next]) if order is not None else active.next
            if i < n and state[i] & B.STATUS_MASK == B.ABSENT and (s, i) not in self.in_flight:
                return s, i
            active.next += 1
        return None

    def _next_uncached(self):
        """train_on="cached": an object of the newest listing that no slot
        has complete, for the epochs to come."""
        active = self.active[self.newest_slot]
        state, n = active.slot.state, active.slot.count
        while active.next < n:
            i = active.next
            if state[i] & B.STATUS_MASK == B.ABSENT and (self.newest_slot, i) not in self.in_flight:
                return self.newest_slot, i
            active.next += 1
        return None

    # --- one object ---------------------------------------------------------------------

    async def _fetch(self, s: int, i: int) -> None:
        """Object i of slot s into the cache, and its status onto the board.
        The same object wanted by two slots (this epoch's and the next's) is
        fetched once: the second waits for the first."""
        active = self.active.get(s)
        if active is None:
            return
        self.in_flight.add((s, i))
        try:
            listing, slot = active.listing, active.slot
            key, etag, size = listing.keys[i], listing.etags[i], int(listing.sizes[i])
            url = f"{self.pattern.root}/{key}"
            pending = self.fetching.get((url, etag))
            if pending is None:
                pending = self.fetching[(url, etag)] = self.loop.create_future()
                try:
                    got = await self._get(url, key, etag, size, wanted=bool(
                        slot.state[i] & B.WANTED))
                except BaseException as e:
                    pending.set_exception(e)
                    raise
                finally:
                    del self.fetching[(url, etag)]
                pending.set_result(got)
            else:
                got = await asyncio.shield(pending)
            if got is None:
                return   # parked: no room now, or another job fetches it
            if isinstance(got, RemoteError):
                k = self.board.record_error(got.kind, got.status, got.url, str(got))
                slot.settle(i, B.FAILED_OBJECT, k)
            else:
                active.ids[i] = got.id
                slot.settle(i, B.COMPLETE)
            self.board.arrived.ring()
        finally:
            self.in_flight.discard((s, i))

    async def _get(self, url: str, key: str, etag: str, size: int, wanted: bool):
        """The object's cache Entry (fetched now, or found complete), its
        RemoteError, or None: parked until the cache changes (no room, or
        another job is fetching it)."""
        from loader.datasets.remote import store as S

        try:
            got = self.cache.reserve(url, etag, size)
        except NoRoom:
            got = None
        if got is None:
            self.parked = True
            return None
        if isinstance(got, Entry):
            self.board.add(B.W_HITS)
            return got
        res: Reservation = got
        try:
            await S.download(self.store, key, etag, size, res.tmp, url, self.endpoint)
            entry = self.cache.commit(res)
        except RemoteError as e:
            self.cache.abort(res)
            self.board.add(B.W_ERRORS)
            return e
        except BaseException:
            self.cache.abort(res)
            raise
        self.board.add(B.W_FETCHED)
        self.board.add(B.W_FETCHED_BYTES, size)
        self.board.set(B.W_EVICTED, self.cache.evicted)
        return entry

    def _count_trained(self) -> None:
        """Objects the workers opened since the last look: counted and
        unpinned in the cache, so they may be evicted (and room is free)."""
        freed = False
        for active in self.active.values():
            marked = (active.slot.state & B.TRAINED) != 0
            new = np.flatnonzero(marked & ~active.reported & (active.ids >= 0))
            if len(new):
                self.cache.trained([int(x) for x in active.ids[new]])
                active.reported[new] = True
                freed = True
        if freed or self.parked:
            self.parked = False   # try again: room may have been made, or another job finished


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is main's to handle
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # its stacks, when main asks
    from loader import _native

    from loader.main.procs import PARENT_DEATH_SIGNAL

    _native.die_with_parent(cfg["parent"], PARENT_DEATH_SIGNAL)
    board = B.Board(cfg["board_fd"])
    sock = socket.socket(fileno=cfg["sock_fd"])
    try:
        fetcher = Fetcher(cfg, board, sock)
    except BaseException as e:
        board.set(B.W_STATE, B.FAILED)
        try:
            send(sock, Fatal(f"{type(e).__name__}: {e}"))
        finally:
            raise
    try:
        asyncio.run(fetcher.run())
    except BaseException:
        board.set(B.W_STATE, B.FAILED)
        try:
            send(sock, Fatal(traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        fetcher.stopping = True
        fetcher.cache.close()
        board.set(B.W_STATE, B.STOPPED)
        board.arrived.ring()


if __name__ == "__main__":
    # Run as loader.datasets.remote.fetcher, not as __main__: the messages main
    # pickles name their classes in that module.
    from loader.datasets.remote.fetcher import main as fetcher_main

    fetcher_main()
