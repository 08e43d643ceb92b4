"""Self-checking messages for multiprocess tests.

A message from producer ``p`` with sequence number ``s`` and payload size
``n`` is a uint8 array whose first 16 bytes are (p, s, crc32 of the rest,
n) and whose rest is a slice of a fixed random pool chosen by (p, s).  The
consumer recomputes everything from the header alone, so a torn, duplicated,
reordered or foreign record is caught exactly.  Payloads shorter than the
header travel as a (p, s, array) tuple, exercising the tree path.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

HEADER = struct.Struct("<IIII")
_POOL = np.random.default_rng(20261122).integers(0, 256, 2 << 20, dtype=np.uint8)


def _body(p: int, s: int, n: int) -> np.ndarray:
    start = (p * 1_000_003 + s * 7_919) % (_POOL.size - n) if n < _POOL.size else 0
    return _POOL[start:start + n]


def make(p: int, s: int, n: int):
    if n < HEADER.size:
        return (p, s, _body(p, s, n).copy())
    msg = np.empty(n, np.uint8)
    body = _body(p, s, n - HEADER.size)
    msg[HEADER.size:] = body
    msg[:HEADER.size] = np.frombuffer(HEADER.pack(p, s, zlib.crc32(body), n), np.uint8)
    return msg


def check(msg) -> tuple[int, int]:
    """(producer, seq) of a valid message; AssertionError otherwise."""
    if isinstance(msg, tuple):
        p, s, arr = msg
        assert arr.dtype == np.uint8 and arr.size < HEADER.size, f"bad short message {msg!r}"
        assert np.array_equal(arr, _body(p, s, arr.size)), f"short payload of ({p}, {s}) differs"
        return p, s
    assert isinstance(msg, np.ndarray) and msg.dtype == np.uint8, f"unexpected message {type(msg)}"
    p, s, crc, n = HEADER.unpack(msg[:HEADER.size].tobytes())
    assert n == msg.size, f"({p}, {s}): header says {n} bytes, got {msg.size}"
    assert zlib.crc32(msg[HEADER.size:]) == crc, f"({p}, {s}): checksum mismatch (torn record)"
    assert np.array_equal(msg[HEADER.size:], _body(p, s, n - HEADER.size)), f"({p}, {s}): body differs"
    return p, s


def sizes(seed: int, count: int, max_bytes: int) -> np.ndarray:
    """Message sizes: mostly small, some medium, a few up to max_bytes."""
    rng = np.random.default_rng(seed)
    kind = rng.random(count)
    small = rng.integers(0, 257, count)
    medium = rng.integers(257, max(258, min(65536, max_bytes)), count)
    large = rng.integers(1, max_bytes + 1, count)
    return np.where(kind < 0.90, small, np.where(kind < 0.99, medium, large)).clip(0, max_bytes)


class Tally:
    """Consumer-side bookkeeping: exactly once, in order per producer."""

    def __init__(self, producers: int):
        self.next_seq = [0] * producers

    def add(self, msg):
        p, s = check(msg)
        assert 0 <= p < len(self.next_seq), f"unknown producer {p}"
        assert s == self.next_seq[p], f"producer {p}: expected seq {self.next_seq[p]}, got {s}"
        self.next_seq[p] = s + 1
