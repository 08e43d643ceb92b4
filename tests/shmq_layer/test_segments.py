"""Segments: hostile or foreign contents (R11), /dev/shm full (R9), stale
names after a crash (R15), and the `python -m shmq` cleaner."""

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest

import shmq
from conftest import segment_pid
from shmq import _core, segment

LAYOUT = _core.layout_offsets()


def fake_segment(contents: bytes, size: int | None = None) -> str:
    name = segment.new_name("test")
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size or len(contents) or 1)
    os.pwrite(shm.fd, contents, 0)
    shm.close_fd()
    return name


def header_of(q) -> bytearray:
    with open(segment.SHM_DIR + q.name, "rb") as f:
        return bytearray(f.read(LAYOUT["header_bytes"]))


def poke(name: str, offset: int, fmt: str, value):
    if fmt == "<Q":
        value %= 1 << 64  # positions computed below zero wrap, as in C
    with open(segment.SHM_DIR + name, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize("field,fmt,value,expect", [
    ("magic", "<Q", 0x1234, "field magic"),
    ("version", "<I", 99, "field version: layout version 99"),
    ("flags", "<I", 0x80, "field flags"),
    ("capacity_bytes", "<Q", 12345, "field capacity_bytes"),
    ("capacity_bytes", "<Q", 1 << 20, "field"),          # power of two but not the file's
    ("data_offset", "<Q", 1 << 40, "field region offsets"),
    ("tail_pos", "<Q", 1 << 50, "field head_pos/tail_pos"),
    ("tail_pos", "<Q", 64 * 3 + 8, "field head_pos/tail_pos"),  # not a record boundary
    ("consumer_slot", "<i", 1 << 20, "field consumer_slot: 1048576 is not -1 or a slot index"),
    ("consumer_slot", "<i", -7, "field consumer_slot: -7"),
    ("producer_slot", "<i", 256, "field producer_slot: 256"),
])
def test_attach_refuses_inconsistent_header(field, fmt, value, expect):
    with shmq.Queue(1 << 16) as q:
        good = header_of(q)
        size = os.stat(segment.SHM_DIR + q.name).st_size
    bad = bytearray(good)
    struct.pack_into(fmt, bad, LAYOUT[field], value)
    name = fake_segment(bytes(bad), size)
    try:
        with pytest.raises(shmq.IncompatibleRing, match=expect):
            shmq.Queue.attach(name)
    finally:
        segment.unlink(name)


@pytest.mark.parametrize("contents,size", [(b"", 1), (b"hello", 100), (b"\xff" * 4096, 4096)])
def test_attach_refuses_foreign_files(contents, size):
    name = fake_segment(contents, size)
    try:
        with pytest.raises(shmq.IncompatibleRing):
            shmq.Queue.attach(name)
    finally:
        segment.unlink(name)


def test_attach_refuses_truncated_file():
    with shmq.Queue(1 << 16) as q:
        good = header_of(q)
    name = fake_segment(bytes(good), len(good) + 4096)
    try:
        with pytest.raises(shmq.IncompatibleRing, match="file size"):
            shmq.Queue.attach(name)
    finally:
        segment.unlink(name)


def corrupt_first_record(q, field, fmt, value):
    data_offset = struct.unpack_from("<Q", header_of(q), LAYOUT["data_offset"])[0]
    head = struct.unpack_from("<Q", header_of(q), LAYOUT["head_pos"])[0]
    poke(q.name, data_offset + (head & (q.capacity_bytes - 1)) + field, fmt, value)


rec = LAYOUT["record_header_bytes"]


@pytest.mark.parametrize("field,fmt,value,expect", [
    (LAYOUT["record.record_bytes"], "<Q", 1 << 40, "record_bytes"),
    (LAYOUT["record.record_bytes"], "<Q", 65, "record_bytes"),
    (LAYOUT["record.kind"], "<I", 77, "unknown kind 77"),
    (LAYOUT["record.meta_bytes"], "<Q", 1 << 62, "meta_bytes"),
    (rec + LAYOUT["array.ndim"], "<I", 1000, "ndim 1000"),
    (rec + LAYOUT["array.dtype_chars"], "<I", 0, "dtype_chars 0"),
    (rec + LAYOUT["array.data_offset"], "<Q", (1 << 63) + 64, "data_offset"),
    (rec + LAYOUT["array.data_bytes"], "<Q", 1 << 62, "data_bytes"),
    (rec + LAYOUT["array_meta_bytes"], "<Q", 1 << 62, "shape"),           # shape[0]
    (rec + LAYOUT["array_meta_bytes"] + 16, "<3s", b"<O8", "dtype code"),  # object dtype
    (rec + LAYOUT["array_meta_bytes"] + 16, "<3s", b"zz9", "unknown dtype code"),
])
def test_malformed_record_is_an_error_not_a_crash(field, fmt, value, expect):
    with shmq.Queue(1 << 16) as q:
        q.put(np.arange(10, dtype="<f8").reshape(2, 5))  # shape (2,5): 16 bytes, then "<f8"
        corrupt_first_record(q, field, fmt, value)
        with pytest.raises(shmq.IncompatibleRing, match=expect):
            q.get(timeout=0)
        if field != LAYOUT["record.record_bytes"]:
            assert_still_usable(q)


def assert_still_usable(q):
    """A record whose length is intact is dropped; the next one arrives."""
    q.put(np.arange(3))
    assert q.get(timeout=0).tolist() == [0, 1, 2]


@pytest.mark.parametrize("field,fmt,value,expect", [
    (LAYOUT["record.nbuffers"], "<I", 1 << 30, "buffer entries"),
    (rec + 8, "<Q", 1 << 62, "pickle_bytes"),     # tree meta: pickle_bytes
    (rec + 16, "<Q", 1 << 62, "buffer 0"),        # first buffer entry: offset
])
def test_malformed_tree_record(field, fmt, value, expect):
    with shmq.Queue(1 << 16) as q:
        q.put({"a": np.ones(3), "b": "text"})
        corrupt_first_record(q, field, fmt, value)
        with pytest.raises(shmq.IncompatibleRing, match=expect):
            q.get(timeout=0)
        assert_still_usable(q)


# --- R11 on a live segment: fields re-checked at every read --------------------

def header_field(q, field, fmt):
    return struct.unpack_from(fmt, header_of(q), LAYOUT[field])[0]


def consume_after_corruption(name, ready, go, results):
    """A consumer that is attached and has read once, then reads again
    after the parent corrupted the segment: it must get a typed error or the
    right message, never a signal."""
    c = shmq.Queue.attach(name)
    try:
        assert c.get(timeout=10).tolist() == [1, 2, 3]
        ready.send(True)
        assert go.poll(20)
        try:
            got = c.get(timeout=1)
            results.send(("message", got.tolist()))
        except shmq.ShmqError as e:
            results.send((type(e).__name__, str(e)))
    finally:
        c.close()


LIVE_HEADER_CASES = {
    # what the repro did: head moved past tail, a 1 GiB record there
    "head past tail": ("head_pos", lambda head, tail, cap: tail + 64, "field head_pos/tail_pos"),
    "tail behind head": ("tail_pos", lambda head, tail, cap: head - 64, "field head_pos/tail_pos"),
    "tail a lap ahead": ("tail_pos", lambda head, tail, cap: head + 2 * cap, "field head_pos/tail_pos"),
    "tail off a record boundary": ("tail_pos", lambda head, tail, cap: tail + 72, "field head_pos/tail_pos"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(LIVE_HEADER_CASES))
@pytest.mark.parametrize("mpsc", [False, True])
def test_live_consumer_rechecks_positions(procs, case, mpsc):
    import multiprocessing as mp

    field, value, expect = LIVE_HEADER_CASES[case]
    with shmq.Queue(4096, multi_producer=mpsc) as q:
        q.put(np.array([1, 2, 3]))
        ready_r, ready_w = mp.Pipe(False)
        go_r, go_w = mp.Pipe(False)
        res_r, res_w = mp.Pipe(False)
        child = procs.fork(consume_after_corruption, q.name, ready_w, go_r, res_w)
        assert ready_r.poll(10) and ready_r.recv()
        q.put(np.arange(100, dtype=np.uint8))  # a real record after the read one
        head, tail = header_field(q, "head_pos", "<Q"), header_field(q, "tail_pos", "<Q")
        bad = value(head, tail, q.capacity_bytes)
        poke(q.name, LAYOUT[field], "<Q", bad)
        # and at the bad head, a record that claims 1 GiB (as in the repro)
        data_offset = header_field(q, "data_offset", "<Q")
        poke(q.name, data_offset + (bad & (q.capacity_bytes - 1)), "<Q", 1 << 30)
        go_w.send(True)
        assert res_r.poll(10), "the consumer neither returned nor raised"
        kind, text = res_r.recv()
        child.join(10)
        assert child.exitcode == 0, f"consumer ended with {child.exitcode} (negative: a signal)"
        assert kind == "IncompatibleRing" and expect in text, (kind, text)
        assert "recreate the queue" in text


def produce_after_corruption(name, ready, go, results, size):
    p = shmq.Queue.attach(name)
    try:
        p.put(np.zeros(8, np.uint8))
        ready.send(True)
        assert go.poll(20)
        try:
            for _ in range(3):
                p.put(np.zeros(size, np.uint8), timeout=0.5)
            results.send(("put", ""))
        except shmq.ShmqError as e:
            results.send((type(e).__name__, str(e)))
    finally:
        p.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field,value,expect", [
    ("head_pos", lambda head, tail, cap: tail + 4096, "field head_pos/tail_pos"),
    ("head_pos", lambda head, tail, cap: tail - 2 * cap, "field head_pos/tail_pos"),
    ("tail_pos", lambda head, tail, cap: head - 128, "field head_pos/tail_pos"),
    ("consumer_slot", lambda head, tail, cap: 1 << 20, "field consumer_slot: 1048576"),
])
@pytest.mark.parametrize("mpsc", [False, True])
def test_live_producer_rechecks_positions_and_consumer_slot(procs, field, value, expect, mpsc):
    """A producer that finds no room reloads head and reads consumer_slot:
    both are checked before use; it neither writes out of bounds nor waits
    for a slot index past the slot array."""
    import multiprocessing as mp

    with shmq.Queue(4096, multi_producer=mpsc) as q:
        with pytest.raises(shmq.Empty):
            q.get_nowait()  # this handle is the consumer, and never reads
        ready_r, ready_w = mp.Pipe(False)
        go_r, go_w = mp.Pipe(False)
        res_r, res_w = mp.Pipe(False)
        child = procs.fork(produce_after_corruption, q.name, ready_w, go_r, res_w, 1500)
        assert ready_r.poll(10) and ready_r.recv()
        head, tail = header_field(q, "head_pos", "<Q"), header_field(q, "tail_pos", "<Q")
        fmt = "<i" if field == "consumer_slot" else "<Q"
        poke(q.name, LAYOUT[field], fmt, value(head, tail, q.capacity_bytes))
        go_w.send(True)
        assert res_r.poll(10), "the producer neither returned nor raised"
        kind, text = res_r.recv()
        child.join(10)
        assert child.exitcode == 0, f"producer ended with {child.exitcode} (negative: a signal)"
        assert kind == "IncompatibleRing" and expect in text, (kind, text)


