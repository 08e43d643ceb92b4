"""shmq between local users (issue 28, items 7 and 9): what a consumer
trusts, whose segments `attach` opens, and what `clean` may remove.

NOTE [ Whose segment ] in shmq/segment.py: a consumer unpickles every
record that is not one plain array, so attach refuses a segment another uid
owns or others may write.  The other users here are made with os.setresuid
in a forked child that only calls os functions (or shmq, already imported
by the fork): a fresh interpreter running as another uid may not be able
to import this environment's packages at all."""

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import secrets
import struct

import numpy as np
import posix_ipc
import pytest

import shmq
from shmq import __main__ as cli
from shmq import _core, segment
from test_segments import CleanedByAnother

LAYOUT = _core.layout_offsets()
NOBODY, CONSUMER, NEIGHBOUR = 65534, 1234, 5678  # the other users
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="switching to another uid (os.setresuid) needs root")
RESULT_TIMEOUT_S = 20


# --- another uid, in a forked child ---------------------------------------------------------

def _as_uid_child(uid, fn, args, conn):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    try:
        conn.send(("returned", fn(*args)))
    except Exception as e:
        conn.send(("raised", type(e).__name__, str(e)))


def as_uid(procs, uid, fn, *args):
    """fn(*args) in a forked child running as uid (groups dropped): what
    it returned, as ("returned", value), or ("raised", type name, text)."""
    recv, send = mp.Pipe(False)
    child = procs.fork(_as_uid_child, uid, fn, args, send)
    assert recv.poll(RESULT_TIMEOUT_S), f"the child running as uid {uid} sent nothing"
    result = recv.recv()
    child.join(RESULT_TIMEOUT_S)
    assert child.exitcode == 0, f"the child running as uid {uid} exited with {child.exitcode}"
    return result


def create_file(path: str, contents: bytes, mode: int) -> int:
    """The segment file an attacker makes: O_EXCL, then its own mode (plain
    os calls: nothing to import as that user).  Returns the owner uid."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.pwrite(fd, contents, 0)
        os.fchmod(fd, mode)
        return os.fstat(fd).st_uid
    finally:
        os.close(fd)


def segment_as(procs, uid, contents: bytes, mode: int, tag: str = "test") -> str:
    """A segment named like ours (this pid, for the leak guard), owned by uid."""
    name = f"/{segment.PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(6)}"
    assert as_uid(procs, uid, create_file, segment.SHM_DIR + name, contents, mode) == \
        ("returned", uid)
    return name


def remove(*names):
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.SHM_DIR + name)


# --- what a record runs -------------------------------------------------------------------

RAN: list = []  # calls made by unpickling a HostileRecord in this process


def note_call(what):
    RAN.append(what)
    return what


class HostileRecord:
    """What an attacker puts in a record: unpickling it calls note_call
    (os.system in the repro)."""

    def __init__(self, what):
        self.what = what

    def __reduce__(self):
        return note_call, (self.what,)


def segment_bytes_with_a_hostile_record(what) -> bytes:
    """A valid segment whose next record calls note_call(what) when
    unpickled, as another user copies it under a name."""
    with shmq.Queue(1 << 16) as q:
        q.put({"x": HostileRecord(what)})
        with open(segment.SHM_DIR + q.name, "rb") as f:
            return f.read()


def attach_and_get(name):
    """A consumer's whole use of a name it was given."""
    q = shmq.Queue.attach(name)
    try:
        return q.get(timeout=2)
    finally:
        q.close()


def test_a_tree_record_calls_what_its_producer_chose():
    """Why attach refuses other users' segments: a consumer rebuilding a
    tree runs the functions its producer's pickle names (here note_call;
    as well os.system).  The stream checks bound its size, not its calls."""
    RAN.clear()
    with shmq.Queue(1 << 16) as q:
        q.put({"x": HostileRecord("same uid")})
        assert q.get(timeout=1) == {"x": "same uid"}
    assert RAN == ["same uid"]


class CountingLoads:
    def __init__(self, loads):
        self.loads, self.calls = loads, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.loads(*args, **kwargs)


def _plain(n):
    return np.arange(n, dtype="<i8")


