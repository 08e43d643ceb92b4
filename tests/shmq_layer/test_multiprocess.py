"""Queues shared between processes: forked, spawned and independently
started.  Every test checks exact counts and contents (sequence numbers and
checksums, see payload.py), is bounded in time, and is leak-checked."""

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import payload
import shmq
from shmq import sync
from conftest import wait_until
from measure import record
from shmq import _core

pytestmark = pytest.mark.timeout(60)

# What pytest puts on sys.path, for a fresh interpreter that imports this file
# or payload: this folder, tests/ (conftest.py) and tests/support (pythonpath)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TEST_PATH = [TESTS_DIR, os.path.dirname(TESTS_DIR),
             os.path.join(os.path.dirname(TESTS_DIR), "support")]


# --- child bodies (top level so spawn can import them) ----------------------

def produce(q, producer, count, size, close=True):
    for s in range(count):
        q.put(payload.make(producer, s, size))
    if close:
        q.close()


def produce_by_name(name, producer, count, size):
    q = shmq.Queue.attach(name)
    produce(q, producer, count, size)


def produce_then_hang(q, producer, count):
    produce(q, producer, count, 100, close=False)
    time.sleep(600)


def produce_then_die(q, producer, count, point, at):
    _core._set_kill_point(point, at)
    produce(q, producer, count, 4000)


def produce_then_exit_unclosed(q, count):
    produce(q, 0, count, 64, close=False)
    os._exit(0)


def consume_one_then_hang(q):
    q.get(timeout=10)
    time.sleep(600)


def consume_one_then_close(q):
    q.get(timeout=10)
    q.close()


def drain(q, producers, expect_end=shmq.Closed, timeout=20):
    tally = payload.Tally(producers)
    with pytest.raises(expect_end) as end:
        while True:
            tally.add(q.get(timeout=timeout))
    return tally, end.value


# --- basic transport ---------------------------------------------------------

@pytest.mark.parametrize("size", [0, 100, 70_000])
def test_spsc_fork(procs, size):
    with shmq.Queue(1 << 18) as q:
        procs.fork(produce, q, 0, 500, size)
        tally, _ = drain(q, 1)
        assert tally.next_seq == [500]


def test_spsc_independent_process_attaches_by_name(procs):
    with shmq.Queue(1 << 16) as q:
        child = procs.python(
            f"import sys; sys.path[:0] = {TEST_PATH!r}\n"
            "import shmq, test_multiprocess as t\n"
            "t.produce_by_name(sys.argv[1], 0, 300, 5000)\n", q.name)
        tally, _ = drain(q, 1)
        assert tally.next_seq == [300]
        assert child.wait(10) == 0, child.stderr.read()


def test_consumer_in_independent_process(procs):
    with shmq.Queue(1 << 16) as q:
        child = procs.python(
            f"import sys; sys.path[:0] = {TEST_PATH!r}\n"
            "import shmq, payload\n"
            "q = shmq.Queue.attach(sys.argv[1]); tally = payload.Tally(1)\n"
            "try:\n"
            "    while True: tally.add(q.get(timeout=20))\n"
            "except shmq.Closed:\n"
            "    print(tally.next_seq[0])\n", q.name)
        produce(q, 0, 400, 3000, close=False)
        q.close()
        out, err = child.communicate(timeout=20)
        assert child.returncode == 0, err
        assert out.strip() == "400"


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_mpsc_four_producers(procs, start):
    with shmq.Queue(1 << 17, multi_producer=True) as q:
        for p in range(4):
            getattr(procs, start)(produce, q, p, 400, 3000 + p)
        tally, _ = drain(q, 4)
        assert tally.next_seq == [400] * 4


# --- end of stream -----------------------------------------------------------

def test_one_producer_closing_does_not_stop_the_others(procs):
    with shmq.Queue(1 << 16, multi_producer=True) as q:
        procs.fork(produce, q, 0, 5, 64)
        procs.fork(produce, q, 1, 500, 2000)
        tally, _ = drain(q, 2)
        assert tally.next_seq == [5, 500]


def test_parent_closing_right_after_fork_still_counts_the_child(procs):
    q = shmq.Queue(1 << 16)
    consumer = shmq.Queue.attach(q.name)
    with pytest.raises(shmq.Empty):
        consumer.get_nowait()
    procs.fork(produce, q, 0, 50, 64)
    q.close()  # the parent's producer handle goes; the child's keeps the stream open
    tally, _ = drain(consumer, 1)
    assert tally.next_seq == [50]
    consumer.close()


def test_child_exiting_normally_without_close_counts_as_closed(procs):
    with shmq.Queue(1 << 16) as q:
        procs.fork(produce, q, 0, 30, 64, False)  # multiprocessing exit closes it
        tally, _ = drain(q, 1, shmq.Closed)
        assert tally.next_seq == [30]


def test_producer_exiting_with_os_exit_unclosed_is_peer_lost(procs):
    with shmq.Queue(1 << 16) as q:
        procs.fork(produce_then_exit_unclosed, q, 20)
        tally, end = drain(q, 1, shmq.PeerLost)
        assert tally.next_seq == [20]
        assert "died without closing" in str(end)


