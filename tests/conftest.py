"""Fixtures shared by every test.

- ``shm_guard`` (autouse): lists our entries in /dev/shm before and after each
  test and fails the test if one made by this test's process tree is left
  (after up to 5 s for teardown).  Segments of other programs running at the
  same time are not ours: a segment's name carries its creator's pid.
- ``no_leftover_processes`` (autouse): fails the test if a process it
  started (a descendant of the test process) is still there, running or a
  zombie, 5 s after it ended.
- under pytest-xdist, a test marked ``alone`` runs while the other worker
  runs no test (``pytest_runtest_protocol`` below); every other test runs
  beside the other worker's.
- ``procs``: starts child processes (fork, spawn, or a fresh interpreter) and
  at teardown joins them with a timeout; a hung child's stacks are dumped
  (faulthandler on SIGUSR1) before it is killed and the test fails.  A test
  that ends with a live or zombie child fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmq import segment

JOIN_TIMEOUT_S = 30.0
LEAK_GRACE_S = 5.0


def our_shm_entries() -> set[str]:
    return {e for e in os.listdir(segment.SHM_DIR)
            if e.startswith(segment.PREFIX) or (e.startswith("sem.") and segment.PREFIX in e)}


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process we can see."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(root: int | None = None) -> dict[int, str]:
    """pid -> state of every descendant of root (default: this process)."""
    root = os.getpid() if root is None else root
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    return found


# pids of processes started by tests (for the /dev/shm guard's attribution)
_started_pids: set[int] = set()


def segment_pid(entry: str) -> int | None:
    """The creator pid a /dev/shm entry's name carries, if any."""
    for part in entry[len(segment.PREFIX):].split("-"):
        if part.isdigit():
            return int(part)
    return None


_segment_pid = segment_pid  # the name tests/support/killkit.py imports


@contextlib.contextmanager
def _alone_or_shared(item):
    """Under pytest-xdist (pyproject's `-n 2`), a test marked `alone` holds
    the run's lock file exclusively, every other test shared: a test that
    judges the machine's load (the autoscaler's) does not see the other
    worker's test. The turn lock makes a waiting `alone` test the next to
    run: no shared test starts past it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    run_dir = Path(item.config.option.basetemp).parent  # xdist gives each worker a folder in it
    mode = fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH
    with open(run_dir / "turn.lock", "a") as turn, open(run_dir / "tests.lock", "a") as tests:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(tests, mode)
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(tests, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside every other wrapper of a test's run: the wait for its turn is
    not counted by its time limit (pytest-timeout) nor faulthandler_timeout,
    and the lock spans its set-up, guards and teardown."""
    with _alone_or_shared(item):
        return (yield)


@pytest.fixture(autouse=True)
def shm_guard():
    before = our_shm_entries()
    tree = {os.getpid(), *descendants()}
    yield
    deadline = time.monotonic() + LEAK_GRACE_S

    def leaked_by_us():
        ours = tree | set(descendants()) | _started_pids
        return {e for e in our_shm_entries() - before if segment_pid(e) in ours}

    leaked = leaked_by_us()
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        tree.update(descendants())
        leaked = leaked_by_us()
    for entry in leaked:  # so one leak does not fail every later test
        segment.unlink("/" + entry)
    assert not leaked, f"test left entries in /dev/shm: {sorted(leaked)}"


