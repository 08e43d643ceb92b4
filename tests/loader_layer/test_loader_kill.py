"""The loader's kill tier (R4, R5, R7, R8, R17, R21, R22): signals to main at
random moments of its life, deaths of its children at random moments, a
Ctrl-C during start-up, forked children of the training process, and a
start-up that runs out of file descriptors.

Main is always a separate program in a session of its own (killkit.Program),
so that its orphans can be found after it died.  Every scenario ends with
exact expectations: the program's processes gone within 2 s (orphan zombies
are init's to reap and count as gone), nothing of theirs in /dev/shm, the
typed error naming who died, pid and signal.

The default run does a few repetitions of each scenario; `-m stress` runs
the full counts (R22: 112 SIGKILLs of main, start-up included).  Random
moments are seeded: the seed is printed; SHMQ_STRESS_SEED replays it.
"""

import contextlib
import faulthandler
import functools
import json
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

import shmq
from conftest import descendants, wait_until
from killkit import (Program, assert_nothing_left, kill_pids, loader_program, rng_for,
                     shm_entries_of)
from measure import record
from loader import ShmLoader, WorkerError
from loader.main.procs import BATCHER
from shared_datasets import Filled

pytestmark = pytest.mark.timeout(120)

STRESS = [pytest.mark.stress, pytest.mark.timeout(3600)]


def reps(quick: int, full: int):
    return [pytest.param(quick, id="quick"), pytest.param(full, marks=STRESS, id="full")]