@pytest.mark.parametrize("field,fmt,value", [
    ("capacity_bytes", "<Q", 1 << 40),
    ("data_offset", "<Q", 1 << 50),
    ("slots_offset", "<Q", 1 << 50),
    ("avail_offset", "<Q", 1 << 50),
    ("max_attach", "<I", 0xFFFFFFFF),
    ("flags", "<I", 0xFFFFFFFF),
])
@pytest.mark.parametrize("mpsc", [False, True])
def test_geometry_is_read_once_at_attach(field, fmt, value, mpsc):
    """Open handles never read the geometry from the header again, so
    overwriting it changes nothing for them (and a loop over the slots
    stays inside the slot array); a new attach refuses the segment."""
    with shmq.Queue(4096, multi_producer=mpsc) as q:
        p = shmq.Queue.attach(q.name)
        p.put(np.arange(5))
        poke(q.name, LAYOUT[field], fmt, value)
        assert q.get(timeout=1).tolist() == [0, 1, 2, 3, 4]
        p.put(np.arange(6))
        assert q.get(timeout=1).tolist() == list(range(6))
        p.close()  # the consumer scans every slot for live producers next
        with pytest.raises(shmq.Closed):
            q.get(timeout=1)
        with pytest.raises(shmq.IncompatibleRing):
            shmq.Queue.attach(q.name)