# (message, unpickled?): only one plain C-contiguous np.ndarray of a raw dtype (an ARRAY
# record) is never unpickled; every other message is a TREE record
RECORD_KINDS = {
    "1-d int64": (_plain(1000), False),
    "2-d float32": (np.ones((64, 48), "<f4"), False),
    "0-d": (np.array(7.5), False),
    "bytes dtype": (np.array([b"ab", b"cd"]), False),
    "structured": (np.zeros(5, [("a", "<i4"), ("b", "<f8")]), True),
    "Fortran order": (np.asfortranarray(np.ones((8, 3))), True),
    "strided": (_plain(100)[::3], True),
    "np.recarray": (np.zeros(3, [("a", "<i4")]).view(np.recarray), True),
    "dict": ({"x": _plain(10), "y": 3}, True),
    "tuple": ((_plain(4), _plain(5)), True),
    "list": ([_plain(3)], True),
    "int": (7, True),
    "str": ("label", True),
    "None": (None, True),
}


@pytest.mark.parametrize("how", ["get", "get_view"])
@pytest.mark.parametrize("case", sorted(RECORD_KINDS))
def test_which_records_the_consumer_unpickles(case, how, monkeypatch):
    msg, unpickled = RECORD_KINDS[case]
    loads = CountingLoads(pickle.loads)
    monkeypatch.setattr(pickle, "loads", loads)  # the consumer's one call (_core._decode_tree)
    with shmq.Queue(1 << 20) as q:
        q.put(msg)
        if how == "get":
            got = q.get(timeout=1)
            assert_same(got, msg)
        else:
            with q.get_view(timeout=1) as got:
                assert_same(got, msg)
    assert loads.calls == int(unpickled)


def assert_same(got, sent):
    assert type(got) is type(sent)
    if isinstance(sent, np.ndarray):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert np.array_equal(np.asarray(got), np.asarray(sent))
    elif isinstance(sent, dict):
        assert sorted(got) == sorted(sent)
        for k in sent:
            assert_same(got[k], sent[k])
    elif isinstance(sent, (tuple, list)):
        assert len(got) == len(sent)
        for g, s in zip(got, sent):
            assert_same(g, s)
    else:
        assert got == sent


# --- whose segment attach opens (item 7) --------------------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077], ids=oct)
def test_segments_are_created_0600_whatever_the_umask(umask):
    old = os.umask(umask)
    try:
        with shmq.Queue(1 << 16) as q:
            st = os.stat(segment.SHM_DIR + q.name)
            assert (st.st_mode & 0o7777, st.st_uid) == (0o600, os.geteuid())
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666, 0o660], ids=oct)
def test_attach_refuses_a_segment_others_may_write(mode):
    """Our own segment, chmod-ed so that the group or others may write it:
    refused, naming the mode; the creator's handle is untouched, and once
    the mode is 0600 again attach works."""
    with shmq.Queue(1 << 16, multi_producer=True) as q:
        path = segment.SHM_DIR + q.name
        os.chmod(path, mode)
        with pytest.raises(shmq.UntrustedSegment) as info:
            shmq.Queue.attach(q.name)
        text = str(info.value)
        assert text.startswith(f"refusing to attach to {q.name!r}: its mode {mode:04o} lets "
                               f"users other than its owner ({segment.user_name(os.geteuid())}) "
                               f"write it (shmq creates segments 0600); its records would be "
                               f"unpickled here, and a pickle can run any code as this process")
        assert f"Make a new queue, and remove this one (rm {path})" in text
        assert isinstance(info.value, PermissionError) and isinstance(info.value, shmq.ShmqError)
        q.put(np.arange(3))
        assert q.get(timeout=1).tolist() == [0, 1, 2]
        os.chmod(path, 0o600)
        with shmq.Queue.attach(q.name.lstrip("/")) as p:
            p.put(np.arange(4))
            assert q.get(timeout=1).tolist() == [0, 1, 2, 3]