def test_all_producers_killed_while_consumer_blocked(procs):
    with shmq.Queue(1 << 16, multi_producer=True) as q:
        children = [procs.fork(produce_then_hang, q, p, 10) for p in range(3)]
        tally = payload.Tally(3)
        for _ in range(30):
            tally.add(q.get(timeout=10))
        killed_at = []

        def kill_later():
            time.sleep(0.3)
            killed_at.append(time.monotonic())
            for c in children:
                os.kill(c.pid, signal.SIGKILL)

        threading.Thread(target=kill_later).start()
        with pytest.raises(shmq.PeerLost, match="3 producer"):
            q.get()  # no timeout: must not hang
        detected = time.monotonic() - killed_at[0]
        assert detected < 2.0
        assert tally.next_seq == [10, 10, 10]
        record("R1", "3 producers SIGKILLed while the consumer waits: PeerLost naming them",
               detected, what="kill → PeerLost")


def test_producer_blocked_on_full_ring_sees_dead_consumer(procs):
    with shmq.Queue(4096) as q:
        q.put(np.zeros(10, np.uint8))
        consumer = procs.fork(consume_one_then_hang, q)
        assert wait_until(lambda: q.stats()["used_bytes"] == 0, 10)
        chunk = np.zeros(3000, np.uint8)
        q.put(chunk)
        threading.Timer(0.3, os.kill, (consumer.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(shmq.PeerLost, match=r"consumer \(pid \d+\) died"):
            q.put(chunk)  # no timeout: must not hang
        detected = time.monotonic() - t0
        assert detected < 2.5
        record("R1", "consumer SIGKILLed while a producer waits on a full ring: PeerLost",
               max(0.0, detected - 0.3), what="kill → PeerLost")


def test_producer_sees_consumer_close(procs):
    with shmq.Queue(4096) as q:
        q.put(np.zeros(10, np.uint8))
        procs.fork(consume_one_then_close, q)
        q.put(np.zeros(3000, np.uint8))
        with pytest.raises(shmq.Closed, match="consumer .* closed"):
            q.put(np.zeros(3000, np.uint8), timeout=10)


# --- R1: a producer killed mid-write -----------------------------------------

@pytest.mark.parametrize("point", ["after_claim", "mid_copy", "before_publish"])
def test_spsc_producer_killed_mid_write(procs, point):
    with shmq.Queue(1 << 16) as q:
        procs.fork(produce_then_die, q, 0, 100, point, 7)
        tally = payload.Tally(1)
        t_end = None
        with pytest.raises(shmq.PeerLost):
            while True:
                tally.add(q.get(timeout=10))
                t_end = time.monotonic()
        detected = time.monotonic() - t_end
        assert detected < 2.0
        assert tally.next_seq == [6]  # the 7th put died before it was published
        record("R1", f"SPSC producer SIGKILLed {point}: 6 messages, then PeerLost",
               detected, what="last message → PeerLost")


@pytest.mark.parametrize("point", ["after_claim", "mid_copy", "before_publish"])
def test_mpsc_producer_killed_mid_write_does_not_block_others(procs, point):
    # A small ring: the survivors would stall behind the dead record if the
    # consumer did not step over it.
    with shmq.Queue(1 << 14, multi_producer=True) as q:
        procs.fork(produce_then_die, q, 0, 100, point, 5)
        for p in (1, 2):
            procs.fork(produce, q, p, 300, 1500)
        tally = payload.Tally(3)
        dropped = []
        while True:
            try:
                tally.add(q.get(timeout=20))
            except shmq.PeerLost as e:
                if "no producer is left" in str(e):
                    break
                dropped.append(str(e))
        assert tally.next_seq == [4, 300, 300]
        assert len(dropped) == 1 and "died while writing" in dropped[0], dropped
        assert q.stats()["skipped_records"] == 1
        record("R1", f"MPSC producer SIGKILLed {point}: its record dropped, 2 others unblocked")


def die_after_claiming(q, size):
    _core._set_kill_point("after_claim", 1)
    q.put(np.zeros(size, np.uint8))


def put_ones_until_closed(q, size):
    try:
        while True:
            q.put(np.ones(size, np.uint8))
    except shmq.Closed:
        pass


def test_mpsc_stale_claim_of_a_live_producer_does_not_block_the_queue(procs):
    """repro_mpsc_stale_claim.py as a test.  Producer B claims head and dies
    before publishing; producer A, alive and blocked on the full ring, has
    in its slot the announcement of head that a lost CAS used to leave
    behind (injected: the race itself is nanoseconds wide; the plain-C test
    replays it step by step).  Before NOTE [claim announcement] the consumer
    waited for A forever and A for the consumer."""
    import struct

    layout = _core.layout_offsets()
    with shmq.Queue(4096, multi_producer=True) as q:
        with pytest.raises(shmq.Empty):
            q.get_nowait()  # the creator is the consumer
        b = procs.fork(die_after_claiming, q, 500)
        b.join(10)
        assert b.exitcode == -signal.SIGKILL
        head = q.stats()["head_pos"]
        a = procs.fork(put_ones_until_closed, q, 500)
        assert wait_until(lambda: q.stats()["used_bytes"] + 576 > q.capacity_bytes, 10)
        path = "/dev/shm" + q.name
        with open(path, "r+b") as f:
            raw = f.read(layout["header_bytes"])
            slots_offset = struct.unpack_from("<Q", raw, layout["slots_offset"])[0]
            f.seek(slots_offset)
            slots = f.read(256 * layout["slot_bytes"])
            a_slot = [i for i in range(256)
                      if struct.unpack_from("<Q", slots, i * layout["slot_bytes"])[0] >> 32 == a.pid]
            assert len(a_slot) == 1
            f.seek(slots_offset + a_slot[0] * layout["slot_bytes"] + layout["slot.claim_pos"])
            f.write(struct.pack("<QQ", head, 576))  # claim_pos, claim_bytes: not OWNED
        t0 = time.monotonic()
        with pytest.raises(shmq.PeerLost, match=rf"producer pid {b.pid} died while writing a "
                                                rf"640-byte record at position {head}"):
            q.get(timeout=5)
        assert time.monotonic() - t0 < 2.0
        for _ in range(20):  # A's messages flow again
            msg = q.get(timeout=5)
            assert msg.shape == (500,) and msg.dtype == np.uint8 and (msg == 1).all()
        assert q.stats()["skipped_records"] == 1
    a.join(10)
    assert a.exitcode == 0


# --- interrupts --------------------------------------------------------------

INTERRUPTIBLE_CHILD = """
import signal, sys, numpy as np, shmq
# A test suite started in the background inherits SIGINT ignored: restore it.
signal.signal(signal.SIGINT, signal.default_int_handler)
q = shmq.Queue.attach(sys.argv[1])
if sys.argv[2] == "put":
    q.put(np.zeros(3000, np.uint8))
print("ready", flush=True)
try:
    if sys.argv[2] == "put":
        q.put(np.zeros(3000, np.uint8))  # the ring is full: blocks
    else:
        q.get()  # nothing comes: blocks
except KeyboardInterrupt:
    print("interrupted", flush=True)
q.close()
"""


@pytest.mark.parametrize("blocked_in", ["get", "put"])
def test_ctrl_c_interrupts_a_blocking_call(procs, blocked_in):
    with shmq.Queue(4096) as q:
        if blocked_in == "put":
            with pytest.raises(shmq.Empty):
                q.get_nowait()  # this process is the consumer that never reads
        child = procs.python(INTERRUPTIBLE_CHILD, q.name, blocked_in)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # well inside the blocking call
        t0 = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=5)
        elapsed = time.monotonic() - t0
        assert out.strip() == "interrupted", err
        assert child.returncode == 0, err
        assert elapsed < 1.0  # 0.5 s budget for the interrupt, the rest is interpreter exit


# --- fork-shared memory ------------------------------------------------------

def add_many(counter, n):
    for _ in range(n):
        sync.atomic_add(counter, 0, 1)


def test_shared_array_and_atomic_add_across_forks(procs):
    counter = sync.shared_array(8, "i8")
    data = sync.shared_array((4, 3), np.float32)
    assert counter.tolist() == [0] * 8 and data.shape == (4, 3) and not data.any()
    for _ in range(4):
        procs.fork(add_many, counter, 20_000)
    assert procs.join_all() == []
    assert counter[0] == 80_000  # no lost update
    with pytest.raises(TypeError):
        sync.atomic_add(data.reshape(-1), 0, 1)
    with pytest.raises(IndexError):
        sync.atomic_add(counter, 8, 1)


def increment_by_cas(counter, n):
    done = 0
    while done < n:
        v = int(counter[0])
        done += sync.atomic_cas(counter, 0, v, v + 1)


def test_atomic_cas_across_forks(procs):
    counter = sync.shared_array(2, "i8")
    assert sync.atomic_cas(counter, 1, 0, 7) is True and counter[1] == 7
    assert sync.atomic_cas(counter, 1, 0, 9) is False and counter[1] == 7  # unchanged
    for _ in range(4):
        procs.fork(increment_by_cas, counter, 20_000)
    assert procs.join_all() == []
    assert counter[0] == 80_000  # every successful swap was exclusive
    with pytest.raises(TypeError):
        sync.atomic_cas(np.zeros(2, np.float64), 0, 0, 1)


def test_fork_hooks_run_no_python_code_so_ctrl_c_cannot_be_lost_in_them():
    """Python swallows an exception raised in an os.register_at_fork hook, so
    a KeyboardInterrupt whose handler ran inside a hook written in Python
    would be lost.  shmq's hooks are compiled and run no Python frame."""
    q = shmq.Queue(4096)
    frames = []

    def profiler(frame, event, arg):
        if event == "call" and os.sep + "shmq" + os.sep in frame.f_code.co_filename:
            frames.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profiler)
    try:
        pid = os.fork()
    finally:
        sys.setprofile(None)
    if pid == 0:
        os._exit(3 if frames else 0)
    _, status = os.waitpid(pid, 0)
    q.close()
    assert frames == []
    assert os.waitstatus_to_exitcode(status) == 0  # none in the child either
