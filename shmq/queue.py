"""``shmq.Queue``: the Python face of one ring.

Roles.  A queue has one consumer (the first handle that calls ``get``) and
one producer (``multi_producer=False``) or any number of producers.  Like
the write end of a pipe, every open handle that is not the consumer counts
as a potential producer: the creator, every ``attach()``, and every process
forked while holding a handle.  The consumer sees ``Closed`` once the ring
is drained and all of them have closed, or ``PeerLost`` if one died without
closing.  Interpreter exit closes a process's handles; a kill does not.

Ownership.  Only the process that created a queue unlinks its name, on
``close()``, garbage collection or interpreter exit; forked children and
attachers never do.  ``unlink()`` removes the name early, once every process
that needs it has attached.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import sys
import warnings

import numpy as np

from shmq import _core, segment
from shmq.views import MessageView, Reservation

__all__ = ["Queue"]

_DEFAULT_CAPACITY = 64 << 20



def _capacity_for(capacity_bytes) -> int:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise TypeError(f"capacity_bytes must be an int, not {type(capacity_bytes).__name__}")
    if capacity_bytes <= 0 or capacity_bytes > _core.MAX_CAPACITY:
        raise ValueError(f"capacity_bytes must be in 1..{_core.MAX_CAPACITY}, got {capacity_bytes}")
    # A power of two (index = pos & mask) and at least a page (the data
    # region is mapped twice, page by page).
    return max(_core.MIN_CAPACITY, 1 << (capacity_bytes - 1).bit_length())


def _check_timeout(timeout):
    if timeout is None or type(timeout) is float and timeout >= 0:
        return timeout  # the common cases, without the checks below
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
    if timeout != timeout or timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
    return timeout


def _creation_site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("shmq"):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?"


class Queue:
    """A lock-free queue of numpy arrays (and trees of them) in one POSIX
    shared-memory segment.

    ``Queue(capacity_bytes, multi_producer)`` creates a ring; ``q.name``
    identifies it and ``Queue.attach(name)`` opens it from any process.
    ``capacity_bytes`` is rounded up to a power of two (at least 4096); the
    largest message is about that size.  A handle is for one thread at a
    time: attach again to use the queue from another thread.

    ``anonymous=True`` creates a queue with no name (``q.name`` is None): it
    lives in unnamed shared memory (memfd), never in /dev/shm, and is shared
    only with processes forked while it is open.  Nothing can leak it, even
    a SIGKILL during creation, and its memory is returned when its last
    handle closes.  ``keep_fd=True`` (with ``anonymous=True``) keeps its
    memfd open as ``q.fd`` until ``close()``: a process started with that
    descriptor at the same number (``pass_fds``) can unpickle the queue,
    which attaches by the descriptor; otherwise ``q.fd`` is None.
    """

    __slots__ = ("_ring", "_name", "_creator_pid", "_pid", "_site", "_fd", "__weakref__")

    def __init__(self, capacity_bytes: int = _DEFAULT_CAPACITY, multi_producer: bool = False, *,
                 anonymous: bool = False, keep_fd: bool = False):
        capacity = _capacity_for(capacity_bytes)
        mpsc = bool(multi_producer)
        self._fd = None
        if keep_fd and not anonymous:
            raise ValueError("keep_fd=True keeps an anonymous queue's memfd: pass anonymous=True "
                             "too (a named queue is attached by its name)")
        if anonymous:
            fd = segment.create_anonymous(_core.segment_bytes(capacity, mpsc))
            try:
                ring = _core.Ring.create(fd, capacity, mpsc, f"anonymous queue of pid {os.getpid()}",
                                         anonymous=True)
            except BaseException:
                os.close(fd)
                raise
            if keep_fd:
                self._fd = fd
            else:
                os.close(fd)
            self._setup(ring, None, creator_pid=None)  # no name: nothing to unlink
            return
        name = segment.new_name()
        fd = segment.create(name, _core.segment_bytes(capacity, mpsc))
        try:
            ring = _core.Ring.create(fd, capacity, mpsc, name)
        except BaseException:
            segment.unlink(name)
            raise
        finally:
            os.close(fd)
        self._setup(ring, name, creator_pid=os.getpid())

    @staticmethod
    def footprint(capacity_bytes: int = _DEFAULT_CAPACITY, multi_producer: bool = False) -> int:
        """Bytes of /dev/shm a queue of this capacity takes (its segment,
        header and publication tags included), to check for room first."""
        return _core.segment_bytes(_capacity_for(capacity_bytes), bool(multi_producer))

    @classmethod
    def attach(cls, name: str) -> "Queue":
        """Open an existing queue by name, from any process of the same user.

        ``name`` is ``q.name``; its leading ``/`` may be left out (as
        ``ls /dev/shm`` shows it).  ``FileNotFoundError`` if no such queue
        exists.  ``UntrustedSegment`` (a ``PermissionError``) if the segment
        belongs to another user or its mode lets others write it.  Why: a
        consumer unpickles every record that is not one plain array (what
        ``put`` makes of a dict, tuple, list, scalar, tensor, ndarray
        subclass, or a non-contiguous array), and a pickle can run any code
        as the consumer.  Whoever can write the segment picks each record's
        kind, so any ``get`` may unpickle: attach only to queues your own
        user created (shmq creates them mode 0600)."""
        return cls._attach(name)

    @classmethod
    def _attach(cls, name, adopt_slot=-1, adopt_from_pid=0):
        name = segment.check_name(name)  # before any system call sees it
        fd, size, head = segment.open_existing(name)
        try:
            ring = _core.Ring.attach(fd, size, head, name, adopt_slot, adopt_from_pid)
        finally:
            os.close(fd)
        q = cls.__new__(cls)
        q._fd = None
        q._setup(ring, name, creator_pid=None)
        return q

    @classmethod
    def _attach_fd(cls, fd, adopt_slot, adopt_from_pid):
        """An anonymous queue kept by keep_fd=True, in a process started
        with its descriptor (see __reduce__)."""
        size = os.fstat(fd).st_size
        ring = _core.Ring.attach(fd, size, os.pread(fd, _core.HEADER_BYTES, 0),
                                 f"anonymous queue of pid {adopt_from_pid}", adopt_slot,
                                 adopt_from_pid)
        q = cls.__new__(cls)
        q._fd = None  # (the descriptor is the starter's to give: it stays open here)
        q._setup(ring, None, creator_pid=None)
        return q

    def _setup(self, ring, name, creator_pid):
        # Everything __del__ reads before the ring: a KeyboardInterrupt here
        # leaves either a handle __del__ can close, or none (the Ring closes
        # its slot when dropped).
        self._site = _creation_site()
        self._name = name
        self._creator_pid = creator_pid
        self._pid = os.getpid()
        self._ring = ring
        _core.register_handle(self)  # for the fork and exit hooks

    # --- data -------------------------------------------------------------

    def put(self, obj, timeout: float | None = None) -> None:
        """Copy ``obj`` into the ring (arrays once, never pickled).

        ``obj`` is an array, or a tuple/list/dict tree of arrays and small
        values (int, float, str, bytes, None...).  Blocks up to ``timeout``
        seconds for room (None: until room, or the consumer is gone); raises
        ``Full`` on timeout, ``Closed``/``PeerLost`` if the consumer closed or
        died, ``MessageTooLarge`` if it can never fit, ``TypeError`` for
        object arrays.  Non-contiguous arrays are copied contiguous first."""
        self._ring.put(obj, _check_timeout(timeout))

    def put_nowait(self, obj) -> None:
        """``put(obj, timeout=0)``: raises ``Full`` at once if there is no room."""
        self._ring.put(obj, 0)

    def put_encoded(self, pickled: bytes, buffers: list, timeout: float | None = None) -> None:
        """``put`` of a message already encoded by ``shmq.codec.encode(obj)``
        (the pickle stream and its out-of-band buffers): for a caller that
        looks at a message's size before choosing how to send it.  The
        consumer gets ``obj`` as from ``put(obj)``."""
        self._ring.put_tree(pickled, buffers, _check_timeout(timeout))

    def get(self, timeout: float | None = None):
        """Remove and return the next message, copied out of the ring (safe
        to keep).  Raises ``Empty`` on timeout, ``Closed`` when every producer
        closed and the ring is drained, ``PeerLost`` when producers died."""
        return self._ring.get(_check_timeout(timeout))

    def get_nowait(self):
        """``get(timeout=0)``: raises ``Empty`` at once if nothing is there."""
        return self._ring.get(0)

    def get_view(self, timeout: float | None = None) -> MessageView:
        """Zero-copy get: ``with q.get_view() as msg:``.  Arrays in ``msg``
        view ring memory until the block ends; copy what you keep."""
        return MessageView(self._ring, _check_timeout(timeout))

    def reserve(self, shape, dtype, timeout: float | None = None) -> Reservation:
        """Zero-copy put: ``with q.reserve((3, 64), np.float32) as arr:`` fill
        ``arr`` in place; it is sent when the block ends (dropped if the block
        raises)."""
        if isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(d) for d in shape)
        return Reservation(self._ring, shape, np.dtype(dtype), _check_timeout(timeout))

    # --- description --------------------------------------------------------

    @property
    def name(self) -> str | None:
        """The segment name; pass it to ``Queue.attach``.  None for an
        anonymous queue."""
        return self._name

    @property
    def fd(self) -> int | None:
        """The memfd of an anonymous queue made with keep_fd=True, until
        close(); None otherwise."""
        return self._fd

    @property
    def capacity_bytes(self) -> int:
        return self._ring.capacity_bytes

    @property
    def multi_producer(self) -> bool:
        return self._ring.multi_producer

    @property
    def closed(self) -> bool:
        return self._ring.closed

    def stats(self) -> dict:
        """Shared counters: positions, bytes in use, closed/dead producers,
        records dropped because their producer died mid-write."""
        return self._ring.stats()

    def __repr__(self):
        state = "closed" if self.closed else "open"
        kind = "multi-producer" if self.multi_producer else "single-producer"
        label = "anonymous" if self._name is None else repr(self._name)
        return f"<shmq.Queue {label} {kind} {self.capacity_bytes} bytes {state}>"

    # --- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """End this handle.  A producer's close lets the consumer drain and
        then see ``Closed``; the consumer's close makes producers' ``put``
        raise ``Closed``.  The creating process also unlinks the name."""
        self._ring.close()
        _core.forget_handle(self)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._creator_pid == os.getpid():
            self._creator_pid = None
            segment.unlink(self._name)

    def unlink(self) -> None:
        """Remove the name from /dev/shm now.  Handles already open keep
        working; ``attach`` by name no longer does.  Only the creator may.
        An anonymous queue has no name: nothing to do."""
        if self._name is None:
            return
        if self._creator_pid != os.getpid():
            raise PermissionError(
                f"only the handle that created {self._name!r} unlinks it (this handle in pid "
                f"{os.getpid()} attached to it, or inherited it by fork)")
        segment.unlink(self._name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        ring = getattr(self, "_ring", None)
        if ring is None or ring.closed or self._pid != os.getpid():
            return
        warnings.warn(f"unclosed shmq.Queue {self._ring.name!r} created at {self._site}",
                      ResourceWarning, source=self)
        self.close()

    def __reduce__(self):
        # Sending a queue to another process (spawn, forkserver) attaches to
        # it by name there.  A slot is reserved for that process now, so it
        # counts as a producer before it has even started: otherwise a fast
        # producer that closes could end the stream before a slow one attaches.
        if self._name is None and self._fd is not None:
            slot = self._ring.reserve_pending_slot()
            return (Queue._attach_fd, (self._fd, slot, os.getpid()))
        if self._name is None:
            raise TypeError(
                f"an anonymous shmq.Queue cannot be sent to another process: only processes "
                f"forked while it is open share it; create it with anonymous=False to pass it "
                f"to a spawned process ({self._ring.name})")
        slot = self._ring.reserve_pending_slot()
        return (Queue._attach, (self._name, slot, os.getpid()))


def _close_at_multiprocessing_exit(_marker):
    # multiprocessing children end with os._exit, which skips atexit; their
    # exit path runs multiprocessing's finalizers instead.  The registration
    # must happen in an after-fork callback of multiprocessing's own, which
    # runs after the child's _bootstrap clears the inherited finalizers.
    multiprocessing.util.Finalize(None, _close_all, exitpriority=0)


def _close_all():
    for q in _core.open_handles():
        try:
            q.close()
        except Exception:
            pass  # interpreter teardown: nothing useful to do with an error


class _MultiprocessingHook:
    """Keeps the register_after_fork entry alive (it is held weakly)."""


_mp_hook = _MultiprocessingHook()
multiprocessing.util.register_after_fork(_mp_hook, _close_at_multiprocessing_exit)
# Compiled hooks: see _fork.pxi for why they must not be Python code.
os.register_at_fork(before=_core.before_fork, after_in_parent=_core.after_fork_in_parent,
                    after_in_child=_core.after_fork_in_child)
atexit.register(_close_all)