@needs_root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [0o600, 0o644, 0o666], ids=oct)
def test_attach_refuses_a_segment_of_another_uid(procs, mode):
    """repro_attach_foreign_segment.py: once a queue is gone, another user
    makes a segment under its name holding a record that runs code when
    unpickled.  The consumer (root here) refuses it at attach, whatever
    its mode, naming the owner: nothing of it is read, nothing runs."""
    RAN.clear()
    contents = segment_bytes_with_a_hostile_record("as root")
    name = segment_as(procs, NOBODY, contents, mode)
    try:
        with pytest.raises(shmq.UntrustedSegment) as info:
            shmq.Queue.attach(name)
        text = str(info.value)
        assert text.startswith(
            f"refusing to attach to {name!r}: it belongs to {segment.user_name(NOBODY)}, not to "
            f"this process's {segment.user_name(0)} (mode {mode:04o}); its records would be "
            f"unpickled here")
        assert "Attach from a process running as its owner" in text
        assert f"(its owner or root can remove this one: rm {segment.SHM_DIR}{name})" in text
        assert isinstance(info.value, PermissionError)
        with pytest.raises(shmq.UntrustedSegment):
            shmq.Queue.attach(name.lstrip("/"))  # the same name, as `ls /dev/shm` shows it
        assert RAN == []
    finally:
        remove(name)


def attach_others_then_own(foreign_name):
    """As an ordinary user: another uid's segment is refused; a queue of
    its own attaches and carries an array."""
    try:
        shmq.Queue.attach(foreign_name)
        refused = None
    except shmq.UntrustedSegment as e:
        refused = str(e)
    with shmq.Queue(1 << 16) as q, shmq.Queue.attach(q.name) as p:
        p.put(np.arange(6))
        got = q.get(timeout=2).tolist()
    return refused, got, RAN


@needs_root
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [0o666, 0o600], ids=oct)
def test_an_ordinary_user_attaches_its_own_and_refuses_another_uids(procs, mode):
    """The repro's second case: the consumer is uid 1234, the attacker uid
    65534 (a segment holding a hostile record).  A 0600 one the consumer
    cannot even open is the same UntrustedSegment (was a bare
    posix_ipc.PermissionsError)."""
    RAN.clear()
    name = segment_as(procs, NOBODY, segment_bytes_with_a_hostile_record("as 1234"), mode)
    try:
        kind, (refused, got, ran) = as_uid(procs, CONSUMER, attach_others_then_own, name)
        assert kind == "returned"
        assert refused.startswith(
            f"refusing to attach to {name!r}: it belongs to {segment.user_name(NOBODY)}, not to "
            f"this process's {segment.user_name(CONSUMER)} (mode {mode:04o})")
        assert got == [0, 1, 2, 3, 4, 5] and ran == []
    finally:
        remove(name)


def attach_unreadable_own():
    """As an ordinary user: its own segment, chmod-ed 0000."""
    with shmq.Queue(1 << 16) as q:
        os.chmod(segment.SHM_DIR + q.name, 0)
        try:
            shmq.Queue.attach(q.name)
        except PermissionError as e:
            return type(e).__name__, e.errno, str(e), q.name
        return None


@needs_root
@pytest.mark.timeout(60)
def test_an_own_segment_its_owner_may_not_open_is_a_permission_error(procs):
    kind, (type_name, err, text, name) = as_uid(procs, CONSUMER, attach_unreadable_own)
    assert kind == "returned" and type_name == "PermissionError" and err == 13
    assert text == (f"[Errno 13] cannot open shmq segment {name!r} (mode 0000): permission denied; "
                    f"shmq creates segments 0600 for its owner")


# --- what clean may remove (item 9) --------------------------------------------------------

def stale_segment_bytes() -> bytes:
    """A whole segment whose header names a creator that is gone: this
    (live) pid with another start time, as if the pid had been reused."""
    with shmq.Queue(1 << 12) as q:
        with open(segment.SHM_DIR + q.name, "rb") as f:
            contents = bytearray(f.read())
    struct.pack_into("<Q", contents, LAYOUT["creator_starttime"], 12345)
    return bytes(contents)


