"""Helpers for the tests that kill processes (test_loader_kill.py,
test_suite_conditions.py): the programs they run (loader_program composes
one from the shared preamble and the test's own body), and what is left of
a program after a signal.

A program under test runs in a session of its own (start_new_session=True),
so every process it forks, and every process those fork, carries its
session id: after the program is killed its orphans are re-parented (they
are no longer our descendants) but can still be found by session, without
trusting the pids the program managed to print.

Randomness is seeded: SHMQ_STRESS_SEED replays a run (as in test_stress.py);
each test derives its own generator from the seed and its name.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from conftest import our_shm_entries, wait_until

SEED = int(os.environ.get("SHMQ_STRESS_SEED", random.randrange(1 << 30)))


def rng_for(name: str) -> random.Random:
    print(f"SHMQ_STRESS_SEED={SEED}")
    return random.Random(f"{SEED}:{name}")


# --- processes ------------------------------------------------------------------------

def stat_of(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of a process, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3])


def session_members(sid: int) -> dict[int, str]:
    """pid -> state of every process of session sid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = stat_of(int(entry))
            if st is not None and st[2] == sid:
                found[int(entry)] = st[0]
    return found


def live(pids, sid: int | None = None) -> dict[int, str]:
    """Those of pids that still exist (in session sid, if given: a pid
    reused by an unrelated process does not count), except zombies whose
    parent is not this process (an orphan's zombie is init's to reap)."""
    left = {}
    for pid in pids:
        st = stat_of(pid)
        if st is None or (st[0] == "Z" and st[1] != os.getpid()):
            continue
        if sid is not None and st[2] != sid:
            continue
        left[pid] = st[0]
    return left


def creator_pid(entry: str) -> int | None:
    """The creator's pid in a shmq entry's name (shmq-[kind-]<pid>-<random>)."""
    for part in entry.split("shmq-", 1)[-1].split("-"):
        if part.isdigit():
            return int(part)
    return None


def shm_entries_of(pids) -> set[str]:
    """Our /dev/shm entries (shmq segments, sem.*) created by one of pids."""
    pids = set(pids)
    return {e for e in our_shm_entries() if creator_pid(e) in pids}


def kill_pids(pids) -> None:
    """SIGKILL each of pids (processes this test started, or that they
    forked), ignoring those already gone; reap those that are ours."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


# --- programs -----------------------------------------------------------------------

SUPPORT_DIR = os.path.dirname(os.path.abspath(__file__))

PREAMBLE = """\
import gc, json, os, resource, signal, sys, threading, time
import numpy as np
"""

CHILDREN = """\

def children():
    \"\"\"(pid, state) of each child of this process, read from /proc.\"\"\"
    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == me:
            found.append((int(entry), fields[0]))
    return found