# A loader program with a marker line before each phase a signal can hit.
# Every batch is checked (sample i is np.full(4, i)); `pids` lines name the
# loader's children as soon as iter() has forked them.
MAIN = loader_program("""
    def report(loader):
        print("pids", *[p.pid for p in loader._session.procs], flush=True)

    def check(b, first, n, bs):
        assert b[:, 0].tolist() == list(range(first, min(n, first + bs))), (first, b[:, 0])
        return first + len(b)

    mode = sys.argv[1]
    try:
        if mode == "start":  # start-ups back to back: a random moment lands in one
            print("ready", flush=True)
            while True:
                with ShmLoader(Filled(32), batch_size=8, num_workers=2) as loader:
                    it = iter(loader)
                    report(loader)
                    done = 0
                    for b in it:
                        done = check(b, done, 32, 8)
                    assert done == 32
        elif mode == "mid":
            loader = ShmLoader(Filled(10 ** 9), batch_size=8, num_workers=2)
            it = iter(loader)
            report(loader)
            done = check(next(it), 0, 10 ** 9, 8)
            print("iterating", flush=True)
            for b in it:
                done = check(b, done, 10 ** 9, 8)
        elif mode == "ahead":  # epochs back to back: the next one runs ahead
            loader = ShmLoader(Filled(48), batch_size=4, num_workers=2, prefetch=3)
            for epoch in range(10 ** 6):
                it = iter(loader)
                if epoch == 0:
                    report(loader)
                done, told = 0, False
                for b in it:
                    done = check(b, done, 48, 4)
                    if loader._runs.ahead is not None and not told:
                        print("ahead", epoch, flush=True)
                        told = True
                    time.sleep(0.002)
                assert done == 48
        elif mode == "close":
            loader = ShmLoader(Filled(64), batch_size=8, num_workers=2)
            it = iter(loader)
            report(loader)
            assert sum(len(b) for b in it) == 64
            print("closing", flush=True)
            loader.close()
            # a second loader left to interpreter exit, its generator suspended
            loader = ShmLoader(Filled(10 ** 6), batch_size=8, num_workers=2)
            it = iter(loader)
            report(loader)
            check(next(it), 0, 10 ** 6, 8)
            print("exiting", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")

PHASES = ["start", "mid", "ahead", "close"]


def _signal_at_random_moment(rng, phase: str, sig: int, group: bool) -> tuple[Program, float]:
    """Run MAIN in `phase` and signal it at a random moment of that phase."""
    prog = Program(MAIN, phase)
    if phase == "start":
        prog.wait_for("ready", 30)
        delay = rng.uniform(0, 0.25)     # about 4 start-ups of 2 workers
    elif phase == "mid":
        prog.wait_for("iterating", 30)
        delay = rng.uniform(0, 0.3)
    elif phase == "ahead":
        prog.wait_for(f"ahead {rng.randrange(3)}", 30)
        delay = rng.uniform(0, 0.03)     # the epoch's last batches, its end, the next start
    else:
        prog.wait_for("closing", 30)
        delay = rng.uniform(0, 0.12)     # close(), a second start-up, interpreter exit
    time.sleep(delay)
    sent = time.monotonic()
    prog.signal(sig, group)
    return prog, sent


def _child_noise(err: str) -> list[str]:
    """Lines of stderr that come from the loader's children."""
    markers = ("worker/worker.py", "batcher/batcher.py", "_child_main", "Fatal Python error", "ShmLoader worker",
               "ShmLoader the batcher")
    return [line for line in err.splitlines() if any(m in line for m in markers)]


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("count", reps(1, 14))
@pytest.mark.parametrize("target", ["group", "main"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("phase", PHASES)
def test_main_killed_at_a_random_moment_leaves_nothing(phase, sig, target, count):
    """R4, R8, R22: SIGKILL or SIGTERM to main (alone: the children die with
    it through the parent-death signal; or to its whole group) during
    start-up, mid-epoch, the run-ahead of the next epoch, or close() and
    interpreter exit.  Full counts: 4 phases x 2 targets x 14 = 112 each."""
    rng = rng_for(f"main-{phase}-{sig.name}-{target}")
    for rep in range(count):
        prog, sent = _signal_at_random_moment(rng, phase, sig, target == "group")
        try:
            code = prog.wait(10)
            assert code is not None, f"rep {rep}: still running 10 s after {sig.name}"
            # close: the program may have ended by itself before the signal came
            assert code == -sig or (phase == "close" and code == 0), (rep, code, prog.stderr())
            gone = assert_nothing_left(prog, since=sent, within=2.0)
            assert _child_noise(prog.stderr()) == [], prog.stderr()
            if code == -sig:
                assert "interrupted" not in prog.stdout()
            record("R22" if sig == signal.SIGKILL else "R8",
                   f"{sig.name} to main{' and its group' if target == 'group' else ' alone'}, "
                   f"phase {phase}: nothing left in /dev/shm, no process left",
                   gone, what="signal → last process gone")
        finally:
            prog.cleanup()


def _assert_interrupted_cleanly(prog: Program, phase: str, rep: int) -> None:
    out, err = prog.stdout(), prog.stderr()
    if "interrupted" in out:
        # KeyboardInterrupt reached the program's own code: nothing else said
        assert err == "", (rep, err)
        assert prog.p.returncode == 0
    else:
        # Only possible once the program had finished: Ctrl-C during
        # interpreter exit interrupts atexit's close() ("Exception ignored in
        # atexit callback" and a KeyboardInterrupt traceback of main's) or
        # the exit itself
        assert phase == "close" and "exiting" in out, (rep, out, err)
        assert prog.p.returncode in (0, -signal.SIGINT), (rep, prog.p.returncode)
        blocks = [b for b in err.split("Traceback (most recent call last):")[1:]]
        assert all(b.rstrip().endswith("KeyboardInterrupt:") for b in blocks), err
    assert _child_noise(err) == [], err


@pytest.mark.parametrize("count", reps(1, 10))
@pytest.mark.parametrize("phase", PHASES)
def test_ctrl_c_to_main_at_a_random_moment(phase, count):
    """R7: SIGINT to the process group (a Ctrl-C): KeyboardInterrupt in main's
    code within 5 s, no traceback from the children, and everything gone
    within 2 s of main's exit."""
    rng = rng_for(f"ctrl-c-{phase}")
    for rep in range(count):
        prog, sent = _signal_at_random_moment(rng, phase, signal.SIGINT, group=True)
        try:
            code = prog.wait(5)
            assert code is not None, (f"rep {rep}: still running 5 s after Ctrl-C; stdout "
                                      f"{prog.stdout()[-5:]}; stderr {prog.stderr()[-2000:]}")
            _assert_interrupted_cleanly(prog, phase, rep)
            assert_nothing_left(prog, since=prog.exited_at, within=2.0)
            record("R7", f"Ctrl-C to main's group, phase {phase}: KeyboardInterrupt in main, "
                   f"children silent", prog.exited_at - sent, what="signal → main exited")
        finally:
            prog.cleanup()


START_LOOP = loader_program("""
    print("ready", flush=True)
    n = 0
    try:
        while True:
            with ShmLoader(Filled(64), batch_size=8, num_workers=8) as loader:
                it = iter(loader)
                print("pids", *[p.pid for p in loader._session.procs], flush=True)
                assert sum(len(b) for b in it) == 64
            n += 1
            print("epoch", n, flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


@pytest.mark.parametrize("count", reps(4, 40))
def test_ctrl_c_during_start_up_of_eight_workers(count):
    """Ctrl-C while loaders of 8 workers are created, iterated and closed in
    a loop (repro_ctrl_c_lost_in_fork_hook.py): the KeyboardInterrupt is
    never lost in a fork hook; the program leaves its loop within 5 s, and
    its processes are gone within 2 s of its exit.  Alternately to the
    group (a terminal's Ctrl-C) and to main alone."""
    rng = rng_for("ctrl-c-start-up")
    for rep in range(count):
        prog = Program(START_LOOP)
        try:
            prog.wait_for("ready", 30)
            time.sleep(rng.uniform(0, 0.3))   # 1-3 start-ups of 8 workers
            sent = time.monotonic()
            prog.signal(signal.SIGINT, group=rep % 2 == 0)
            code = prog.wait(5)
            assert code is not None, (f"rep {rep}: SIGINT lost: still running 5 s later, "
                                      f"{sum(line.startswith('epoch') for line in prog.stdout())} "
                                      f"epochs; stderr: {prog.stderr()[-2000:]}")
            assert code == 0 and "interrupted" in prog.stdout(), (rep, code, prog.stderr())
            assert prog.stderr() == "", prog.stderr()
            assert_nothing_left(prog, since=prog.exited_at, within=2.0)
            record("R7", "Ctrl-C during start-ups of 8 workers: never lost in a fork",
                   prog.exited_at - sent, what="signal → main exited")
        finally:
            prog.cleanup()


# --- deaths of the loader's children (R2, R5) --------------------------------------------

WORK = 0.0005  # seconds per sample: a little work, so that deaths land mid-batch


def _epoch_snapshot(loader, n, batch_size, first=None):
    """Batches of epoch after epoch (the first from iterator `first`, if
    given), each checked: every sample once, in order."""
    while True:
        done = 0
        it, first = (first if first is not None else iter(loader)), None
        for b in it:
            assert b[:, 0].tolist() == list(range(done, min(n, done + batch_size)))
            done += len(b)
            yield b
        assert done == n


def _victims(loader, which: str):
    workers = [c for c in loader._session.procs if c.role != BATCHER]
    batcher = [c for c in loader._session.procs if c.role == BATCHER]
    return {"one worker": workers[1:2], "all workers": workers, "the batcher": batcher,
            "everything": workers + batcher}[which]


def _is_dead(pid: int) -> bool:
    """Our child has ended (a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@contextlib.contextmanager
def _forked_without_fault_dumps(config):
    """Children forked inside do not inherit pytest's faulthandler, which
    would print the whole pytest stack to the terminal for every SIGSEGV
    this test sends them."""
    was = faulthandler.is_enabled()
    faulthandler.disable()
    try:
        yield
    finally:
        if was:
            try:
                from _pytest.faulthandler import fault_handler_stderr_fd_key
                faulthandler.enable(file=config.stash[fault_handler_stderr_fd_key])
            except (ImportError, KeyError):
                faulthandler.enable(file=sys.__stderr__)


@pytest.mark.pairwise  # the default run: a pairwise-covering subset (conftest.py); all with -m stress
@pytest.mark.parametrize("count", reps(1, 10))
@pytest.mark.parametrize("moment", ["between-batches", "while-main-waits"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
@pytest.mark.parametrize("which", ["one worker", "all workers", "the batcher", "everything"])
def test_child_killed_at_a_random_moment_raises_worker_error(which, how, moment, count,
                                                             pytestconfig):
    """A worker, every worker, the batcher, or all of them die by a signal
    at a random moment (right after iter(), mid-epoch, around an epoch's end
    and its run-ahead): main raises WorkerError within 2 s, never a raw
    shmq error nor a hang, naming role, pid and signal; close() then works
    and leaves nothing.  between-batches: main is between two batches while
    the children die (every victim is named); while-main-waits: they die
    while main waits in next() (at least the first death is named)."""
    rng = rng_for(f"child-{which}-{how.name}-{moment}")
    for rep in range(count):
        loader = ShmLoader(Filled(96, delay=WORK), batch_size=8, num_workers=3)
        killer = batches = None
        try:
            with _forked_without_fault_dumps(pytestconfig):
                batches = _epoch_snapshot(loader, 96, 8, iter(loader))  # iter() forks the children
            # 0: right after the fork, the children maybe still starting; 12 batches an epoch
            for _ in range(rng.randrange(30)):
                next(batches)
            victims = _victims(loader, which)
            others = [c.pid for c in loader._session.procs if c not in victims]

            def kill():
                for c in victims:
                    os.kill(c.pid, how)

            if moment == "between-batches":
                kill()
                assert wait_until(lambda: all(_is_dead(c.pid) for c in victims), 5)
                t0 = time.monotonic()
            else:
                killer = threading.Timer(rng.uniform(0, 0.05), kill)
                killer.start()
                t0 = time.monotonic()  # at most 0.05 s before the kill
            with pytest.raises(WorkerError) as info:
                for _ in range(100_000):
                    next(batches)
            elapsed = time.monotonic() - t0
            assert type(info.value) is WorkerError, repr(info.value)
            assert elapsed < 2.0 + (0.05 if killer else 0), (rep, elapsed)
            text = str(info.value)
            named = [c for c in victims
                     if f"{c.role} (pid {c.pid}) was killed by signal {how.name}" in text]
            if moment == "between-batches":
                assert named == victims, (rep, text)
            else:
                assert named, (rep, text)
            assert all(f"(pid {pid}) was killed" not in text for pid in others), text
            pids = [c.pid for c in loader._session.procs]
            loader.close()
            assert not set(pids) & set(descendants())  # every child reaped
            assert not shm_entries_of({os.getpid(), *pids})
            record("R5" if which == "the batcher" else "R2",
                   f"{how.name} to {which}, {moment}: WorkerError naming role, pid, signal",
                   elapsed if moment == "between-batches" else None,
                   what="death → WorkerError in main")
        finally:
            if killer is not None:
                killer.cancel()
                killer.join()
            if batches is not None:
                batches.close()
            loader.close()


def test_close_right_after_a_child_died_and_before_main_noticed():
    """close() never raises because of a dead child: reporting is the
    iterator's job; close() reaps what is there."""
    loader = ShmLoader(Filled(1000, delay=WORK), batch_size=8, num_workers=2)
    it = iter(loader)
    next(it)
    pids = [c.pid for c in loader._session.procs]
    os.kill(pids[0], signal.SIGKILL)
    os.kill(pids[-1], signal.SIGKILL)
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 5.0
    assert not set(pids) & set(descendants())
    assert not shm_entries_of({os.getpid(), *pids})
    it.close()


def test_an_iterator_of_a_closed_loader_says_it_is_closed():
    """After close() (here: after a child died, the moment a user closes and
    moves on), the epoch's iterator is resumed.  Expected: the error iter()
    gives for a closed loader (ValueError: this ShmLoader is closed).
    Before the fix: KeyError: 1 from `self._inboxes[run]` in _next_of: _shutdown
    cleared the inboxes and _epoch_batches does not check _closed when it is
    resumed."""
    loader = ShmLoader(Filled(1000, delay=WORK), batch_size=8, num_workers=2)
    it = iter(loader)
    next(it)
    os.kill(loader._session.procs[0].pid, signal.SIGKILL)
    loader.close()
    with pytest.raises(ValueError, match="closed"):
        next(it)


def test_first_ready_mode_reports_a_dead_worker_within_two_seconds():
    """in_order=False: one of three workers is SIGKILLed while main
    iterates; the two others keep batches coming.  Expected: WorkerError
    naming it within 2 s (as in in-order mode, where the batch it held
    never completes).  Before the fix: no error; batches keep coming (its claimed
    sample is silently missing) until the epoch's end, here 10**6 samples
    away."""
    # A training step of 20 ms and 64 batches prefetched (1.3 s of steps):
    # main never waits on an empty ring, however loaded the machine, unless
    # the two other workers stall for over a second.
    with ShmLoader(Filled(10 ** 6), batch_size=8, num_workers=3, in_order=False,
                   prefetch=64) as loader:
        it = iter(loader)
        next(it)
        time.sleep(1.0)  # the 64 batches are loaded
        victim = loader._session.procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        assert wait_until(lambda: _is_dead(victim.pid), 5)
        t0 = time.monotonic()
        delivered = 0
        with pytest.raises(WorkerError, match=rf"worker 0 \(pid {victim.pid}\) was killed by "
                                              rf"signal SIGKILL"):
            for _ in it:
                delivered += 1
                time.sleep(0.02)
                if time.monotonic() - t0 > 3.0:
                    break
        detected = time.monotonic() - t0
        assert detected < 2.0, f"{delivered} batches later"
        record("R2", "SIGKILL to one of 3 workers, in_order=False: WorkerError although the "
               "others keep batches coming", detected, what="death → WorkerError in main")


# --- forked children of the training process (R21) ----------------------------------------

FORKS = loader_program("""
    loader = ShmLoader(Filled(2000, 8, delay=0.0005), batch_size=16, num_workers=2,
                       timeout=30)
    it = iter(loader)
    batches = [next(it)[:, 0].tolist()]
    children = {}
    for how in sys.argv[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            out = os.fdopen(w, "w")
            def say(what):
                out.write(what)
                out.flush()
            if how == "sys.exit":  # interpreter exit: atexit, finalizers, the suspended generator
                say("exiting")
                sys.exit(0)
            if how == "os._exit":
                say("exiting")
                os._exit(7)
            try:
                if how == "iter":
                    iter(loader)
                elif how == "for":
                    for b in loader:
                        pass
                elif how == "close":
                    loader.close()
                    loader.close()
                say("returned")
            except BaseException as e:
                say(f"{type(e).__name__}: {e}")
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            said = f.read()
        _, status = os.waitpid(pid, 0)
        children[how] = [said, os.waitstatus_to_exitcode(status)]
        batches.append(next(it)[:, 0].tolist())  # the epoch goes on between forks
    time.sleep(0.3)  # anything the children broke has happened by now
    codes = [p.exitcode for p in loader._session.procs]
    batches += [b[:, 0].tolist() for b in it]
    second = [b[:, 0].tolist() for b in loader]
    loader.close()
    print(json.dumps({"children": children, "codes": codes, "batches": batches,
                      "second": second}), flush=True)
""", restore_sigint=False)


def _run_to_end(code: str, *args: str, timeout: float = 60) -> Program:
    prog = Program(code, *args)
    assert prog.wait(timeout) is not None, f"still running after {timeout}s: {prog.stderr()[-3000:]}"
    return prog


def test_forked_child_exiting_or_touching_the_loader_leaves_the_epoch_intact():
    """R21: the training process forks children mid-epoch: one exits through
    interpreter exit (atexit handlers, finalizers of the inherited loader and
    its suspended generator), one with os._exit, one calls iter(loader), one
    loops over it, one closes it (twice).  The children get RuntimeError
    for iterating and nothing happens on close; the parent's epoch goes on
    with every sample once and in order: 2000 samples in 125 batches of 16,
    then a second epoch alike; its loader's processes were never touched."""
    prog = _run_to_end(FORKS, "sys.exit", "os._exit", "iter", "for", "close")
    try:
        assert prog.p.returncode == 0, prog.stderr()
        assert prog.stderr() == ""
        result = json.loads(prog.stdout()[-1])
        children = result["children"]
        assert children["sys.exit"] == ["exiting", 0]
        assert children["os._exit"] == ["exiting", 7]
        for how in ("iter", "for"):
            said, code = children[how]
            assert said.startswith("RuntimeError: this ShmLoader belongs to process "
                                   f"{prog.pid}"), said
            assert "cannot use it: create a new ShmLoader here" in said and code == 0
        assert children["close"] == ["returned", 0]
        assert result["codes"] == [None, None, None]  # its 2 workers and batcher still run
        for epoch in (result["batches"], result["second"]):
            assert len(epoch) == 125 and all(len(b) == 16 for b in epoch)
            assert [k for b in epoch for k in b] == list(range(2000))
        assert_nothing_left(prog, since=prog.exited_at, within=2.0)
    finally:
        prog.cleanup()


RESUME = loader_program("""
    # batch 0 is late (sample 3): batches 1 and 2 wait in the iterator
    loader = ShmLoader(Filled(2000, 8, delay=0.004, slow={3: 0.5}), batch_size=16,
                       num_workers=2, timeout=5)
    it = iter(loader)
    batches = [next(it)[:, 0].tolist()]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        time.sleep(1.0)  # the parent is a few batches further by now
        try:
            b = next(it)
            said = f"got a batch starting at sample {int(b[0, 0])}"
        except BaseException as e:
            said = f"{type(e).__name__}: {e}"
        os.write(w, said.encode())
        os._exit(0)
    os.close(w)
    error = None
    try:
        for b in it:
            batches.append(b[:, 0].tolist())
    except Exception as e:
        error = f"{type(e).__name__}: {str(e)[:200]}"
    with os.fdopen(r) as f:
        said = f.read()
    os.waitpid(pid, 0)
    loader.close()
    print(json.dumps({"child": said, "error": error, "batches": batches}), flush=True)
""", restore_sigint=False)


def test_forked_child_resuming_the_parents_iterator_gets_runtime_error():
    """R21: a child forked mid-epoch calls next() on the parent's iterator
    (the one its parent is using).  Expected: RuntimeError (as iter(loader)
    gives), and the parent's epoch unaffected: 125 batches, every sample
    once in order.  Before the fix: the child gets a batch the parent had buffered
    (batch 1, whose slab the parent has reused meanwhile: it starts at
    another sample than 16) and stores LIMIT = (2 + prefetch) x 16 into the
    run's shared control words, below the parent's position: the workers
    stop loading and the parent gets LoaderTimeout after ~30 batches.  When
    nothing is buffered the child's next() reaches the ring, gets shmq's
    'already has a consumer' error, and the generator's finally block
    (`if os.getpid() != self._owner_pid: return`) swallows it: a silent
    StopIteration.  Cause: _epoch_batches checks the owner only in its
    finally, not when it is resumed."""
    prog = _run_to_end(RESUME)
    try:
        result = json.loads(prog.stdout()[-1])
        assert result["error"] is None, result["error"]
        assert result["child"].startswith("RuntimeError: this ShmLoader belongs to process"), \
            result["child"]
        assert [k for b in result["batches"] for k in b] == list(range(2000))
    finally:
        prog.cleanup()


# --- start-up failures (R17) ----------------------------------------------------------------

START_FAILURE = loader_program("""
    def fds():  # with fstat: listing /proc/self/fd would need a free descriptor
        found = []
        for fd in range(4096):
            try:
                os.fstat(fd)
                found.append(fd)
            except OSError:
                pass
        return found

    def attempt(workers):
        before = fds()
        # main waits for the first batch on an empty ring: sample 0 is late
        loader = ShmLoader(Filled(64, slow={0: 0.3}), batch_size=8, num_workers=workers)
        try:
            samples = [int(k) for b in loader for k in b[:, 0]]
            outcome = ["ok", samples == list(range(64))]
        except Exception as e:
            outcome = [type(e).__name__, str(e)]
        try:
            loader.close()
            closed = "closed"
        except BaseException as e:
            closed = f"close raised {type(e).__name__}: {e}"
        return {"outcome": outcome, "close": closed, "fds_before": before, "fds_after": fds()}

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    mode = sys.argv[1]
    results = {}
    if mode == "limit":
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), hard))
        results["24"] = attempt(24)
        results["24"]["children"] = [pid for pid, _ in children()]
        results["2"] = attempt(2)
        results["2"]["children"] = [pid for pid, _ in children()]
    elif mode == "sweep":  # every limit from nothing free to enough for all
        for extra in range(0, 2 * 6 + 12):
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(fds()) + 1 + extra, hard))
            results[str(extra)] = attempt(5)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            results[str(extra)]["children"] = [pid for pid, _ in children()]
    elif mode == "none-free":  # every descriptor below the limit in use
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(fds()) + 1, hard))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        results["0"] = attempt(2)
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        results["0"]["children"] = [pid for pid, _ in children()]
    print(json.dumps(results), flush=True)
""", names=("LoaderStartError", "ShmLoader"), restore_sigint=False)


def _start_failure(*args: str) -> dict:
    prog = _run_to_end(START_FAILURE, *args)
    try:
        assert prog.p.returncode == 0, prog.stderr()
        return json.loads(prog.stdout()[-1])
    finally:
        prog.cleanup()


def _assert_start_error(result: dict) -> None:
    kind, text = result["outcome"]
    assert kind == "LoaderStartError", result["outcome"]
    assert "`ulimit -n`" in text and "Too many open files" in text, text
    assert result["close"] == "closed"
    assert result["fds_after"] == result["fds_before"]
    assert result["children"] == []


def test_start_failure_at_the_fd_limit_names_ulimit_and_leaves_nothing():
    """R17: with `ulimit -n 48`, 24 workers cannot start: LoaderStartError
    naming `ulimit -n`; afterwards the same fds are open as before, no child
    is left, close() raises nothing, and a loader of 2 workers then works in
    the same process (every sample once, in order)."""
    results = _start_failure("limit", "48")
    _assert_start_error(results["24"])
    assert "of 25 started" in results["24"]["outcome"][1]
    assert results["2"]["outcome"] == ["ok", True]
    assert results["2"]["close"] == "closed" and results["2"]["children"] == []
    assert results["2"]["fds_after"] == results["24"]["fds_before"]


@functools.lru_cache(maxsize=None)
def _sweep() -> dict[int, dict]:
    """Outcomes of starting 5 workers under every soft fd limit from none
    free to plenty (keys: fds free at the start)."""
    return {int(k): v for k, v in _start_failure("sweep").items()}


def test_start_at_every_fd_limit_leaves_no_child_and_close_works():
    """R17 swept: whatever the limit, once starting failed (or the loader
    worked) close() raises nothing and no child is left; with enough fds
    the loader works."""
    results = _sweep()
    assert all(r["close"] == "closed" and r["children"] == [] for r in results.values()), results
    assert results[max(results)]["outcome"] == ["ok", True]
    assert any(r["outcome"][0] == "LoaderStartError" for r in results.values())
    record("R17", "start of 5 workers at every fd limit from none free to enough: "
           "LoaderStartError or a working loader, no child or fd left", count=len(results))


def test_start_failure_with_no_fd_free_names_ulimit():
    """R17 at the edge: every descriptor below the limit is in use (a
    process that leaks fds).  Expected: LoaderStartError naming `ulimit -n`,
    nothing left.  Before the fix: OSError: [Errno 24] Too many open files, raised
    by os.memfd_create (or the rings' memfds) in SharedState.__init__
    (shared/memory.py), which _start calls outside fork_children's EMFILE
    handling; the same with 1 or 2 fds free."""
    _assert_start_error(_start_failure("none-free")["0"])


def test_a_start_failure_at_any_fd_limit_leaves_no_fd_open():
    """R17 swept: after a failed start, the process has exactly the fds it
    had before.  Before the fix: with 1 fd free, one more fd is open afterwards,
    for good.  Cause: SharedState.__init__ does `self.order_fds =
    [os.memfd_create(...) for _ in range(2)]`; when the second call fails
    the list is never assigned, so `self.close()` in its except clause
    cannot close the first memfd."""
    results = _sweep()
    leaks = {free: (r["fds_before"], r["fds_after"]) for free, r in results.items()
             if r["fds_after"] != r["fds_before"]}
    assert leaks == {}


def test_the_smallest_fd_limit_that_fits_every_child_gives_a_working_loader():
    """R17 swept: at the smallest limit where every child can be forked,
    main is left with no fd free.  Expected: the loader works (64 samples
    in order) - or at worst LoaderStartError naming `ulimit -n`.  Before the fix:
    main's first get() on to_main waits on an empty ring (sample 0 is slow)
    and checks whether its producers live: shmq_proc_starttime
    (shmq_ring.h) cannot open /proc/<pid>/stat (EMFILE) and returns 0,
    which shmq_owner_alive takes for 'dead', so shmq_retire_if_dead retires
    every live producer as GONE (irreversibly) and get() raises PeerLost:
    WorkerError 'the batcher's ring to main ended (... 6 producer(s) died
    without closing ...) while every process is still running'."""
    results = _sweep()
    started = [free for free, r in sorted(results.items())
               if r["outcome"][0] not in ("LoaderStartError", "OSError")]
    first = results[started[0]]
    assert first["outcome"] == ["ok", True], (started[0], first["outcome"])


FD_STARVED_CONSUMER = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    import shmq

    q = shmq.Queue(4096, anonymous=True)
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the producer: alive all along, puts once told to
        os.close(go_w)
        os.read(go_r, 1)
        q.put(np.arange(3))
        q.close()
        os._exit(0)
    os.close(go_r)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    try:
        q.get(timeout=0.3)
        print("starved: got a message", flush=True)
    except Exception as e:
        print(f"starved: {type(e).__name__}", flush=True)
    for fd in held:
        os.close(fd)
    os.write(go_w, b"x")
    try:
        print(f"after: {q.get(timeout=10).tolist()}", flush=True)
    except Exception as e:
        print(f"after: {type(e).__name__}", flush=True)
    os.waitpid(pid, 0)
    q.close()
""")


def test_a_consumer_out_of_fds_does_not_take_live_producers_for_dead():
    """The cause of the failure above, in shmq alone: a consumer with every
    fd in use waits on an empty ring whose producer is alive.  Expected:
    Empty after the timeout, then, with fds free again, the producer's
    message.  Before the fix: PeerLost at once (shmq_proc_starttime returned 0 when
    open() fails for any reason, and shmq_owner_alive reads 0 as 'no such
    process'), and the producer's slot stays retired: the later get() sees
    no producer left either."""
    prog = _run_to_end(FD_STARVED_CONSUMER, timeout=30)
    try:
        assert prog.stdout()[:2] == ["starved: Empty", "after: [0, 1, 2]"], \
            (prog.stdout(), prog.stderr()[-2000:])
    finally:
        prog.cleanup()


# --- Ctrl-C inside the loader's own start-up and shutdown -------------------------------

CTRL_C_IN_FORK = loader_program("""
    # A Ctrl-C that arrives while the 3rd child is being forked: SIGINT is
    # blocked around fork(), so it is pending when fork() returns.
    real_fork, forks = os.fork, [0]
    def fork():
        pid = real_fork()
        if pid:
            forks[0] += 1
            if forks[0] == 3:
                os.kill(os.getpid(), signal.SIGINT)
        return pid
    os.fork = fork

    loader = ShmLoader(Filled(64), batch_size=8, num_workers=4)
    try:
        iter(loader)
        print("no KeyboardInterrupt", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    loader.close()
    time.sleep(1.0)  # far longer than a child needs to exit
    print("children", *[state for _, state in children()], flush=True)
""")


def test_ctrl_c_during_a_fork_leaves_no_child_behind():
    """A Ctrl-C arriving while a child is forked (made deterministic: the
    program SIGINTs itself inside the 3rd fork, while SIGINT is blocked).
    Expected: KeyboardInterrupt from iter(), the 2 children already started
    killed and reaped, and the one being forked too: no child left.
    Before the fix: one child left running (state S) for as long as the process
    lives.  Cause: in procs._fork the parent's `finally:
    signal.pthread_sigmask(SIG_SETMASK, old_mask)` unblocks SIGINT, and
    CPython's pthread_sigmask runs the handler at once: KeyboardInterrupt
    leaves _fork before `Child(role, pid, ...)` exists, so fork_children's
    cleanup never sees that pid.  Seen in about half of random Ctrl-Cs
    during start-up with 8 workers (the 'interrupted at pthread_sigmask'
    case); harmless when the program then exits (the child dies with it),
    a leaked process in a notebook or a retry loop."""
    prog = _run_to_end(CTRL_C_IN_FORK, timeout=30)
    try:
        assert prog.stdout() == ["interrupted", "children"], (prog.stdout(), prog.stderr())
    finally:
        prog.cleanup()


CTRL_C_IN_CLOSE = loader_program("""
    # close() will wait for sample 40
    loader = ShmLoader(Filled(10 ** 6, slow={40: 3}), batch_size=8, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    time.sleep(0.5)  # a worker is inside dataset[40] by now
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # a Ctrl-C
    try:
        loader.close()
        print("close returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    t0 = time.monotonic()
    loader.close()  # again, now that the user waits for it
    print(f"second close took {time.monotonic() - t0:.1f}", flush=True)
    print("children", *[state for _, state in children()], flush=True)
""")


def test_close_again_after_ctrl_c_in_close_reaps_every_child():
    """Ctrl-C while close() waits for a worker still inside dataset[i] (a
    natural moment to press it: close takes up to JOIN_TIMEOUT_S).
    Expected: KeyboardInterrupt, then a second close() finishes the
    shutdown: every child stopped and reaped.  Before the fix: the second close()
    returns at once (`_closed` was set before `_shutdown` ran) and the 3
    children stay: zombies, and the worker in dataset[40] until its sample
    ends, for the life of the process.  __del__ and the atexit handler skip
    the loader for the same reason."""
    prog = _run_to_end(CTRL_C_IN_CLOSE, timeout=30)
    try:
        out = prog.stdout()
        assert out[0] == "interrupted", (out, prog.stderr())
        assert out[2] == "children", out
    finally:
        prog.cleanup()


CTRL_C_IN_FINALIZER = loader_program("""
    loader = ShmLoader(Filled(10 ** 6), batch_size=8, num_workers=2)
    it = iter(loader)
    next(it)
    from loader import _native
    _native._raise_sigint_on_release(1)  # a Ctrl-C arrives while a batch's slab is released
    steps = 0
    def train_step(batch):
        return batch.sum()
    try:
        for b in it:  # the previous batch dies here: its finalizer runs
            steps += 1
            train_step(b)  # see the note below on Python 3.13
            if steps == 200:
                break
        print("not interrupted", steps, flush=True)
    except KeyboardInterrupt:
        print("interrupted", steps, flush=True)
    loader.close()
""")


def test_ctrl_c_while_a_batch_is_released_interrupts_the_loop():
    """R7: found by test_ctrl_c_to_main_at_a_random_moment[ahead] (seed
    567455326): a SIGINT that arrived while a batch's slab finalizer (then
    Python: weakref.finalize) ran was printed as 'Exception ignored in:
    <finalize object>' and dropped, and the training loop went on.  The
    release is compiled now (LeaseBook in native/leases.pxi) and runs no Python
    bytecode: here the SIGINT is raised from inside it (a compiled test
    hook), the moment the training loop drops the previous batch, and
    KeyboardInterrupt must reach the loop at once, with nothing on stderr.

    The loop calls a function per step, as training loops do: CPython 3.13
    skips a try's handlers for a KeyboardInterrupt raised at a loop's
    back-edge (python/cpython#130279; a pure-Python loop with a timer
    sending SIGINT shows it, no loader needed), and in a loop of nothing but
    `steps += 1` the back-edge is where a signal pending since the release
    is raised."""
    prog = _run_to_end(CTRL_C_IN_FINALIZER, timeout=30)
    try:
        out = prog.stdout()
        assert len(out) == 1 and out[0].startswith("interrupted ") and int(out[0].split()[1]) < 5, \
            (out, prog.stderr()[-2000:])
        assert prog.stderr() == ""
    finally:
        prog.cleanup()


CTRL_C_IN_QUEUE = textwrap.dedent("""
    import gc, os, signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import shmq
    from shmq import queue

    site = queue._creation_site
    def creation_site():  # a Ctrl-C that arrives while Queue() records where it was made
        os.kill(os.getpid(), signal.SIGINT)
        return site()
    queue._creation_site = creation_site
    try:
        shmq.Queue(4096, anonymous=True)
        print("created", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    gc.collect()
    print("done", flush=True)
""")


def test_ctrl_c_inside_queue_creation_says_nothing_more():
    """Found by test_ctrl_c_to_main_at_a_random_moment (start-up): stderr
    'Exception ignored in: <function Queue.__del__> ... AttributeError:
    'Queue' object has no attribute '_site''.  Made deterministic: the
    SIGINT arrives while Queue._setup runs (after `self._ring = ring`,
    before `self._site = ...`).  Expected: KeyboardInterrupt, and nothing on
    stderr (the half-made handle closed quietly).  Before the fix: __del__ found
    an open ring and formats its ResourceWarning with self._site, which was
    never set: AttributeError, printed as unraisable."""
    prog = _run_to_end(CTRL_C_IN_QUEUE, timeout=30)
    try:
        assert prog.stdout() == ["interrupted", "done"], prog.stdout()
        assert prog.stderr() == "", prog.stderr()
    finally:
        prog.cleanup()