def test_role_slot_is_checked_before_use():
    with shmq.Queue(4096) as q:
        p = shmq.Queue.attach(q.name)
        poke(q.name, LAYOUT["producer_slot"], "<i", 1 << 24)
        with pytest.raises(shmq.IncompatibleRing, match="field producer_slot: 16777216"):
            p.put(np.ones(1))
        poke(q.name, LAYOUT["consumer_slot"], "<i", -5)
        with pytest.raises(shmq.IncompatibleRing, match="field consumer_slot: -5"):
            q.get(timeout=0)
        p.close()


def test_shape_with_a_zero_dimension_cannot_hide_an_overflow():
    """numpy refuses shape (0, 2**62) of float64 (the non-zero dimensions
    times the itemsize overflow) even though the array is empty: the
    decoder checks the same, and says so as IncompatibleRing."""
    with shmq.Queue(1 << 16) as q:
        q.put(np.zeros((0, 2), "<f8"))
        corrupt_first_record(q, rec + LAYOUT["array_meta_bytes"] + 8, "<Q", 1 << 62)
        with pytest.raises(shmq.IncompatibleRing, match=r"shape\[1\] = 4611686018427387904"):
            q.get(timeout=0)
        assert_still_usable(q)


def test_dtype_code_numpy_warns_about_is_a_typed_error():
    """'|a3' is a dtype numpy still parses, with a DeprecationWarning (an
    exception under -W error): the decoder refuses it as corrupt either way."""
    with shmq.Queue(1 << 16) as q:
        q.put(np.zeros(3, "|S3"))
        corrupt_first_record(q, rec + LAYOUT["array_meta_bytes"] + 8, "<3s", b"|a3")
        with pytest.raises(shmq.IncompatibleRing, match="dtype code b'\\|a3'"):
            q.get(timeout=0)
        assert_still_usable(q)


