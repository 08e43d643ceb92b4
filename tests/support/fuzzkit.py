"""Pieces of the fuzz tier (tests/shmq_layer/test_fuzz.py): messages, a map of a
segment's fields, corruptions, and the bodies of the forked children.

Corruptions are written with pwrite into /dev/shm/<name>, the same pages
every process maps, so a consumer that is already attached sees them at
once (live) or the next process attaches to them (stopped).  Every
choice comes from a random.Random seeded per iteration, so a failing
iteration can be replayed from its seed (live timing aside).

A child reports over a pipe and then returns normally: exit code 0.  A
signal (negative exit code), a child still running at the deadline, an
exception that is not a shmq.ShmqError, or a consumer whose peak RSS grew
more than the bound is a failure of the run.
"""

from __future__ import annotations

import os
import random
import resource
import struct
import time
import traceback

import numpy as np

import payload
import shmq
from shmq import _core, segment

L = _core.layout_offsets()
REC = L["record_header_bytes"]
AM = L["array_meta_bytes"]
SLOT = L["slot_bytes"]
MAX_ATTACH = 256
KIND_ARRAY, KIND_TREE = 1, 2

# --- messages ---------------------------------------------------------------

DTYPES = ["u1", "<i2", ">i4", "<f8", "<c8", "?", "S5", "<U3", "<M8[us]", "V3"]


