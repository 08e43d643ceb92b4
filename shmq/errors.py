"""The exceptions shmq raises.

Every message says what failed, the values involved (pid, sizes, position)
and what to do about it.  ``Full`` and ``Empty`` also subclass the standard
library's ``queue.Full``/``queue.Empty`` so code written for ``queue.Queue``
or ``multiprocessing.Queue`` keeps working.
"""

import queue

__all__ = [
    "ShmqError",
    "Full",
    "Empty",
    "Closed",
    "PeerLost",
    "IncompatibleRing",
    "MessageTooLarge",
    "ShmFull",
    "UntrustedSegment",
]


class ShmqError(Exception):
    """Base class of every error raised by shmq."""


class Full(ShmqError, queue.Full):
    """The ring has no room for the message within the timeout."""


class Empty(ShmqError, queue.Empty):
    """No message arrived within the timeout."""


class Closed(ShmqError):
    """The other side closed: every producer closed (and the ring is
    drained), or the consumer closed."""


class PeerLost(ShmqError):
    """A process on the other side died without closing its handle."""


class IncompatibleRing(ShmqError):
    """A segment is not a shmq ring this version can read (wrong magic,
    version or inconsistent header), or a record in it fails validation."""


class MessageTooLarge(ShmqError, ValueError):
    """A single message needs more bytes than the ring holds."""


class ShmFull(ShmqError, OSError):
    """``/dev/shm`` has no room for the segment."""


class UntrustedSegment(ShmqError, PermissionError):
    """``Queue.attach`` refuses a segment that another user owns, or that
    users other than its owner may write: its records are unpickled by the
    consumer, and a pickle can run any code (NOTE [ Whose segment ] in
    segment.py)."""
