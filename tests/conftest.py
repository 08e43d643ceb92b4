"""Fixtures shared by every test.

- ``shm_guard`` (autouse): lists our entries in /dev/shm before and after each
  test and fails the test if one is left (after up to 5 s for teardown).
- ``procs``: starts child processes (fork, spawn, or a fresh interpreter) and
  at teardown joins them with a timeout; a hung child's stacks are dumped
  (faulthandler on SIGUSR1) before it is killed and the test fails.  A test
  that ends with a live or zombie child fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from shmq import segment

JOIN_TIMEOUT_S = 30.0
LEAK_GRACE_S = 5.0


def our_shm_entries() -> set[str]:
    return {e for e in os.listdir(segment.SHM_DIR)
            if e.startswith(segment.PREFIX) or (e.startswith("sem.") and segment.PREFIX in e)}


@pytest.fixture(autouse=True)
def shm_guard():
    before = our_shm_entries()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = our_shm_entries() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = our_shm_entries() - before
    for entry in leaked:  # so one leak does not fail every later test
        segment.unlink("/" + entry)
    assert not leaked, f"test left entries in /dev/shm: {sorted(leaked)}"


class ProcessTracker:
    """Starts children and guarantees none outlives the test."""

    def __init__(self):
        self._children: list = []

    def fork(self, target, *args) -> mp.Process:
        return self._start(mp.get_context("fork"), target, args)

    def spawn(self, target, *args) -> mp.Process:
        return self._start(mp.get_context("spawn"), target, args)

    def _start(self, ctx, target, args):
        p = ctx.Process(target=_child_main, args=(target, args), daemon=True)
        p.start()
        self._children.append(p)
        return p

    def python(self, code: str, *args: str) -> subprocess.Popen:
        """An independently started interpreter (not forked from us)."""
        p = subprocess.Popen([sys.executable, "-c", _CHILD_PRELUDE + code, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._children.append(p)
        return p

    def join_all(self, timeout: float = JOIN_TIMEOUT_S) -> list[str]:
        problems = []
        deadline = time.monotonic() + timeout
        for p in self._children:
            left = max(0.0, deadline - time.monotonic())
            if isinstance(p, subprocess.Popen):
                try:
                    p.wait(left)
                    continue
                except subprocess.TimeoutExpired:
                    pid = p.pid
            else:
                p.join(left)
                if p.exitcode is not None:
                    continue
                pid = p.pid
            problems.append(f"child pid {pid} still running after the test; stacks:\n"
                            f"{_dump_stacks(p, pid)}")
        return problems

    def kill_all(self):
        for p in self._children:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
            if isinstance(p, subprocess.Popen):
                p.wait()
                for stream in (p.stdout, p.stderr):
                    if stream:
                        stream.close()
            else:
                p.join()


_CHILD_PRELUDE = "import faulthandler, signal; faulthandler.register(signal.SIGUSR1)\n"


def _child_main(target, args):
    import faulthandler

    faulthandler.register(signal.SIGUSR1)
    target(*args)


def _dump_stacks(p, pid) -> str:
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(exited while being inspected)"
    time.sleep(0.5)
    if isinstance(p, subprocess.Popen):
        os.kill(pid, signal.SIGKILL)
        _, err = p.communicate()
        return err[-4000:]
    return "(stacks written to the test's stderr)"


@pytest.fixture
def procs():
    tracker = ProcessTracker()
    try:
        yield tracker
        problems = tracker.join_all()
    finally:
        tracker.kill_all()
    assert not problems, "\n".join(problems)
    assert not mp.active_children(), f"children left running: {mp.active_children()}"


def wait_until(predicate, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