def message(rng: random.Random, capacity: int):
    """A message of one of the shapes shmq carries (fast-path arrays, trees
    with arrays and extras, structured/masked/0-d arrays), small enough that
    a few fit the ring."""
    kind = rng.randrange(8)
    n = rng.choice([0, 1, 7, 64, 300, capacity // 8])
    if kind == 0:  # fast path, any plain dtype and shape
        dt = np.dtype(rng.choice(DTYPES))
        count = max(0, n // dt.itemsize)
        raw = np.frombuffer(rng.randbytes(count * dt.itemsize), np.uint8)
        return raw.view(dt).reshape(rng.choice([(count,), (1, count), (count, 1, 1)]))
    if kind == 1:
        return np.array(rng.randrange(1 << 30))  # 0-d
    if kind == 2:  # a loader-like record: named fields, small extras
        return (rng.randrange(1000), "sample-%d" % rng.randrange(99),
                np.frombuffer(rng.randbytes(n), np.uint8), [1.5, None, b"raw", (True, -3)])
    if kind == 3:
        return {"x": np.arange(n // 8, dtype="<f8").reshape(-1, 1), "y": rng.random(),
                "z": {"deep": [np.float32(2.5), np.zeros((2, 0))]}}
    if kind == 4:
        return np.zeros(max(1, n // 16), dtype=[("a", "<i4"), ("t", "<M8[s]"), ("b", "S4")])
    if kind == 5:
        return np.ma.MaskedArray(np.arange(max(1, n // 8), dtype="<i8"),
                                 mask=[rng.random() < 0.3 for _ in range(max(1, n // 8))])
    if kind == 6:
        return [np.arange(3), "x" * rng.randrange(200), {i: i * i for i in range(rng.randrange(20))}]
    return np.asfortranarray(np.arange(max(1, n // 8), dtype="<i8").reshape(-1, 1).repeat(2, 1))


def same(a, b) -> bool:
    """Exact equality of what went in and what came out."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ma.MaskedArray):
        return (a.dtype == b.dtype and a.shape == b.shape
                and np.ma.getdata(a).tobytes() == np.ma.getdata(b).tobytes()
                and np.ma.getmaskarray(a).tobytes() == np.ma.getmaskarray(b).tobytes())
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def touch(obj) -> int:
    """Read every byte of every array in obj (a view of ring memory must
    be inside the mapping: reading it all would fault otherwise)."""
    if isinstance(obj, np.ndarray):
        return int(np.frombuffer(np.ascontiguousarray(obj).tobytes(), np.uint8).sum())
    if isinstance(obj, dict):
        return sum(touch(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(touch(v) for v in obj)
    return 0


# --- the segment, as bytes in a file -----------------------------------------

class Segment:
    """Reads and writes fields of a live segment through its file."""

    def __init__(self, name: str, capacity: int, mpsc: bool):
        self.fd = os.open(segment.SHM_DIR + name, os.O_RDWR)
        self.capacity = capacity
        self.mpsc = mpsc
        self.size = os.fstat(self.fd).st_size
        self.data_offset = self.size - capacity
        self.slots_offset = self.u64(L["slots_offset"])
        self.avail_offset = self.u64(L["avail_offset"])

    def close(self):
        os.close(self.fd)

    def read(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def write(self, offset: int, data: bytes):
        os.pwrite(self.fd, data, offset)

    def u64(self, offset: int) -> int:
        return struct.unpack("<Q", self.read(offset, 8))[0]

    # The data region is mapped twice back to back: a record's byte k is at
    # file offset data_offset + ((pos + k) mod capacity).
    def data_read(self, pos: int, n: int) -> bytes:
        out = b""
        while n > 0:
            i = pos % self.capacity
            chunk = self.read(self.data_offset + i, min(n, self.capacity - i))
            out, pos, n = out + chunk, pos + len(chunk), n - len(chunk)
        return out

    def data_write(self, pos: int, data: bytes):
        while data:
            i = pos % self.capacity
            k = min(len(data), self.capacity - i)
            self.write(self.data_offset + i, data[:k])
            data, pos = data[k:], pos + k

    def records(self, limit: int = 64) -> list[dict]:
        """The records between head and tail as their headers say (may be
        garbage once corrupted: bounded, and only used to aim)."""
        head, tail = self.u64(L["head_pos"]), self.u64(L["tail_pos"])
        out, pos = [], head
        while pos < tail and len(out) < limit and tail - head <= self.capacity:
            n, kind, nbuf, meta = struct.unpack("<QIIQ", self.data_read(pos, 24))
            out.append({"pos": pos, "bytes": n, "kind": kind, "nbuf": nbuf, "meta": meta})
            if n < 64 or n % 64 or n > tail - pos:
                break
            pos += n
        return out


# --- corruptions ----------------------------------------------------------------

HEADER_FIELDS = [(f, "<Q") for f in ("magic", "capacity_bytes", "data_offset", "slots_offset",
                                     "avail_offset", "creator_starttime", "tail_pos", "head_pos",
                                     "space_wanted")] + \
                [(f, "<I") for f in ("version", "flags", "max_attach", "creator_pid", "data_seq",
                                     "consumer_waiting", "space_seq", "closed_writers",
                                     "gone_writers", "skipped_records")] + \
                [(f, "<i") for f in ("consumer_slot", "producer_slot")]
SLOT_FIELDS = [("slot.owner", "<Q"), ("slot.starttime", "<Q"), ("slot.claim_pos", "<Q"),
               ("slot.claim_bytes", "<Q"), ("slot.pending_since_ns", "<Q")]


def value_for(rng: random.Random, fmt: str, current: int, capacity: int, positions=()) -> int:
    """A hostile value for a field: boundaries, near misses of the current
    value and of the ring's positions, bit flips, or anything."""
    bits = {"<Q": 64, "<I": 32, "<i": 32, "<H": 16, "<B": 8}[fmt]
    pick = rng.randrange(9)
    if pick == 0:
        v = rng.choice([0, 1, 63, 64, 65, capacity - 64, capacity, capacity + 64, 2 ** 31 - 1,
                        2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1])
    elif pick == 1:
        v = current + rng.choice([-1, 1]) * 64 * rng.choice([1, 2, 7, capacity // 64, capacity // 32])
    elif pick == 2:
        v = current ^ (1 << rng.randrange(bits))
    elif pick == 3 and positions:
        v = rng.choice(positions) + rng.choice([-128, -64, 0, 8, 64, capacity, -capacity])
    elif pick == 4:
        v = rng.choice([-1, -2, 255, 256, 1000])
    else:
        v = rng.getrandbits(bits)
    if fmt == "<i":
        v = (v + 2 ** 31) % 2 ** 32 - 2 ** 31
    else:
        v %= 2 ** bits
    return v


def capacity_delta(rng: random.Random, cap: int) -> int:
    return rng.choice([cap, cap + 64, 2 * cap, 1 << 40])


# A few streams that are small and dangerous if unpickled as they are.
BOMBS = [
    b"r" + struct.pack("<I", 0x40000000),           # LONG_BINPUT: a 16 GiB memo
    b"q\xff",                                        # BINPUT
    b"\x8d" + struct.pack("<Q", 1 << 40),           # BINUNICODE8 of 1 TiB
    b"\x96" + struct.pack("<Q", 1 << 40),           # BYTEARRAY8
    b"\x95" + struct.pack("<Q", 1 << 40),           # FRAME
    b"\x8b" + struct.pack("<I", 0x7FFFFFFF),        # LONG4
    b"j" + struct.pack("<I", 0xFFFFFFF0),           # LONG_BINGET
    b"(" * 64,                                       # MARKs
    b"\x97" * 8,                                     # NEXT_BUFFER past the table
    b".",                                            # an early STOP
    b"I99999999999999999999\n",                      # text INT
]


def corrupt(rng: random.Random, seg: Segment) -> str:
    """Apply one corruption; returns what it did (for the failure report)."""
    cap = seg.capacity
    head, tail = seg.u64(L["head_pos"]), seg.u64(L["tail_pos"])
    positions = (head, tail)
    recs = seg.records()
    target = rng.choices(["header", "positions", "slot", "avail", "record", "array", "tree",
                          "pickle", "bytes", "moved head"],
                         weights=[3, 3, 2, 2, 3, 3, 3, 4, 2, 2])[0]
    if target == "avail" and not seg.mpsc:
        target = "positions"
    if target in ("record", "array", "tree", "pickle") and not recs:
        target = "header"

    def poke(offset: int, fmt: str, what: str) -> str:
        size = struct.calcsize(fmt)
        cur = struct.unpack(fmt, seg.read(offset, size))[0]
        v = value_for(rng, fmt, cur, cap, positions)
        seg.write(offset, struct.pack(fmt, v))
        return f"{what} {cur} -> {v}"

    def poke_data(pos: int, fmt: str, what: str) -> str:
        size = struct.calcsize(fmt)
        cur = struct.unpack(fmt, seg.data_read(pos, size))[0]
        v = value_for(rng, fmt, cur, cap, positions)
        seg.data_write(pos, struct.pack(fmt, v))
        return f"{what} {cur} -> {v}"

    if target == "header":
        field, fmt = rng.choice(HEADER_FIELDS)
        return poke(L[field], fmt, field)
    if target == "positions":
        field = rng.choice(["head_pos", "tail_pos"])
        return poke(L[field], "<Q", field)
    if target == "moved head":
        # repro_shmq_live_header_segv.py, generalised: head (or tail) moved
        # to where it is inconsistent, and a record there that claims to be
        # huge, so that trusting the positions would read past the mapping.
        field = rng.choice(["head_pos", "tail_pos"])
        other = tail if field == "head_pos" else head
        new = (other + rng.choice([64, 128, capacity_delta(rng, cap), -capacity_delta(rng, cap)])) % 2 ** 64
        seg.write(L[field], struct.pack("<Q", new))
        at = new if field == "head_pos" else head
        n = rng.choice([1 << 30, 2 * cap, cap + 64, 2 ** 63, 2 ** 64 - 64])
        seg.data_write(at, struct.pack("<QIIQII", n, KIND_ARRAY, 1, AM + 16, 0, 0)
                       + struct.pack("<IIQQ", 1, 3, 128, n - 128) + struct.pack("<Q", n - 128) + b"|u1")
        return f"{field} -> {new} with a {n}-byte record at {at}"
    if target == "slot":
        i = rng.choice([rng.randrange(MAX_ATTACH)] + list(range(4)))
        field, fmt = rng.choice(SLOT_FIELDS)
        return poke(seg.slots_offset + i * SLOT + L[field], fmt, f"slot {i} {field}")
    if target == "avail":
        k = (head % cap) // 64 if rng.random() < 0.6 else rng.randrange(cap // 64)
        return poke(seg.avail_offset + 4 * k, "<I", f"avail[{k}]")
    if target == "bytes" or not recs:
        return _random_bytes(rng, seg)
    rec = rng.choice(recs)
    pos = rec["pos"]
    if target == "record":
        field, fmt = rng.choice([("record.record_bytes", "<Q"), ("record.kind", "<I"),
                                 ("record.nbuffers", "<I"), ("record.meta_bytes", "<Q"),
                                 ("record.producer_pid", "<I")])
        return poke_data(pos + L[field], fmt, f"record@{pos} {field}")
    if target == "array" and rec["kind"] == KIND_ARRAY:
        ndim = struct.unpack("<I", seg.data_read(pos + REC, 4))[0] % 33
        choices = [(REC + L["array.ndim"], "<I", "ndim"), (REC + L["array.dtype_chars"], "<I", "dtype_chars"),
                   (REC + L["array.data_offset"], "<Q", "data_offset"),
                   (REC + L["array.data_bytes"], "<Q", "data_bytes")]
        choices += [(REC + AM + 8 * d, "<Q", f"shape[{d}]") for d in range(ndim)]
        choices += [(REC + AM + 8 * ndim + c, "<B", f"dtype char {c}") for c in range(4)]
        off, fmt, what = rng.choice(choices)
        return poke_data(pos + off, fmt, f"array@{pos} {what}")
    if target in ("array", "tree") and rec["kind"] == KIND_TREE:
        nbuf = min(rec["nbuf"], 8)
        choices = [(REC + L["tree.pickle_offset"], "<Q", "pickle_offset"),
                   (REC + L["tree.pickle_bytes"], "<Q", "pickle_bytes"), (12, "<I", "nbuffers")]
        for b in range(nbuf):
            at = REC + L["tree_meta_bytes"] + b * L["buffer_entry_bytes"]
            choices += [(at, "<Q", f"buffer {b} offset"), (at + 8, "<Q", f"buffer {b} nbytes")]
        off, fmt, what = rng.choice(choices)
        return poke_data(pos + off, fmt, f"tree@{pos} {what}")
    if target == "pickle" and rec["kind"] == KIND_TREE:
        poff, plen = struct.unpack("<QQ", seg.data_read(pos + REC, 16))
        if poff < rec["bytes"] and 2 < plen <= rec["bytes"] - poff:
            at = pos + poff + rng.randrange(plen)
            how = rng.randrange(3)
            if how == 0:
                k = rng.randrange(1, 5)
                seg.data_write(at, rng.randbytes(k))
                return f"pickle@{pos} {k} random bytes at +{at - pos - poff}"
            if how == 1:
                seg.data_write(at, bytes([rng.randrange(256)]))
                return f"pickle@{pos} one byte at +{at - pos - poff}"
            bomb = rng.choice(BOMBS)
            seg.data_write(at, bomb[: max(1, plen - (at - pos - poff))])
            return f"pickle@{pos} {bomb[:8]!r} at +{at - pos - poff}"
    return _random_bytes(rng, seg)  # the record was not of the kind the target needs


def _random_bytes(rng: random.Random, seg: Segment) -> str:
    """1-16 random bytes anywhere: header, slots, avail tags or data."""
    where = rng.randrange(seg.size - 16)
    k = rng.randrange(1, 17)
    seg.write(where, rng.randbytes(k))
    return f"{k} random bytes at file offset {where}"


# --- children ------------------------------------------------------------------

RSS_BOUND_KIB = 16 << 10  # peak RSS growth allowed in a consumer run (records <= 64 KiB)


def _limit_address_space():
    # A runaway allocation must fail in this child, not take the machine
    # with it; a MemoryError it causes is reported as a failure below.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = (vm << 10) + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _caused_by_memory_error(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, MemoryError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def live_id(msg):
    """(producer, seq) of an intact message from produce(); AssertionError
    if its contents were altered."""
    if isinstance(msg, dict):
        p, s = payload.check(msg["data"])
        assert (msg["p"], msg["s"]) == (p, s) and msg["extra"] == [1.5, None, b"raw"]
        return p, s
    return payload.check(msg)


def consume(q, name, attach, use_view, max_gets, seconds, timeout, expected, conn):
    """The consumer: get (or get_view) until max_gets, the time budget, or a
    run of errors; every get bounded by timeout.  Reports outcome counts,
    failures (non-shmq exceptions, wrong contents in a control run) and
    peak RSS growth.  expected: the messages of an uncorrupted stopped run,
    "live" for an uncorrupted live run (intact and in order per producer),
    or None."""
    report = {"outcomes": {}, "failures": [], "delivered": 0, "rss_kib": 0}
    last_seq = {}
    try:
        _limit_address_space()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        deadline = time.monotonic() + seconds
        handle = None
        try:
            handle = shmq.Queue.attach(name) if attach else q
        except shmq.ShmqError as e:
            report["outcomes"]["attach:" + type(e).__name__] = 1
        streak = 0
        for i in range(max_gets if handle is not None else 0):
            if time.monotonic() > deadline or streak >= 6:
                break
            try:
                if use_view:
                    with handle.get_view(timeout=timeout) as v:
                        touch(v)
                        got = _copy(v)
                else:
                    got = handle.get(timeout=timeout)
                    touch(got)
                report["delivered"] += 1
                key, streak = "message", 0
                if expected == "live":
                    try:
                        p, seq = live_id(got)
                        if seq <= last_seq.get(p, -1):
                            report["failures"].append(f"control run: producer {p} seq {seq} "
                                                      f"after {last_seq[p]}")
                        last_seq[p] = seq
                    except AssertionError as e:
                        report["failures"].append(f"control run: altered message: {e}")
                elif expected is not None:
                    if i >= len(expected) or not same(expected[i], got):
                        report["failures"].append(f"control run: message {i} differs: {got!r:.200}")
            except shmq.ShmqError as e:
                key, streak = type(e).__name__, streak + 1
                if _caused_by_memory_error(e):
                    report["failures"].append(f"MemoryError inside {key}: {e}")
            except Exception as e:  # noqa: BLE001 - anything else is the failure we look for
                key, streak = "untyped:" + type(e).__name__, streak + 1
                report["failures"].append(traceback.format_exc(limit=6))
            report["outcomes"][key] = report["outcomes"].get(key, 0) + 1
        if isinstance(expected, list) and report["delivered"] != len(expected):
            report["failures"].append(f"control run: {report['delivered']} of {len(expected)} delivered")
        report["rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        if report["rss_kib"] > RSS_BOUND_KIB:
            report["failures"].append(f"peak RSS grew by {report['rss_kib']} KiB")
        if handle is not None and attach:
            handle.close()
    except BaseException:  # noqa: BLE001 - report it instead of dying silently
        report["failures"].append("consumer harness: " + traceback.format_exc(limit=8))
    conn.send(report)


def _copy(obj):
    if isinstance(obj, np.ma.MaskedArray):
        return obj.copy()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy(v) for v in obj)
    return obj


def produce(q, producer, seconds, capacity, seed, conn):
    """A live producer: self-checking payloads and trees, each put bounded."""
    report = {"outcomes": {}, "failures": [], "delivered": 0, "rss_kib": 0}
    try:
        rng = random.Random(seed)
        deadline = time.monotonic() + seconds
        s = 0
        streak = 0
        while time.monotonic() < deadline and streak < 20:
            n = rng.choice([8, 100, 700, capacity // 6])
            msg = payload.make(producer, s, n)
            if rng.random() < 0.4:
                msg = {"p": producer, "s": s, "data": msg, "label": "x" * rng.randrange(50),
                       "extra": [1.5, None, b"raw"]}
            try:
                q.put(msg, timeout=0.05)
                key, streak, s = "put", 0, s + 1
            except shmq.ShmqError as e:
                key, streak = type(e).__name__, streak + 1
            except Exception as e:  # noqa: BLE001
                key, streak = "untyped:" + type(e).__name__, streak + 1
                report["failures"].append(traceback.format_exc(limit=6))
            report["outcomes"][key] = report["outcomes"].get(key, 0) + 1
        q.close()
    except BaseException:  # noqa: BLE001
        report["failures"].append("producer harness: " + traceback.format_exc(limit=8))
    conn.send(report)
