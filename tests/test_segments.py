"""Segments: hostile or foreign contents (R11), /dev/shm full (R9), stale
names after a crash (R15), and the `python -m shmq` cleaner."""

import os
import struct
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

import shmq
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
    ("consumer_slot", "<i", 1 << 20, "field consumer_slot/producer_slot"),
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


def test_shm_full_is_reported_up_front_and_leaves_nothing():
    before = set(os.listdir(segment.SHM_DIR))
    with pytest.raises(shmq.ShmFull, match=r"--shm-size") as info:
        shmq.Queue(_core.MAX_CAPACITY)
    assert isinstance(info.value, OSError)
    assert set(os.listdir(segment.SHM_DIR)) == before


def test_shm_full_when_reservation_fails(monkeypatch):
    # Past the free-space pre-check (as if another process raced us for the
    # space): posix_fallocate fails and the half-made name is removed.
    monkeypatch.setattr(segment, "free_bytes", lambda: 1 << 62)
    before = set(os.listdir(segment.SHM_DIR))
    with pytest.raises(shmq.ShmFull, match="--shm-size"):
        shmq.Queue(_core.MAX_CAPACITY)
    assert set(os.listdir(segment.SHM_DIR)) == before


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


def test_stale_segments_are_found_and_removed_and_live_ones_kept():
    stale = make_stale_segment()
    with shmq.Queue(1 << 16) as live:
        infos = {s.name: s for s in segment.list_segments()}
        assert not infos[stale].alive and infos[live.name].alive
        assert infos[live.name].creator_pid == os.getpid()
        removed = segment.remove_stale()
        assert stale in {s.name for s in removed}
        assert live.name not in {s.name for s in removed}
        assert not os.path.exists(segment.SHM_DIR + stale)
        live.put(np.ones(2))  # untouched
        assert live.get(timeout=0).tolist() == [1.0, 1.0]


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


def test_cli_list_and_clean():
    stale = make_stale_segment()
    run = lambda *a: subprocess.run([sys.executable, "-m", "shmq", *a], capture_output=True,
                                    text=True, timeout=30)
    listed = run("list")
    assert listed.returncode == 0 and f"{stale}\t" in listed.stdout and "stale" in listed.stdout
    dry = run("clean", "--dry-run")
    assert f"would remove {stale}" in dry.stdout and os.path.exists(segment.SHM_DIR + stale)
    cleaned = run("clean")
    assert f"removed {stale}" in cleaned.stdout
    assert not os.path.exists(segment.SHM_DIR + stale)