def _is_multiprocessing_helper(pid: int) -> bool:
    """multiprocessing's resource tracker and forkserver live for the whole
    session once a test has used spawn or forkserver: not a leak."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"multiprocessing.resource_tracker" in cmdline or b"multiprocessing.forkserver" in cmdline


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = set(descendants())

    def left_by_test():
        return {p: s for p, s in descendants().items()
                if p not in before and not _is_multiprocessing_helper(p)}

    yield
    # Finalizers that stop processes (a loader in a reference cycle) run now,
    # in the test that made them.  Then whatever survived the collection is
    # frozen (gc.freeze): it outlives the test (imports, session fixtures),
    # and the next test's collection scans only what that test makes.  With
    # torch, Lightning and datasets imported, a full collection takes 0.24 s;
    # once per test, that was a quarter of the suite's time.
    gc.collect()
    gc.freeze()
    deadline = time.monotonic() + LEAK_GRACE_S
    left = left_by_test()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = left_by_test()
    for pid in left:  # so one leftover does not fail every later test
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, os.WNOHANG)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert not left, f"processes started by the test are still there (pid: state): {left}"


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
        _started_pids.add(p.pid)
        return p

    def python(self, code: str, *args: str) -> subprocess.Popen:
        """An independently started interpreter (not forked from us)."""
        p = subprocess.Popen([sys.executable, "-c", _CHILD_PRELUDE + code, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._children.append(p)
        _started_pids.add(p.pid)
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


# A real S3 server for the tests that name these fixtures: `s3_server` (one
# SeaweedFS `weed mini` per test module; skips if `weed` is not installed)
# and `s3_bucket` (a fresh bucket per test). See tests/support/s3server.py,
# also for why the module-scoped server does not trip no_leftover_processes.
from s3server import s3_bucket, s3_server  # noqa: E402,F401
from pairwise import covering_subset, parameters_of  # noqa: E402


# The long tier: cases the default run leaves to `-m stress` (docs/developing.md),
# each beside a shorter case of the same behaviour that stays in the default run,
# so that the default run keeps to about ten minutes on two cores.  By node id
# (a parameter's id included), with a comment naming the sibling that stays; a
# whole module by its path.  A parametrized grid whose cases are all long is
# marked `@pytest.mark.pairwise` in its file instead: the default run keeps a
# pairwise-covering subset of it (mark_beyond_a_pairwise_subset below,
# tests/support/pairwise.py), the long tier the rest.  See tests/README.md.
LONG_TIER = {
    "tests/torch_layer/test_ray.py",  # a Ray cluster's start alone is a minute and a half
    "tests/loader_layer/test_hostile_limits.py::test_a_3_gib_single_sample_arrives_whole",
    "tests/loader_layer/test_warmup.py::test_pages_are_resident_ahead_of_the_writers",
    "tests/torch_layer/test_frameworks.py::test_lightning_mid_epoch_checkpoint_resumes_every_sample_once[ddp-mid-epoch0]",
    "tests/torch_layer/test_frameworks.py::test_lightning_mid_epoch_checkpoint_resumes_every_sample_once[ddp-mid-epoch1]",
    "tests/torch_layer/test_frameworks.py::test_lightning_mid_epoch_checkpoint_resumes_every_sample_once[1dev-mid-epoch0]",
    "tests/torch_layer/test_frameworks.py::test_lightning_trains_on_the_loader_with_exact_shards[2]",
    "tests/loader_layer/test_scale.py::test_a_10m_epoch_resumes_from_a_few_hundred_bytes_exactly[False]",
    "tests/loader_layer/test_scale.py::test_the_loader_gives_the_order_whatever_the_workers_and_mode",
    "tests/loader_layer/test_scale.py::test_a_billion_index_sampler_starts_at_once_and_resumes[True-0]",
    "tests/loader_layer/test_scale.py::test_the_order_near_2_31_and_2_33_is_injective_on_large_samples[8589934599]",
    "tests/loader_layer/test_scale.py::test_the_order_near_2_31_and_2_33_is_injective_on_large_samples[2147483648]",
    "tests/loader_layer/test_scale.py::test_the_order_near_2_31_and_2_33_is_injective_on_large_samples[8589934587]",
    "tests/remote_layer/test_remote_files.py::test_kill_9_at_random_moments_leaves_a_cache_that_serves_exactly[fetcher]",
    # (long: 8 kills each; test_a_fetcher_killed_* stays in the default run.
    # Its temp files found after recover() were the test's: it took the killed
    # fetcher's zombie first thread for the whole process; it waits on a pidfd now)
    "tests/remote_layer/test_remote_files.py::test_kill_9_at_random_moments_leaves_a_cache_that_serves_exactly[main]",
    "tests/remote_layer/test_remote_files.py::test_two_thousand_objects_three_shuffled_epochs[thread-True]",
    "tests/remote_layer/test_remote_files.py::test_two_thousand_objects_three_shuffled_epochs[process-False]",
    "tests/loader_layer/test_kept_batches.py::test_keeping_every_label_of_200000_samples_under_a_64_mib_cap[thread]",
    "tests/loader_layer/test_stats.py::test_the_readme_example_under_other_programs_gives_no_stall_advice",
    "tests/loader_layer/test_stream_samplers.py::test_a_hundred_million_keys_start_at_once_in_bounded_memory",
    "tests/loader_layer/test_loader_control.py::test_300k_samples_over_several_epochs_with_a_slow_step[True]",
    "tests/loader_layer/test_first_ready_failures.py::test_every_good_sample_once_and_every_failure_raised_once[threads-stretch]",
    "tests/loader_layer/test_first_ready_failures.py::test_every_good_sample_once_and_every_failure_raised_once[threads-most]",
    "tests/repo/test_s3_infrastructure.py::test_proxy_passes_1000_objects_through_byte_exact_on_reused_connections",
    # unbatched through torch's own 2 workers, sample by sample, for the expected order;
    # siblings in the default run: [True-None-2] (unbatched, 2 workers) and
    # [False-64-2] (torch's global generator, 2 workers)
    "tests/loader_layer/test_stream_samplers.py::test_dataloader_shuffle_is_torchs_order_without_iterating_its_sampler[False-None-2]",
    # two workers of 1 MB texts; [1] and [8] (more workers than cores) stay
    "tests/loader_layer/test_kept_batches.py::test_batches_of_64_texts_of_1_mb[2]",
    # 2**31 - 1 stays beside 2**31 + 1 ([2147483649]), which crosses int32
    "tests/loader_layer/test_scale.py::test_the_order_near_2_31_and_2_33_is_injective_on_large_samples[2147483647]",
    # first-ready with two workers; [True-2] (workers) and [False-0] (first-ready) stay
    "tests/loader_layer/test_scale.py::test_a_billion_index_sampler_starts_at_once_and_resumes[False-2]",
    # eight ranks; [1], [2] and [3] (an uneven share) stay
    "tests/loader_layer/test_scale.py::test_distributed_loaders_share_each_epoch_exactly[8]",
}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not stress'` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in LONG_TIER or item.nodeid.split("::")[0] in LONG_TIER:
            item.add_marker(pytest.mark.stress)
    mark_beyond_a_pairwise_subset(items)


def mark_beyond_a_pairwise_subset(items) -> None:
    """A test marked `pairwise` keeps a covering subset of its grid's default
    cases in the default run and gives the rest to the long tier
    (tests/support/pairwise.py).  Cases already in the long tier are not
    counted: what they hold must meet again in a default case."""
    grids = {}
    for item in items:
        if (item.get_closest_marker("pairwise") and hasattr(item, "callspec")
                and not item.get_closest_marker("stress")):
            grids.setdefault(item.nodeid.split("[")[0], []).append(item)
    for grid in grids.values():
        among = grid[0].get_closest_marker("pairwise").kwargs.get("among")
        kept = set(covering_subset([parameters_of(item) for item in grid], among))
        for i, item in enumerate(grid):
            if i not in kept:
                item.add_marker(pytest.mark.stress)