# --- tree records: the pickle stream is checked before it is unpickled -------

def rewrite_tree_stream(q, stream: bytes):
    """Replace the pickle stream of the TREE record at head (same record,
    same buffer table) and set pickle_bytes to its length."""
    data_offset = header_field(q, "data_offset", "<Q")
    head = header_field(q, "head_pos", "<Q")
    at = data_offset + (head & (q.capacity_bytes - 1))
    with open(segment.SHM_DIR + q.name, "r+b") as f:
        f.seek(at + rec)
        poff, plen = struct.unpack("<QQ", f.read(16))
        f.seek(at + rec + 8)
        f.write(struct.pack("<Q", len(stream)))
        f.seek(at + poff)
        f.write(stream)


P5 = b"\x80\x05"
BAD_STREAMS = {
    # the repro: LONG_BINPUT 0x08000000 made the unpickler zero a 2 GiB memo
    "memo bomb": (P5 + b"Nr" + struct.pack("<I", 0x08000000) + b".", "opcode 0x72"),
    "protocol 4": (b"\x80\x04N.", "PROTO 5"),
    "no STOP": (P5 + b"NN", "no STOP"),
    "STOP inside": (P5 + b"N.N.", "STOP at byte 3"),
    "text opcode": (P5 + b"I12\n.", "opcode 0x49"),
    "persistent id": (P5 + b"NQ.", "opcode 0x51"),
    "string longer than stream": (P5 + b"\x8d" + struct.pack("<Q", 1 << 40) + b"ab.", "1099511627776-byte"),
    "bytes longer than stream": (P5 + b"B" + struct.pack("<I", 1000) + b"x.", "1000-byte"),
    "frame longer than stream": (P5 + b"\x95" + struct.pack("<Q", 1 << 33) + b"N.", "frame of 8589934592"),
    "negative LONG4": (P5 + b"\x8b" + struct.pack("<I", 0xFFFFFFF0) + b".", "negative length"),
    "truncated argument": (P5 + b"J\x01\x02", "runs past the end"),
    "memo get past memo": (P5 + b"N\x94j" + struct.pack("<I", 5) + b".", "memo index 5"),
    "more buffers than the table": (P5 + b"\x97\x97\x97.", "3 out-of-band buffers used, 1"),
}


@pytest.mark.parametrize("how", ["get", "get_view"])
@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_malformed_pickle_stream_is_refused_before_unpickling(case, how):
    stream, expect = BAD_STREAMS[case]
    with shmq.Queue(1 << 16) as q:
        q.put({"a": np.arange(4), "b": "x" * 40})  # one out-of-band buffer
        rewrite_tree_stream(q, stream)
        t0 = time.monotonic()
        with pytest.raises(shmq.IncompatibleRing) as info:
            if how == "get":
                q.get(timeout=0.05)
            else:
                with q.get_view(timeout=0.05):
                    pass
        assert time.monotonic() - t0 < 0.5
        text = str(info.value)
        assert expect in text and "record at position 0" in text
        assert f"producer pid {os.getpid()}" in text
        assert_still_usable(q)


def get_in_child_and_measure(name, results):
    import resource

    c = shmq.Queue.attach(name)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        c.get(timeout=1)
        results.send(("message", 0))
    except shmq.ShmqError as e:
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        results.send((type(e).__name__, grown))
    finally:
        c.close()


@pytest.mark.timeout(30)
def test_memo_bomb_allocates_nothing_in_the_consumer(procs):
    import multiprocessing as mp

    with shmq.Queue(1 << 16) as q:
        q.put({"a": "x" * 20})
        rewrite_tree_stream(q, BAD_STREAMS["memo bomb"][0])
        res_r, res_w = mp.Pipe(False)
        child = procs.fork(get_in_child_and_measure, q.name, res_w)
        assert res_r.poll(20)
        kind, grown_kib = res_r.recv()
        child.join(10)
        assert child.exitcode == 0
        assert kind == "IncompatibleRing" and grown_kib < 8 << 10, (kind, grown_kib)


