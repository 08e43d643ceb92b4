"""The loader's child processes: forking them safely (or starting them
clean: start_method="spawn"), knowing how they ended, and ending them.
See NOTE [ ShmLoader processes and shutdown ] in shared/messages.py and
NOTE [ Starting clean ] in shared/passable.py."""

from __future__ import annotations

import errno
import faulthandler
import importlib
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import subprocess
import resource
import re
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import NamedTuple

from loader import _native
from loader.errors import ArgumentTypeError, LoaderStartError
from loader.shared import passable
from loader.shared.optional import imported_torch

# Caught in C by every child (_native.pyx): its parent thread or process
# ended.  A real-time signal, so it is not one a dataset is likely to use.
PARENT_DEATH_SIGNAL = signal.SIGRTMAX - 2
_BLOCKED_AROUND_FORK = {signal.SIGINT, signal.SIGTERM}
REAPED_ELSEWHERE = 1 << 16  # not an exit code: the status went to someone else


class Role(NamedTuple):
    """Who a child (process or thread) is: a worker, by its id, or the
    batcher (worker None).  str() is how messages name it."""
    worker: int | None = None

    def __str__(self) -> str:
        return "the batcher" if self.worker is None else f"worker {self.worker}"


BATCHER = Role()


class Child:
    """One forked child: its pid, a pidfd to wait on, and its report file
    (faulthandler stacks on SIGUSR1, and the traceback of an exception that
    ended it)."""

    __slots__ = ("role", "pid", "pidfd", "report", "_code")

    def __init__(self, role: Role, pid: int, pidfd: int | None, report):
        self.role, self.pid, self.pidfd, self.report = role, pid, pidfd, report
        self._code = None

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit code, or -signal, once it ended."""
        if self._code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (an os.wait() in main?)
                self._code = REAPED_ELSEWHERE
                return self._code
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def how_it_ended(self) -> str:
        code = self.exitcode
        if code is None:
            return "is still running"
        if code == REAPED_ELSEWHERE:
            return ("exited, and its exit status was collected by other code in this process "
                    "(an os.wait() or os.waitpid(-1, ...) reaps the loader's children too)")
        if code < 0:
            name = signal.Signals(-code).name
            hint = (" (SIGKILL is often the out-of-memory killer: check `dmesg`, use smaller "
                    "batches or fewer workers)" if code == -signal.SIGKILL else "")
            return f"was killed by signal {name}{hint}"
        return f"exited unexpectedly with exit code {code}"

    def last_words(self, limit: int = 6000) -> str:
        """What it wrote to its report file (a traceback, stacks), if anything."""
        try:
            self.report.seek(0)
            text = self.report.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return text[-limit:]

    def kill(self) -> None:
        if self.exitcode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.report.close()


# The thread advice is given once per process (a flag, not the warnings
# registry, which is the user's: see _fork_quietly).
_advised_threads = False

# Python 3.12+ warns (DeprecationWarning) about forking a multi-threaded
# process; native thread pools (torch's) are safe to fork around, and the
# loader advises about Python threads itself (fork_children).
_FORK_WARNING = ("ignore", re.compile(r".*multi-threaded.*fork", re.I), DeprecationWarning,
                 None, 0)


def _risky_threads() -> int:
    """Python threads besides this one that could hold a lock across the
    fork, and that the user could have avoided starting (the advice says to
    create the loader before them).  Not counted:
    - tqdm's monitor: every progress bar starts it (datasets' save_to_disk,
      map, from_parquet), it only sleeps on an event and takes tqdm's own
      lock, which a worker does not need;
    - a Ray worker's own threads: Train V2 runs the training function in a
      thread of its own while the main thread serves Ray's calls, beside
      Ray's GC and monitoring threads; none of them is the user's to move,
      and they hold Ray's locks, which a worker does not take."""
    me = threading.current_thread()
    in_ray_worker = _is_ray_worker()
    return sum(1 for t in threading.enumerate()
               if t is not me and type(t).__module__ != "tqdm._monitor"
               and not (in_ray_worker and _is_rays(t)))


