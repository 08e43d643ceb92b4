"""Anonymous queues (``shmq.Queue(anonymous=True)``): unnamed shared memory
shared with forked children only, which nothing can leak."""

import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import shmq
from shmq import sync
from shmq import segment
from conftest import descendants, segment_pid

pytestmark = pytest.mark.timeout(60)


def our_entries():
    """Segment names made by this process tree (another shmq program may run)."""
    tree = {os.getpid(), *descendants()}
    return {e for e in os.listdir(segment.SHM_DIR)
            if e.startswith(segment.PREFIX) and segment_pid(e) in tree}


def test_forked_children_share_it_and_nothing_appears_in_dev_shm(procs):
    before = our_entries()
    q = shmq.Queue(1 << 20, multi_producer=True, anonymous=True)
    assert q.name is None and q.multi_producer and q.capacity_bytes == 1 << 20
    assert repr(q) == "<shmq.Queue anonymous multi-producer 1048576 bytes open>"
    assert our_entries() == before

    def producer(k):
        for i in range(1000):
            q.put({"k": k, "i": i, "x": np.full(100, i, np.int32)})
        q.close()

    for k in range(3):
        procs.fork(producer, k)
    seen = {k: [] for k in range(3)}
    for _ in range(3000):
        m = q.get(timeout=10)
        assert (m["x"] == m["i"]).all()
        seen[m["k"]].append(m["i"])
    with pytest.raises(shmq.Closed):
        q.get(timeout=10)  # every producer closed; the creator is the consumer
    assert procs.join_all() == []
    assert all(v == list(range(1000)) for v in seen.values())
    assert our_entries() == before
    q.close()


def test_it_cannot_leave_the_process_tree_and_unlink_is_a_no_op():
    with shmq.Queue(4096, anonymous=True) as q:
        with pytest.raises(TypeError, match="anonymous.*forked"):
            pickle.dumps(q)
        q.unlink()  # nothing to remove
        q.put(np.arange(3))
        assert q.get(timeout=0).tolist() == [0, 1, 2]


def anonymous_mappings() -> set[str]:
    """Address ranges of this process's mappings of anonymous queues."""
    with open("/proc/self/maps") as f:
        return {line.split()[0] for line in f if "memfd:shmq-anonymous" in line}


def allocated_bytes(ranges) -> int:
    """Bytes allocated in the memfd behind the mappings (one file)."""
    return max(os.stat(f"/proc/self/map_files/{r}").st_blocks * 512 for r in ranges)


def test_its_memory_is_returned_when_the_last_handle_closes_even_where_still_mapped(procs):
    """A child forked while the queue is open keeps the mapping until it
    exits; once every handle is closed the pages go back anyway."""
    size = 32 << 20
    before = anonymous_mappings()
    q = shmq.Queue(size, anonymous=True)
    mine = anonymous_mappings() - before
    assert mine and allocated_bytes(mine) >= size  # every page reserved up front
    w = sync.shared_array(2, "i4")  # [0] child closed its handle, [1] parent closed

    def child():
        q.close()  # this child never uses it, but still maps it
        sync.atomic_store(w, 0, 1)
        sync.wake(w, 0)
        while sync.atomic_load(w, 1) == 0:
            sync.wait(w, 1, 0, timeout=20)

    procs.fork(child)
    assert sync.wait(w, 0, 0, timeout=20)
    q.close()  # the last handle: both processes still map it
    assert allocated_bytes(mine) < size // 100
    sync.atomic_store(w, 1, 1)
    sync.wake(w, 1)
    assert procs.join_all() == []


def test_a_live_handle_elsewhere_keeps_its_memory(procs):
    size = 8 << 20
    before = anonymous_mappings()
    q = shmq.Queue(size, anonymous=True)
    mine = anonymous_mappings() - before
    w = sync.shared_array(2, "i4")

    def child():  # keeps its handle open until told
        sync.atomic_store(w, 0, 1)
        sync.wake(w, 0)
        while sync.atomic_load(w, 1) == 0:
            sync.wait(w, 1, 0, timeout=20)
        q.close()

    procs.fork(child)
    assert sync.wait(w, 0, 0, timeout=20)
    q.close()
    assert allocated_bytes(mine) >= size
    sync.atomic_store(w, 1, 1)
    sync.wake(w, 1)
    assert procs.join_all() == []
    assert allocated_bytes(mine) < size // 100  # the child's close was the last


CREATE_FOREVER = r'''
import shmq
from shmq import sync
print("ready", flush=True)
while True:
    shmq.Queue(32 << 20, anonymous=True).close()
'''


def test_sigkill_while_creating_leaves_nothing():
    pids = []
    for delay in (0.0, 0.005, 0.02, 0.05):
        p = subprocess.Popen([sys.executable, "-c", CREATE_FOREVER], stdout=subprocess.PIPE, text=True)
        pids.append(p.pid)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(delay)
        p.kill()
        p.wait()
        p.stdout.close()
    # another shmq program may be running: only these processes' names count
    assert not [e for e in os.listdir(segment.SHM_DIR) if segment_pid(e) in pids]


_PRODUCE_FROM_PICKLE = """
import pickle, sys
import numpy as np
q = pickle.loads(sys.stdin.buffer.read())
for i in range(1000):
    q.put({"i": i, "x": np.full(64, i, np.int32)})
q.close()
"""


def test_keep_fd_lets_a_started_process_attach_by_its_descriptor():
    """keep_fd=True: pickled, the queue attaches by its memfd in a fresh
    interpreter given that descriptor (pass_fds), as a producer counted from
    the pickling on; its 1,000 messages arrive exactly, then Closed; close()
    closes the descriptor; nothing in /dev/shm."""
    before = our_entries()
    q = shmq.Queue(1 << 16, multi_producer=True, anonymous=True, keep_fd=True)
    fd = q.fd
    assert fd is not None and q.name is None
    data = pickle.dumps(q)
    child = subprocess.Popen([sys.executable, "-c", _PRODUCE_FROM_PICKLE], stdin=subprocess.PIPE,
                             pass_fds=[fd])
    try:
        child.stdin.write(data)
        child.stdin.close()
        got = [q.get(timeout=30) for _ in range(1000)]
        assert [m["i"] for m in got] == list(range(1000))
        assert all(m["x"].tolist() == [m["i"]] * 64 for m in got)
        with pytest.raises(shmq.Closed):
            q.get(timeout=30)
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait(30)
    assert our_entries() == before
    q.close()
    assert q.fd is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_keep_fd_needs_an_anonymous_queue():
    with pytest.raises(ValueError, match="anonymous=True"):
        shmq.Queue(4096, keep_fd=True)
    with shmq.Queue(4096, anonymous=True) as q:
        assert q.fd is None