@pytest.mark.parametrize("stream,cause", [
    # well-formed, but rebuilding fails: the unpickler's own error becomes
    # the cause of an IncompatibleRing naming the record
    (P5 + b"\x970\x8c\x0bno_such_mod\x94\x8c\x01x\x94\x93\x94.", ModuleNotFoundError),
    (P5 + b"\x970\x8c\x02\xff\xfe\x94.", UnicodeDecodeError),
    (P5 + b"\x97\x85\x94R.", pickle.UnpicklingError),          # REDUCE on a short stack
    (P5 + b"\x8c\x08builtins\x8c\x03int\x93\x8c\x01z\x85R\x97\x86.", ValueError),
])
def test_tree_that_cannot_be_rebuilt_is_incompatible_ring_with_the_cause(stream, cause):
    with shmq.Queue(1 << 16) as q:
        q.put({"a": np.arange(4)})
        rewrite_tree_stream(q, stream)
        with pytest.raises(shmq.IncompatibleRing, match="could not be rebuilt") as info:
            q.get(timeout=0)
        assert isinstance(info.value.__cause__, cause)
        assert "record at position 0" in str(info.value)
        assert_still_usable(q)


def own_entries() -> set[str]:
    """This process's entries in /dev/shm (a name carries its creator's
    pid): another program's come and go meanwhile (R26)."""
    return {e for e in os.listdir(segment.SHM_DIR) if segment_pid(e) == os.getpid()}


def test_shm_full_is_reported_up_front_and_leaves_nothing():
    before = own_entries()
    with pytest.raises(shmq.ShmFull, match=r"--shm-size") as info:
        shmq.Queue(_core.MAX_CAPACITY)
    assert isinstance(info.value, OSError)
    assert own_entries() == before


def test_shm_full_when_reservation_fails(monkeypatch):
    # Past the free-space pre-check (as if another process raced us for the
    # space): posix_fallocate fails and the half-made name is removed.
    monkeypatch.setattr(segment, "free_bytes", lambda: 1 << 62)
    before = own_entries()
    with pytest.raises(shmq.ShmFull, match="--shm-size"):
        shmq.Queue(_core.MAX_CAPACITY)
    assert own_entries() == before