def _is_ray_worker() -> bool:
    """This process is a Ray worker (an actor or task process, not the driver)."""
    worker = sys.modules.get("ray._private.worker")
    return worker is not None and getattr(worker.global_worker, "mode", None) == getattr(
        worker, "WORKER_MODE", object())


def _is_rays(t: threading.Thread) -> bool:
    """A thread of a Ray worker that Ray started: its main thread (Ray's task
    loop), or one whose class or target is Ray's."""
    if t is threading.main_thread():
        return True
    target = getattr(t, "_target", None)
    return any(str(getattr(x, "__module__", "") or "").startswith("ray.")
               for x in (type(t), target))


def start_children(specs, start_method: str, shared=None, advise: bool = True) -> list[Child]:
    """fork_children, or spawn_children for start_method="spawn" (shared:
    the SharedState the specs' args hold)."""
    if start_method == "spawn":
        return spawn_children(specs, shared)
    return fork_children(specs, advise)


def fork_children(specs, advise: bool = True) -> list[Child]:
    """Fork one child per (role, target, args); each runs target(*args) and
    exits.  If any fork fails, the children already started are killed and
    reaped and every file closed, then LoaderStartError is raised.
    advise=False: no warning about other threads (loader.DataLoader gives
    none that torch's does not give)."""
    global _advised_threads
    others = _risky_threads()
    if advise and not _advised_threads and others:
        _advised_threads = True  # (before: with -W error the warning raises)
        warnings.warn(
            f"ShmLoader forks {len(specs)} processes from a process running "
            f"{others + 1} threads; a lock another thread holds at the fork stays "
            f"locked in the children and can hang them. Create the loader (and iterate it once) "
            f"before starting threads, make sure they hold no locks the dataset uses, or pass "
            f"start_method='spawn' (fresh processes, nothing of this one's threads copied)",
            RuntimeWarning, stacklevel=5)  # (through start_children and Session: iter()'s frame)
    return _start_each(specs, _fork)


def spawn_children(specs, shared) -> list[Child]:
    """Start one fresh interpreter per (role, target, args), which runs
    target(*args) and exits (NOTE [ Starting clean ] in shared/passable.py):
    no fork of this process, so no lock or thread of its runtime (JAX's,
    torch's) is copied.  Every payload is pickled before any process
    starts: what cannot be pickled is an ArgumentTypeError naming it.
    shared (the SharedState in args) travels apart and is loaded first:
    the child takes its slots in the rings before it imports anything of
    the user's (a module that imports torch takes seconds), well within
    the time a reserved slot waits for its process (SHMQ_PENDING_ADOPT_NS)."""
    payloads = [_spawn_payload(target, args, shared) for role, target, args in specs]
    starts = iter(payloads)
    fds = tuple(shared.plain_fds())
    return _start_each(specs, lambda role, target, args, children: _spawn(
        role, *next(starts), fds, children))


def _start_each(specs, start) -> list[Child]:
    children: list[Child] = []
    try:
        for role, target, args in specs:
            start(role, target, args, children)
    except BaseException as e:
        for c in children:
            c.kill()
        wait_all([c for c in children if c.pidfd is not None], 5.0)
        for c in children:
            if c.exitcode is None and c.pidfd is None:
                # Its pidfd_open failed (out of fds): nothing to wait on with
                # a bound, but a SIGKILLed child ends at once.
                os.waitpid(c.pid, 0)
            c.close()
        raise start_error(e, f"start its processes ({len(children)} of {len(specs)} started)")
    return children


