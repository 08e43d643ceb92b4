"""Waiting and waking on words of shared arrays (shmq.sync.wait/wake) and the
atomics around them: the primitive the loader's control plane is built on."""

import os
import signal
import sys
import time

import numpy as np
import pytest

from shmq import sync

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype", ["i4", "u4", "i8"])
def test_atomics_on_32_and_64_bit_words(dtype):
    a = sync.shared_array(4, dtype)
    assert sync.atomic_add(a, 1, 5) == 0 and sync.atomic_load(a, 1) == 5
    sync.atomic_store(a, 2, 9)
    assert a.tolist() == [0, 5, 9, 0]
    assert sync.atomic_cas(a, 2, 9, 11) is True and sync.atomic_cas(a, 2, 9, 12) is False
    assert a.tolist() == [0, 5, 11, 0]
    assert sync.atomic_add(a, 3, -1) == 0
    assert a[3] == np.array(-1).astype(dtype)  # wraps like the C type
    big = (1 << 40) if dtype == "i8" else 7
    sync.atomic_store(a, 0, big)
    assert sync.atomic_load(a, 0) == big


@pytest.mark.parametrize("bad, error", [
    (np.zeros(4, np.float64), TypeError),
    (np.zeros((2, 2), np.int64), TypeError),
    (np.zeros(8, np.int64)[::2], TypeError),
])
def test_atomics_refuse_what_they_cannot_do_atomically(bad, error):
    with pytest.raises(error):
        sync.atomic_load(bad, 0)


def test_index_and_writability_are_checked():
    a = sync.shared_array(2, "i4")
    with pytest.raises(IndexError):
        sync.atomic_add(a, 2, 1)
    ro = a.view()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        sync.atomic_store(ro, 0, 1)


def test_wait_returns_at_once_when_the_word_differs_and_times_out_otherwise():
    w = sync.shared_array(1, "i4")
    assert sync.wait(w, 0, 1, timeout=10) is True  # 0 != 1: no sleep
    t = time.monotonic()
    assert sync.wait(w, 0, 0, timeout=0.2) is False
    assert 0.18 < time.monotonic() - t < 5
    assert sync.wait(w, 0, 0, timeout=0) is False
    with pytest.raises(TypeError, match="32"):
        sync.wait(sync.shared_array(1, "i8"), 0, 0, timeout=0)
    with pytest.raises(ValueError):
        sync.wait(w, 0, 0, timeout=-1)
    with pytest.raises(ValueError):
        sync.wake(w, 0, 0)


def test_wake_reaches_a_sleeper_in_another_process(procs):
    w = sync.shared_array(4, "i4")   # [0]: the word, [1]: sleepers, [2]: woken, [3]: results

    def sleeper():
        sync.atomic_add(w, 1, 1)
        woke = sync.wait(w, 0, 0, timeout=20)
        sync.atomic_store(w, 3, 1 if woke else -1)
        sync.atomic_add(w, 2, 1)

    procs.fork(sleeper)
    assert sync.wait(w, 1, 0, timeout=10)  # it announced itself
    time.sleep(0.05)  # let it reach FUTEX_WAIT
    t = time.monotonic()
    sync.atomic_add(w, 0, 1)
    sync.wake(w, 0)
    assert procs.join_all() == []
    assert w[3] == 1 and w[2] == 1
    assert time.monotonic() - t < 2  # woken, not timed out (20 s)


def test_no_lost_wakeups_in_a_ping_pong_of_100k_rounds(procs):
    """The eventcount pattern of shmq_sync.h between two processes: every
    hand-over is a store + wake on one side and a wait on the other, and
    none may be lost (a lost one would stall the round for a whole slice)."""
    rounds = 100_000
    w = sync.shared_array(2, "i4")  # [0] ping counter, [1] pong counter

    def ponger():
        for i in range(rounds):
            while sync.atomic_load(w, 0) == i:
                sync.wait(w, 0, i, timeout=5)
            sync.atomic_add(w, 1, 1)
            sync.wake(w, 1)

    procs.fork(ponger)
    t = time.monotonic()
    for i in range(rounds):
        sync.atomic_add(w, 0, 1)
        sync.wake(w, 0)
        while sync.atomic_load(w, 1) == i:
            sync.wait(w, 1, i, timeout=5)
    assert procs.join_all() == []
    assert w.tolist() == [rounds, rounds]
    assert time.monotonic() - t < 50  # a lost wake-up costs 5 s here


def test_ctrl_c_interrupts_a_wait_without_a_limit():
    """In a child of its own, with SIGINT's default handler installed there
    (a test suite started in the background inherits SIGINT ignored)."""
    code = (
        "import signal, sys, time\n"
        "from shmq import sync\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "w = sync.shared_array(1, 'i4')\n"
        "print('ready', flush=True)\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    sync.wait(w, 0, 0)\n"
        "except KeyboardInterrupt:\n"
        "    print(f'interrupted {time.monotonic() - t:.3f}', flush=True)\n")
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        line = p.stdout.readline().split()
        assert line[0] == "interrupted", line
        assert time.monotonic() - sent < 0.5 + 0.5  # one wait slice, plus scheduling
        assert p.wait(10) == 0
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_discard_pages_frees_shared_memory_in_every_process(procs):
    size = 8 << 20
    a = sync.shared_array(size, np.uint8)
    a[:] = 7
    w = sync.shared_array(3, "i4")  # [0] child ready, [1] go, [2] result

    def child():
        assert a[12345] == 7
        sync.atomic_store(w, 0, 1)
        sync.wake(w, 0)
        while sync.atomic_load(w, 1) == 0:
            sync.wait(w, 1, 0, timeout=10)
        # Whole pages now read as zeros; the partial page at the end keeps its bytes.
        sync.atomic_store(w, 2, 1 if (a[:size - 4096].max() == 0 and a[-1] == 9) else -1)

    procs.fork(child)
    while sync.atomic_load(w, 0) == 0:
        sync.wait(w, 0, 0, timeout=10)
    a[-1] = 9
    sync.discard_pages(a[:size - 100])  # the last page is partial: kept
    sync.atomic_store(w, 1, 1)
    sync.wake(w, 1)
    assert procs.join_all() == []
    assert w[2] == 1