def make_stale_segment() -> str:
    """A queue whose creator was SIGKILLed: nobody unlinked it."""
    code = ("import os, signal, shmq\n"
            "q = shmq.Queue(1 << 16)\n"
            "print(q.name, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    name = out.stdout.strip()
    assert out.returncode == -9 and name.startswith("/shmq-"), out
    return name


class CleanedByAnother(Exception):
    """Another program's `shmq clean` removed our stale segment first."""


def with_a_stale_segment(check, attempts=10):
    """check(stale name) until one attempt is not disturbed by another
    program cleaning stale segments meanwhile (R26: as it should, it
    removes ours too): the check must pass in an undisturbed attempt."""
    for _ in range(attempts):
        stale = make_stale_segment()
        try:
            return check(stale)
        except CleanedByAnother:
            continue
    pytest.fail(f"another program removed our stale segment in all {attempts} attempts")


def gone_meanwhile(stale: str) -> bool:
    return not os.path.exists(segment.SHM_DIR + stale)


def test_stale_segments_are_found_and_removed_and_live_ones_kept():
    def check(stale):
        with shmq.Queue(1 << 16) as live:
            infos = {s.name: s for s in segment.list_segments()}
            if stale not in infos and gone_meanwhile(stale):
                raise CleanedByAnother
            assert not infos[stale].alive and infos[live.name].alive
            assert infos[live.name].creator_pid == os.getpid()
            removed = segment.remove_stale().removed
            if stale not in {s.name for s in removed} and gone_meanwhile(stale):
                raise CleanedByAnother
            assert stale in {s.name for s in removed}
            assert live.name not in {s.name for s in removed}
            assert not os.path.exists(segment.SHM_DIR + stale)
            live.put(np.ones(2))  # untouched
            assert live.get(timeout=0).tolist() == [1.0, 1.0]

    with_a_stale_segment(check)


def test_reused_pid_does_not_make_a_segment_look_alive():
    """Header names this (live) pid as creator but a different start time:
    the pid was reused, the creator is gone."""
    with shmq.Queue(1 << 16) as q:
        good = header_of(q)
        size = os.stat(segment.SHM_DIR + q.name).st_size
    bad = bytearray(good)
    struct.pack_into("<Q", bad, LAYOUT["creator_starttime"], 12345)
    name = fake_segment(bytes(bad), size)
    try:
        info = {s.name: s for s in segment.list_segments()}[name]
        assert info.creator_pid == os.getpid() and not info.alive
    finally:
        segment.unlink(name)


# `python -m shmq` as a program, started before the stale segment is made:
# for each name read from stdin it runs list, clean --dry-run and clean and
# prints their outputs as one JSON line.  The three start-ups of a new
# interpreter are not inside the window in which another program's clean
# (R26) can take the segment first: on a loaded machine they took longer
# than that program's period, and every attempt was disturbed.
_CLI_DRIVER = """
import contextlib, io, json, sys
from shmq.__main__ import main

def run(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return {"code": code, "stdout": out.getvalue()}

print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps([run("list"), run("clean", "--dry-run"), run("clean")]), flush=True)
"""


def test_cli_list_and_clean():
    driver = subprocess.Popen([sys.executable, "-c", _CLI_DRIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline() == "ready\n"

        def check(stale):
            driver.stdin.write(stale + "\n")
            driver.stdin.flush()
            listed, dry, cleaned = json.loads(driver.stdout.readline())
            if f"{stale}\t" not in listed["stdout"] and gone_meanwhile(stale):
                raise CleanedByAnother
            assert listed["code"] == 0 and f"{stale}\t" in listed["stdout"]
            assert "stale" in listed["stdout"]
            if f"would remove {stale}" not in dry["stdout"] and gone_meanwhile(stale):
                raise CleanedByAnother
            assert f"would remove {stale}" in dry["stdout"]
            if f"removed {stale}" not in cleaned["stdout"] and gone_meanwhile(stale):
                raise CleanedByAnother
            assert cleaned["code"] == 0 and f"removed {stale}" in cleaned["stdout"]
            assert not os.path.exists(segment.SHM_DIR + stale)

        with_a_stale_segment(check)
    finally:
        driver.stdin.close()
        driver.wait(30)
        driver.stdout.close()


@pytest.mark.timeout(60)
def test_list_and_clean_never_open_a_fifo_or_follow_a_symlink():
    """repro_shmq_list_fifo.py: /dev/shm is world-writable, and a FIFO named
    shmq-* blocked `python -m shmq list` and `clean` forever in open().
    Entries that are not regular files are not segments: not opened, not
    listed, not removed; a symlink is not followed (here to a stale
    segment, which would otherwise be reported and unlinked by its name).
    The stale segment is made again if another program's `clean` (a test
    run beside this one: R26) removed it meanwhile."""
    tag = f"{os.getpid()}-{os.urandom(4).hex()}"
    fifo = os.path.join(segment.SHM_DIR, f"shmq-fifo-{tag}")
    link = os.path.join(segment.SHM_DIR, f"shmq-link-{tag}")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "shmq", *args], capture_output=True,
                              text=True, timeout=30)

    def check(stale):
        os.symlink(segment.SHM_DIR + stale, link)
        try:
            names = {s.name for s in segment.list_segments()}
            if stale not in names and gone_meanwhile(stale):
                raise CleanedByAnother
            assert stale in names and "/" + os.path.basename(fifo) not in names
            assert "/" + os.path.basename(link) not in names
            listed = run("list")
            assert listed.returncode == 0 and "fifo" not in listed.stdout
            assert "link" not in listed.stdout
            cleaned = run("clean")
            if f"removed {stale} " not in cleaned.stdout and gone_meanwhile(stale):
                raise CleanedByAnother
            assert cleaned.returncode == 0 and f"removed {stale} " in cleaned.stdout
            assert "fifo" not in cleaned.stdout and "link" not in cleaned.stdout
            assert os.path.lexists(fifo) and os.path.lexists(link)  # not ours to remove
        finally:
            os.unlink(link)
            if not gone_meanwhile(stale):
                segment.unlink(stale)

    os.mkfifo(fifo)
    try:
        with_a_stale_segment(check)
        with pytest.raises(shmq.IncompatibleRing, match="not a shared-memory segment but a FIFO"):
            shmq.Queue.attach("/" + os.path.basename(fifo))
    finally:
        os.unlink(fifo)


# --- names from outside (issue 15, item 1) -----------------------------------------------

BAD_NAMES = ["/shmq-\x00x", "shmq-\x00x", "shmq-a/b", "//shmq-x", "/shmq-a/b", "/", "/.", "/..",
             ".", "..", "/" + "a" * 256, "a" * 256,
             "/shmq-\u00e9", "/shmq-x\n", "/shmq x", "", "/shmq-\udcff"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_invalid_names_are_refused_before_any_system_call(name, monkeypatch):
    """repro_shmq_attach_nul.py: a NUL byte reached posix_ipc, which
    crashed with SIGSEGV.  Every name is checked against the naming rule
    of shmq_ring.h first: no shm_open, no unlink is even tried."""
    def no_syscall(*a, **k):
        raise AssertionError(f"a system call saw the invalid name {name!r}")
    monkeypatch.setattr(posix_ipc, "SharedMemory", no_syscall)
    monkeypatch.setattr(posix_ipc, "unlink_shared_memory", no_syscall)
    rule = "a shmq name is '/' followed by 1 to 255 characters from A-Z a-z 0-9 . _ - "
    for call in (shmq.Queue.attach, segment.unlink, segment.open_existing):
        with pytest.raises(ValueError) as e:
            call(name)
        assert str(e.value) == f"invalid shmq name {name!r}: {segment.NAME_RULE}"
        assert rule in str(e.value)


def test_attach_of_a_nul_name_raises_in_a_fresh_process():
    """The repro's own form: a new interpreter, nothing imported but shmq."""
    code = ("import shmq\n"
            "try:\n    shmq.Queue.attach('/shmq-\\x00x')\n"
            "except ValueError as e:\n    print('ValueError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out
    assert out.stdout.startswith("ValueError invalid shmq name '/shmq-\\x00x': a shmq name is")


def test_names_that_follow_the_rule_are_accepted():
    assert segment.check_name("/shmq-1-ab.c_D") == "/shmq-1-ab.c_D"
    assert segment.check_name("/" + "a" * 255) == "/" + "a" * 255
    with pytest.raises(TypeError, match="a shmq name must be a str, not bytes"):
        shmq.Queue.attach(b"/shmq-1-x")
    with shmq.Queue(1 << 16) as q:  # every name shmq makes follows it
        assert segment.check_name(q.name) == q.name


@pytest.mark.parametrize("mpsc", [False, True])
def test_a_name_without_its_slash_is_the_same_queue(mpsc):
    """repro_attach_name_without_slash.py: a name as `ls /dev/shm` shows it
    (no leading '/') was a ValueError; it attached before, and
    multiprocessing.shared_memory takes both.  It is the same queue, and
    the handle's name is the full one; a missing queue stays
    FileNotFoundError, with or without the slash."""
    assert segment.check_name("shmq-1-ab") == "/shmq-1-ab"
    assert segment.check_name("/shmq-1-ab") == "/shmq-1-ab"
    with shmq.Queue(1 << 16, multi_producer=mpsc) as q:
        bare = q.name[1:]
        assert os.path.exists(os.path.join(segment.SHM_DIR, bare))
        with shmq.Queue.attach(bare) as p:
            assert p.name == q.name
            p.put(np.arange(5))
            p.put({"a": np.arange(3), "b": "x"})
        assert q.get(timeout=1).tolist() == [0, 1, 2, 3, 4]
        got = q.get(timeout=1)
        assert got["a"].tolist() == [0, 1, 2] and got["b"] == "x"
        with pytest.raises(shmq.Closed):
            q.get(timeout=1)  # the slash-less handle counted as the producer it was
        fd, size, head = segment.open_existing(bare)
        os.close(fd)
        assert size == os.stat(segment.SHM_DIR + q.name).st_size
    missing = f"shmq-no-such-{os.getpid()}-{os.urandom(6).hex()}"
    for name in (missing, "/" + missing):
        with pytest.raises(FileNotFoundError, match=f"no shmq queue named '/{missing}' in /dev/shm"):
            shmq.Queue.attach(name)
        assert segment.unlink(name) is False


def test_unlink_takes_a_name_without_its_slash():
    q = shmq.Queue(1 << 16)
    try:
        assert segment.unlink(q.name[1:]) is True
        assert not os.path.exists(segment.SHM_DIR + q.name)
        with pytest.raises(FileNotFoundError):
            shmq.Queue.attach(q.name)
    finally:
        q.close()


def test_list_and_clean_skip_dev_shm_entries_whose_names_break_the_rule():
    """Anyone can create files in /dev/shm: an entry named shmq-... with a
    newline, a space or a non-UTF-8 byte holding a stale segment's header
    is not listed, opened or removed, and `list`/`clean` still work."""
    stale = make_stale_segment()
    with open(segment.SHM_DIR + stale, "rb") as f:
        head = f.read()
    tag = f"{os.getpid()}-{os.urandom(4).hex()}"
    odd = [os.fsencode(segment.SHM_DIR) + b"/" + n for n in
           (f"shmq-nl\n{tag}".encode(), f"shmq-sp {tag}".encode(), f"shmq-{tag}-\xff".encode("latin-1"))]
    for path in odd:
        with open(path, "wb") as f:
            f.write(head)
    try:
        listed = {s.name for s in segment.list_segments()}
        assert stale in listed and not any(tag in n for n in listed)
        out = subprocess.run([sys.executable, "-m", "shmq", "clean"], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0 and tag not in out.stdout, out
        assert all(os.path.lexists(p) for p in odd)  # not ours to remove
    finally:
        for path in odd:
            os.unlink(path)
        segment.unlink(stale)


# --- pid namespaces (issue 15, item 2) -----------------------------------------------------

def test_header_records_the_creators_pid_namespace():
    own = os.stat("/proc/self/ns/pid").st_ino
    assert segment.own_pidns() == own
    with shmq.Queue(1 << 16) as q:
        head = header_of(q)
        assert struct.unpack_from("<Q", head, LAYOUT["creator_pidns"])[0] == own
        assert _core.read_creator(bytes(head)) == (os.getpid(), _core.proc_starttime(os.getpid()),
                                                   own)
        info = {s.name: s for s in segment.list_segments()}[q.name]
        assert (info.state, info.pidns, info.alive) == (segment.LIVE, own, True)
        listed = subprocess.run([sys.executable, "-m", "shmq", "list"], capture_output=True,
                                text=True, timeout=30).stdout
        owner = segment.user_name(os.geteuid())
        assert f"{q.name}\t{info.size_bytes}\towner {owner}\tcreator pid {os.getpid()}\t" \
               f"pidns {own}\tlive\n" in listed


@pytest.mark.parametrize("pidns,state", [(1, segment.OTHER_PIDNS), (0, segment.UNRECORDED)])
def test_clean_keeps_a_dead_creator_of_another_or_unrecorded_namespace(pidns, state):
    """A header whose creator pid is dead HERE but was made in another pid
    namespace (or recorded none: an earlier layout) is not provably stale:
    listed as unknown, kept by clean, removed only with --force."""
    stale = make_stale_segment()
    with open(segment.SHM_DIR + stale, "rb") as f:
        head = bytearray(f.read())
    segment.unlink(stale)
    struct.pack_into("<Q", head, LAYOUT["creator_pidns"], pidns)
    name = fake_segment(bytes(head))
    try:
        info = {s.name: s for s in segment.list_segments()}[name]
        assert (info.state, info.pidns, info.alive) == (state, pidns or None, True)
        assert name not in {s.name for s in segment.remove_stale().removed}
        assert os.path.exists(segment.SHM_DIR + name)
        assert name in {s.name for s in segment.remove_stale(dry_run=True, force=True).removed}
        cli = lambda *a: subprocess.run([sys.executable, "-m", "shmq", *a], capture_output=True,
                                        text=True, timeout=30).stdout
        assert f"\tpidns {pidns}\t{state}\n" in cli("list") if pidns else \
            f"\tpidns unrecorded\t{state}\n" in cli("list")
        kept = cli("clean", "--dry-run")
        assert f"would remove {name}" not in kept and f"kept {name} (" in kept
        assert f"): {state}\n" in kept and "pass --force if you know they are dead" in kept
        forced = cli("clean", "--dry-run", "--force")
        assert f"would remove {name} (" in forced and f"is {state}, --force)" in forced
        assert os.path.exists(segment.SHM_DIR + name)
    finally:
        segment.unlink(name)


@pytest.mark.timeout(60)
def test_clean_from_another_pid_namespace_keeps_a_live_queue():
    """repro_shmq_clean_other_pidns.py: `clean` run in a new pid namespace
    sharing /dev/shm (a pod's other container) looked our pid up in its own
    /proc, found nothing and took our live queue for stale."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) to make a pid namespace")
    with shmq.Queue(1 << 16) as q:
        q.put(np.arange(3))
        run = lambda *a: subprocess.run(["unshare", "-p", "-f", "--mount-proc", sys.executable,
                                         "-m", "shmq", *a], capture_output=True, text=True,
                                        timeout=30)
        listed = run("list")
        assert listed.returncode == 0, listed.stderr
        assert f"\tcreator pid {os.getpid()}\tpidns {segment.own_pidns()}\t" \
               f"unknown: other pid namespace\n" in listed.stdout
        dry = run("clean", "--dry-run")
        assert f"would remove {q.name}" not in dry.stdout
        assert f"kept {q.name} (" in dry.stdout and "unknown: other pid namespace" in dry.stdout
        cleaned = run("clean")
        assert f"removed {q.name}" not in cleaned.stdout
        assert os.path.exists(segment.SHM_DIR + q.name)
        assert q.get(timeout=1).tolist() == [0, 1, 2]