def start_error(exc: BaseException, doing: str) -> BaseException:
    """What to raise when starting failed with exc: a LoaderStartError
    naming the limits for what a limit causes, else exc itself."""
    if _mapping_refused(exc):
        from loader.shared.spill import address_space_limits

        err = LoaderStartError(
            f"ShmLoader could not {doing}: {exc}. Its batch memory is mapped in every process "
            f"(memory_cap_bytes; the default is a quarter of RAM) and the system refused "
            f"the mapping ({address_space_limits()}): pass a smaller memory_cap_bytes, or "
            f"raise `ulimit -v`")
        err.__cause__ = exc
        return err
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN,
                                                  errno.ENOMEM):
        limits = f" (here: {process_limits()})" if exc.errno == errno.EAGAIN else ""
        err = LoaderStartError(
            f"ShmLoader could not {doing}: {exc}. It needs a few file descriptors for its "
            f"shared memory, and 2 and a process slot per worker. Raise the limits "
            f"(`ulimit -n`, `ulimit -u`, the pids.max of a container's cgroup){limits} or use "
            f"fewer workers")
        err.__cause__ = exc
        return err
    return exc


def _mapping_refused(exc: BaseException) -> bool:
    """A MemoryError(ENOMEM, text) of a shared mapping (_native.arena_array)."""
    return type(exc) is MemoryError and len(exc.args) == 2 and exc.args[0] == errno.ENOMEM


def process_limits() -> str:
    """The limits on the number of processes that apply to this one, in
    words: fork's EAGAIN does not say which one was hit."""
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    said = [f"`ulimit -u` is {'unlimited' if soft == resource.RLIM_INFINITY else soft}"
            + (" (not enforced for root)" if os.geteuid() == 0 else "")]
    cgroup = _pids_cgroup()
    if cgroup is not None:
        try:
            with open(os.path.join(cgroup, "pids.max")) as f:
                most = f.read().strip()
            with open(os.path.join(cgroup, "pids.current")) as f:
                now = f.read().strip()
            said.append(f"the pids cgroup {cgroup} allows {most} (pids.max), {now} in use")
        except OSError:
            pass
    return "; ".join(said)


def _pids_cgroup() -> str | None:
    """The directory of this process's pids cgroup (v1 or v2), if any."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return "/sys/fs/cgroup/pids" + path.rstrip("/")
        if controllers == "" and os.path.exists(f"/sys/fs/cgroup{path.rstrip('/')}/pids.max"):
            return "/sys/fs/cgroup" + path.rstrip("/")
    return None


def _fork(role, target, args, children: list[Child]) -> None:
    """Fork one child and append it to children before anything can raise
    in this process (a Ctrl-C held back across the fork is raised when the
    signal mask is restored: the caller must know the child by then)."""
    report = tempfile.TemporaryFile()
    parent = os.getpid()
    # Blocked across the fork: a Ctrl-C arriving now is delivered after it,
    # in main's own code, never inside an at-fork hook (Python swallows
    # exceptions raised there) and never in the child.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED_AROUND_FORK)
    pid = -1
    try:
        pid = _fork_quietly()
        if pid == 0:
            _child_main(role, parent, target, args, report, old_mask)  # never returns
        child = Child(role, pid, None, report)
        children.append(child)
        try:
            child.pidfd = os.pidfd_open(pid)
        except OSError as e:  # the caller kills and reaps the children it knows
            if e.errno == errno.ENOSYS:
                raise LoaderStartError("ShmLoader needs Linux 5.3 or later (pidfd_open) to wait "
                                       "for its processes without polling") from e
            raise
    except BaseException:
        if pid < 0:
            report.close()
        raise
    finally:
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _fork_quietly() -> int:
    """os.fork() without Python 3.12's multi-threaded fork warning (see
    _FORK_WARNING).  The filter goes into warnings.filters in place and out
    again: warnings.catch_warnings() or filterwarnings() would mark the
    filters changed, which empties every module's show-once registry, so
    warnings the program had already shown would be shown again."""
    _native.forking_own_child(True)  # no batch needs to move out first (NOTE [ Kept batch memory ])
    try:
        if sys.version_info < (3, 12):
            return os.fork()
        filters = warnings.filters
        filters.insert(0, _FORK_WARNING)
        try:
            return os.fork()
        finally:
            if _FORK_WARNING in filters:
                filters.remove(_FORK_WARNING)
    finally:
        _native.forking_own_child(False)


# The arguments of a spawned child that a user's object may be: named in
# the error when the payload cannot be pickled.
_USER_FIELDS = ("dataset", "collate_fn", "worker_init_fn")


def _spawn_payload(target, args, shared) -> tuple[bytes, set[int]]:
    """(shared, then target and args, pickled for a spawned child (each
    with its length first), the descriptors they need)."""
    try:
        early, early_fds = passable.dumps(shared)
        rest, fds = passable.dumps((target, args), early=shared)
        return len(early).to_bytes(8, "little") + early + rest, early_fds | fds
    except Exception as e:
        what = _unpicklable_part(args)
        raise ArgumentTypeError(
            f"start_method='spawn' sends {what} to each new process by pickle, and it cannot "
            f"be pickled: {type(e).__name__}: {e}. Define its class and functions at module "
            f"level (not in a function, a lambda or __main__ of an interactive session), make "
            f"it picklable (__getstate__), or use start_method='fork'") from e


def _unpicklable_part(args) -> str:
    """Which of the user's objects among args does not pickle, in words."""
    for arg in args:
        for field in _USER_FIELDS:
            value = getattr(arg, field, None)
            if value is None:
                continue
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                return f"the {field} ({_named(value)})"
    return "the loader's configuration (dataset, collate_fn, worker_init_fn)"