"""

RESTORE_SIGINT = """\
# A test suite started in the background inherits SIGINT ignored: restore it.
signal.signal(signal.SIGINT, signal.default_int_handler)
"""


def loader_program(body: str, *, names: tuple[str, ...] = ("ShmLoader",),
                   restore_sigint: bool = True) -> str:
    """The text of a standalone loader program (for Program): the preamble
    the kill tier's programs share, then `body` (dedented), which states
    only what is the test's own: its dataset's arguments, its loop, what it
    prints.

    The preamble imports the standard modules the programs use and numpy;
    with restore_sigint, gives SIGINT its default handler back before the
    loader is imported (a program that is to see a KeyboardInterrupt must,
    even when the suite runs from a background job); puts tests/support on
    sys.path and imports shared_datasets.Filled (sample i: an array filled
    with i, with optional work per sample), then `from loader import`
    each of `names`; defines children(), the (pid, state) of each child
    of the program still there (reaped ones are gone, zombies are 'Z')."""
    return "".join([
        PREAMBLE,
        RESTORE_SIGINT if restore_sigint else "",
        f"sys.path.insert(0, {SUPPORT_DIR!r})\n",
        "from shared_datasets import Filled\n",
        f"from loader import {', '.join(names)}\n",
        CHILDREN,
        textwrap.dedent(body),
    ])


class Program:
    """A Python program in a session of its own, with its stdout read line
    by line (bounded waits) and its stderr in a file."""

    def __init__(self, code: str, *args: str, env: dict | None = None):
        self._err = tempfile.TemporaryFile()
        self.p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=self._err,
                                  start_new_session=True, env=env)
        self.pid = self.sid = self.p.pid
        self.lines: list[str] = []
        self._buf = b""
        self._eof = False
        self.seen: set[int] = set()   # every pid of its session we ever saw
        self.exited_at = None

    def _read(self, timeout: float) -> bool:
        """Read what is available within timeout; False at end of file."""
        if self._eof:
            return False
        ready, _, _ = select.select([self.p.stdout], [], [], max(timeout, 0))
        if ready:
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                self._eof = True
                return False
            self._buf += chunk
            *done, self._buf = self._buf.split(b"\n")
            self.lines.extend(line.decode(errors="replace") for line in done)
        return True

    def wait_for(self, prefix: str, timeout: float) -> str:
        """The first line (from the start) that starts with prefix."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                if line.startswith(prefix):
                    return line
            if not self._read(deadline - time.monotonic()) or time.monotonic() > deadline:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                raise AssertionError(f"no line {prefix!r} within {timeout}s; stdout: "
                                     f"{self.lines[-20:]}; stderr: {self.stderr()[-3000:]}")

    def snapshot(self) -> dict[int, str]:
        members = session_members(self.sid)
        self.seen.update(members)
        return members

    def signal(self, sig: int, group: bool) -> None:
        self.snapshot()  # whatever it forked so far
        if group:
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        """Its exit status (-signal if killed), None if still running after
        timeout; reads stdout meanwhile so it can never block on a full pipe."""
        deadline = time.monotonic() + timeout
        while self.p.poll() is None and time.monotonic() < deadline:
            self.snapshot()
            self._read(min(0.01, max(0, deadline - time.monotonic())))
        code = self.p.poll()
        if code is not None:
            if self.exited_at is None:
                self.exited_at = time.monotonic()
            while self._read(0.5):
                pass
        return code

    def stdout(self) -> list[str]:
        return list(self.lines) + ([self._buf.decode(errors="replace")] if self._buf else [])

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def reported_pids(self, prefix: str = "pids") -> set[int]:
        return {int(x) for line in self.stdout() if line.startswith(prefix + " ")
                for x in line.split()[1:]}

    def leftovers(self) -> dict[int, str]:
        """Processes of its session still there (orphan zombies excepted)."""
        self.snapshot()
        return live(self.seen | self.reported_pids() | set(session_members(self.sid)), self.sid)

    def cleanup(self) -> None:
        """Whatever happened: nothing of it survives, nothing is left in
        /dev/shm, and its pipes and files are closed."""
        if self.p.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.p.wait(10)
        finally:
            left = self.leftovers()
            kill_pids(left)
            for e in shm_entries_of({self.pid} | self.seen | self.reported_pids()):
                try:
                    os.unlink(os.path.join("/dev/shm", e))
                except FileNotFoundError:
                    pass
            self.p.stdout.close()
            self._err.close()


def assert_nothing_left(prog: Program, since: float, within: float = 2.0) -> float:
    """Every process of the program's session gone (orphan zombies count as
    gone) within `within` seconds of `since` (a time.monotonic()), and no
    /dev/shm entry made by any of them.  Returns how long after `since` the
    last one was seen gone (to within the 10 ms of wait_until's checks)."""
    ok = wait_until(lambda: not prog.leftovers(), max(0.0, since + within - time.monotonic()))
    gone = time.monotonic() - since
    assert ok, (f"processes of the killed program still there {within}s later (pid: state): "
                f"{prog.leftovers()}; reported {sorted(prog.reported_pids())}")
    leaked = shm_entries_of({prog.pid} | prog.seen | prog.reported_pids())
    assert not leaked, f"/dev/shm entries left by the program: {sorted(leaked)}"
    return gone
