"""Zero-copy blocks: ``get_view`` (read ring memory in place) and
``reserve`` (write a message in place, then commit).

Both hold one record of the ring for the duration of the ``with`` block.
The arrays they hand out point into ring memory: after the block ends the
memory belongs to the ring again and later messages will overwrite it, so
copy (``arr.copy()``) anything you keep.  The memory stays mapped as long as
an array refers to it, so a late read returns stale data, never a crash.
"""

from __future__ import annotations

__all__ = ["MessageView", "Reservation"]


class MessageView:
    """Context manager returned by ``Queue.get_view``; ``__enter__`` waits for
    the next message and returns it with its arrays viewing the ring."""

    __slots__ = ("_ring", "_timeout", "_entered")

    def __init__(self, ring, timeout):
        self._ring = ring
        self._timeout = timeout
        self._entered = False

    def __enter__(self):
        if self._entered:
            raise RuntimeError("a get_view() block can be entered once; call get_view() again")
        self._entered = True
        return self._ring.get_view(self._timeout)

    def __exit__(self, *exc):
        self._ring.release_view()
        return False


class Reservation:
    """Context manager returned by ``Queue.reserve``; ``__enter__`` claims
    ring space and returns a writable array there.  Leaving the block
    normally publishes it; leaving by an exception drops it (the consumer
    never sees a half-written message)."""

    __slots__ = ("_ring", "_shape", "_dtype", "_timeout", "_entered")

    def __init__(self, ring, shape, dtype, timeout):
        self._ring = ring
        self._shape = shape
        self._dtype = dtype
        self._timeout = timeout
        self._entered = False

    def __enter__(self):
        if self._entered:
            raise RuntimeError("a reserve() block can be entered once; call reserve() again")
        self._entered = True
        return self._ring.reserve_array(self._shape, self._dtype, self._timeout)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self._ring.commit_reserved()
        else:
            self._ring.cancel_reserved()
        return False