def _named(value) -> str:
    """A function by its qualified name, another object by its class's."""
    if hasattr(value, "__qualname__") and not isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def _spawn(role, payload: bytes, needed: set[int], fds: tuple, children: list[Child]) -> None:
    """Start one fresh interpreter for role and append it to children
    before anything can raise here (as _fork)."""
    report = tempfile.TemporaryFile()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED_AROUND_FORK)
    pid = -1
    try:
        head = pickle.dumps(SpawnHead(
            role=role, parent=os.getpid(), mask=old_mask, report_fd=report.fileno(),
            preparation=_preparation(role, needs_main=b"__main__" in payload),
            imports=_imports_of(role)))
        blob = _memfd_of(len(head).to_bytes(8, "little") + head + payload)
        try:
            # Not os.fork: fork_exec runs no at-fork hook of this process
            # (JAX's warns) and execs at once.  The child inherits the
            # blocked Ctrl-C and ignores it before unblocking (_child_main).
            pid = multiprocessing.util.spawnv_passfds(
                os.fsencode(sys.executable), _spawn_command(blob),
                {blob, report.fileno(), *needed, *fds})
        finally:
            os.close(blob)
        child = Child(role, pid, None, report)
        children.append(child)
        child.pidfd = os.pidfd_open(pid)
    except BaseException:
        if pid < 0:
            report.close()
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


class SpawnHead(NamedTuple):
    """What a spawned child reads first, before it unpickles the rest."""
    role: Role
    parent: int
    mask: set
    report_fd: int
    preparation: dict    # multiprocessing.spawn's: sys.path, the main module, the cwd...
    imports: tuple       # modules to import before the target's arguments: _imports_of


def _imports_of(role) -> tuple:
    """A worker imports torch first when main has imported it, as a forked
    one has it: its generator is then seeded with the others (seed_worker,
    which seeds only a torch the process has imported), not left to chance
    by a dataset that imports torch in __getitem__.  The batcher calls no
    user code: it needs none."""
    return ("torch",) if role.worker is not None and imported_torch() is not None else ()


def _preparation(role, needs_main: bool) -> dict:
    """multiprocessing.spawn's preparation data (sys.path, the cwd, the
    main module to import as __mp_main__), as a spawn context's child gets
    it, without the authkey: the child takes part in no multiprocessing
    connection of main's.  The main module only when the payload names it
    (needs_main: an object pickled by reference to __main__): importing a
    training script again imports all it imports (torch, JAX: seconds per
    process), for nothing when the dataset comes from a module."""
    data = multiprocessing.spawn.get_preparation_data(f"ShmLoader {role}")
    data.pop("authkey", None)
    if not needs_main:
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