def run_clean(*args):
    """`python -m shmq clean ...` in this process: (exit status, output)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(["clean", *args])
    return status, out.getvalue()


def gone(*names) -> bool:
    return any(not os.path.exists(segment.SHM_DIR + name) for name in names)


def undisturbed(attempt, attempts=10):
    """attempt() until one is not disturbed by another program cleaning
    stale segments meanwhile (R26: as root it removes ours too)."""
    for _ in range(attempts):
        try:
            return attempt()
        except CleanedByAnother:
            continue
    pytest.fail(f"another program removed our stale segments in all {attempts} attempts")


@needs_root
@pytest.mark.timeout(120)
def test_clean_skips_another_users_stale_segment_and_removes_its_own(procs):
    """repro_clean_foreign_eperm.py: uid 1234 runs `clean`; another user's
    stale segment it can read but not remove (mode 0644) sorts first.
    Before: a PermissionsError traceback, and 1234's own stale segment
    left.  Now: its own removed, the other skipped and named, status 0;
    root's clean then removes the other."""
    stale = stale_segment_bytes()

    def attempt():
        theirs = segment_as(procs, NEIGHBOUR, stale, 0o644, tag="a")
        mine = segment_as(procs, CONSUMER, stale, 0o600, tag="b")
        try:
            assert sorted([theirs, mine]) == [theirs, mine]  # clean meets theirs first
            kind, (status, out) = as_uid(procs, CONSUMER, run_clean)
            if gone(theirs) or (f"removed {mine} (" not in out and gone(mine)):
                raise CleanedByAnother
            assert kind == "returned" and status == 0, out
            assert f"removed {mine} ({len(stale)} bytes, creator pid {os.getpid()} is gone)\n" \
                in out
            assert f"skipped {theirs} ({len(stale)} bytes, creator pid {os.getpid()}, owner " \
                   f"{segment.user_name(NEIGHBOUR)}): not permitted to remove it\n" in out
            assert "only their owners (or root) may remove them, with `python -m shmq clean`" \
                in out
            assert gone(mine)
            assert os.stat(segment.SHM_DIR + theirs).st_uid == NEIGHBOUR  # untouched
            status, out = run_clean()
            assert status == 0 and f"skipped {theirs}" not in out
            assert gone(theirs)  # (by this clean, or by a root program cleaning meanwhile)
        finally:
            remove(theirs, mine)

    undisturbed(attempt)


def test_clean_goes_on_past_a_segment_it_may_not_remove(monkeypatch):
    """The same without another uid: unlinking the first stale segment is
    refused (as the kernel refuses another user's in sticky /dev/shm);
    the next is removed, the refused one named, status 0."""
    stale = stale_segment_bytes()
    real_unlink = posix_ipc.unlink_shared_memory
    refused_names = set()

    def unlink(name):
        if name in refused_names:
            raise posix_ipc.PermissionsError("Permission denied")
        real_unlink(name)

    monkeypatch.setattr(posix_ipc, "unlink_shared_memory", unlink)

    def attempt():
        refused, removable = names = [f"/{segment.PREFIX}{tag}-{os.getpid()}-"
                                      f"{secrets.token_hex(6)}" for tag in "ab"]
        refused_names.add(refused)
        for name in names:
            create_file(segment.SHM_DIR + name, stale, 0o600)
        try:
            cleaned = segment.remove_stale()
            if gone(refused) or (removable not in {s.name for s in cleaned.removed}
                                 and gone(removable)):
                raise CleanedByAnother
            assert refused in {s.name for s in cleaned.not_permitted}
            assert removable in {s.name for s in cleaned.removed}
            assert refused not in {s.name for s in cleaned.removed}
            assert gone(removable)
            status, out = run_clean()
            if gone(refused):
                raise CleanedByAnother
            assert status == 0
            assert f"skipped {refused} ({len(stale)} bytes, creator pid {os.getpid()}, owner " \
                   f"{segment.user_name(os.geteuid())}): not permitted to remove it\n" in out
            with pytest.raises(PermissionError, match=f"cannot remove shmq segment '{refused}': "
                                                      f"Permission denied; only its owner or "
                                                      f"root may"):
                segment.unlink(refused)
        finally:
            refused_names.discard(refused)
            remove(*names)

    undisturbed(attempt)