def _memfd_of(data: bytes) -> int:
    fd = os.memfd_create("shmloader-spawn", os.MFD_CLOEXEC)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
    except BaseException:
        os.close(fd)
        raise
    return fd


def _spawn_command(payload_fd: int) -> list[str]:
    """The child's command line.  Before anything slow (importing the
    loader takes a second on a loaded machine), it asks to die with main,
    as _native.die_with_parent does later (in Python: nothing compiled is
    imported yet), so a main killed during the start leaves no orphan.
    The package's own folder goes first on sys.path: the child imports
    this very loader, before the preparation data gives it main's whole
    sys.path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(_native.__file__)))
    sig = int(PARENT_DEATH_SIGNAL)
    code = "\n".join([
        "import os, signal, sys",
        f"parent = {os.getpid()}",
        f"signal.signal({sig}, lambda s, f: os.getppid() != parent and os._exit(1))",
        f"import ctypes; ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {sig}, 0, 0, 0)",
        "if os.getppid() != parent: os._exit(1)",
        f"sys.path.insert(0, {root!r})",
        f"from loader.main.procs import run_spawned; run_spawned({payload_fd})"])
    return [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", code]


_PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def run_spawned(payload_fd: int) -> None:
    """A spawned child's program: its head, then _child_main, which
    unpickles the target and its arguments (after dying with the parent is
    set up and Ctrl-C is ignored) and runs it."""
    size = os.fstat(payload_fd).st_size
    data = bytearray()
    while len(data) < size:  # pread: the file's offset is where main's writes left it
        data += os.pread(payload_fd, size - len(data), len(data))
    os.close(payload_fd)
    size = int.from_bytes(data[:8], "little")
    head = pickle.loads(data[8:8 + size])
    report = open(head.report_fd, "r+b")
    _child_main(head.role, head.parent, _load_and_run,
                (head.preparation, head.imports, memoryview(data)[8 + size:]), report, head.mask)


def _load_and_run(preparation: dict, imports: tuple, payload) -> None:
    size = int.from_bytes(payload[:8], "little")
    shared = passable.loads(bytes(payload[8:8 + size]))  # first: see spawn_children
    multiprocessing.spawn.prepare(preparation)
    for name in imports:
        importlib.import_module(name)
    target, args = passable.loads(bytes(payload[8 + size:]), early=shared)
    global _kept_until_exit
    # As in a forked child, what the target was given lives until
    # os._exit (_child_main): a ring a worker never closes (to_main) is
    # not collected and warned about as unclosed on the way out.
    _kept_until_exit = (shared, target, args)
    target(*args)


_kept_until_exit = None


def _child_main(role, parent, target, args, report, mask):
    code = 1
    try:
        _native.die_with_parent(parent, PARENT_DEATH_SIGNAL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is main's to handle
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        faulthandler.register(signal.SIGUSR1, file=report, all_threads=True)
        target(*args)
        code = 0
    except BaseException:
        try:
            report.write(f"ShmLoader {role} (pid {os.getpid()}) failed:\n"
                         f"{traceback.format_exc()}".encode())
            report.flush()
        except BaseException:
            pass
    finally:
        os._exit(code)


def wait_all(children, timeout: float) -> bool:
    """Wait until every child has exited, up to timeout seconds (on their
    pidfds: no polling; threads are joined).  True if they all did."""
    deadline = time.monotonic() + timeout
    if children and not isinstance(children[0], Child):  # threads (main/threads.py)
        return all(c.join(max(0.0, deadline - time.monotonic())) for c in children)
    pending = [c for c in children if c.exitcode is None]
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        poller = select.poll()
        for c in pending:
            poller.register(c.pidfd, select.POLLIN)
        poller.poll(left * 1000)
        pending = [c for c in pending if c.exitcode is None]
    return True
