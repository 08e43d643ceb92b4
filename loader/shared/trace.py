"""ShmLoader(trace=PATH): a Chrome-trace / Perfetto JSON of a run, from
fixed-size records every process appends while it works.

NOTE [ Trace records ]
~~~~~~~~~~~~~~~~~~~~~~
Main maps one array of int64 words in anonymous shared memory before it
forks anything (shmq.sync.shared_array: no name, so nothing to leak;
pages are taken only as records fill them).  Every process of the
loader, and every process it forks later (a respawned pool,
num_workers="auto" growing), inherits the mapping; worker threads share
it.

    words[0]                   CLAIMED: records handed out in chunks so far
    words[1]                   DROPPED: records not written, the log being full
    words[8 + 8*i : 16 + 8*i]  record i: tid, t0, t1, a, b, c, d, kind

A record is written by the Tracer's method of its kind, with keywords
(Tracer.load(..., index=, position=, ...)): what a, b, c and d hold per
kind is said there and beside the kinds below, and read back in one
place (main/trace_json.py).  A value that does not apply (a batch's load
has no single index; an epoch left early has no sample count) is None in
Python and NO_VALUE (-1) in its word.

A writer claims CHUNK records at a time with one atomic fetch-add on
CLAIMED and fills them in order, each with one struct.pack_into, which
stores the words left to right: `kind` (never 0) is stored last.  Main
reads the records only once every writer has exited or been joined (all
their stores are visible then), and skips records whose kind is 0: the
unused rest of a chunk, or the record a process was writing when it was
killed.  So a killed worker's records up to its death are kept and a torn
one is never read.  Past the capacity a record is only counted (DROPPED)
and the JSON says so.  Times are time.perf_counter_ns(), CLOCK_MONOTONIC
on Linux: one clock in every process, the one stats() uses (NOTE [ Wait
clocks ] in main/stats.py), so the two add up.

Nothing is formatted while the loader runs: main turns the records into
JSON at close() (main/trace_json.py), writing a new file beside PATH and
renaming it, so PATH is either the whole trace or absent.  That file is
made exclusively under a name nobody can guess (create_beside): PATH's
directory may be writable by others, who must not be able to make main
write through a link they planted.  If writing fails (a full disk), close()
still stops every process, raises TraceWriteError naming the trace, PATH
and the cause, and keeps the records: close() again writes them.
"""

from __future__ import annotations

import errno
import os
import secrets
import struct
import threading
import time

from shmq import sync
from loader.shared.passable import shared_array
from loader.errors import ArgumentTypeError, TraceWriteError

HEADER_WORDS = 8
RECORD_WORDS = 8
KIND_WORD = 7                # the last word of a record: see the NOTE
CLAIMED, DROPPED = 0, 1      # header words
CHUNK = 64                   # records a writer claims at a time
CAPACITY_RECORDS = 1 << 20   # 64 MiB at most, only as far as it fills
_RECORD = struct.Struct("8q")

# kinds (0: not written), and what a, b, c, d hold: the Tracer's method of each
NAME = 1      # a tracer started: t0 = when; a = pid; b = role (ROLE_*, or a worker id >= 0)
LOAD = 2      # dataset[i] / __getitems__ / next(it): a = index, b = position,
              # c = samples, d = epoch
WRITE = 3     # a worker's write into the slab: a = position, b = batch, c = run, d = rows
COLLATE = 4   # a collate_fn in a worker: a = batch, b = samples, c = run
BATCH = 5     # the batcher: t0 = laid out, t1 = sent to main; a = batch, b = rows, c = run
RUN = 6       # the batcher saw a run start: a = run, b = epoch
POOL = 7      # slab pool occupancy: a = bytes in use, b = capacity
WAIT = 8      # the training loop in next(): a = epoch
EPOCH = 9     # an epoch from its first next() to its end: a = epoch, b = batches,
              # c = samples, d = 1 if it ran to its end, else 0

NO_VALUE = -1  # the word of a value that does not apply (None): see the NOTE

ROLE_BATCHER = -1
ROLE_MAIN = -2

now = time.perf_counter_ns


def check_path(path) -> str:
    """The trace's path as a str, or a typed error naming it: its directory
    must exist and be writable, and the path must not be a directory."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise ArgumentTypeError(f"trace must be a path (str or os.PathLike) to write a JSON file "
                                f"to, got {type(path).__name__}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"ShmLoader: trace={path!r} is a directory; give a file path "
                                f"such as {os.path.join(path, 'trace.json')!r}")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"ShmLoader: trace={path!r}: its directory {folder!r} does not "
                                f"exist; create it first, or write the trace elsewhere")
    try:  # what close() does first (access() says yes to root on a read-only mount: try it)
        fd, probe = create_beside(path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"ShmLoader: trace={path!r}: cannot create a file in {folder!r} "
                              f"({e.strerror}); write the trace to a writable directory") from None
    return path


def create_beside(path: str) -> tuple[int, str]:
    """(fd, name) of a new file in path's directory, for writing, under a
    random name, with the mode a plain open() gives (0666 less the umask).
    O_CREAT | O_EXCL never opens an existing file, nor a symlink planted at
    the name (O_NOFOLLOW states it again, should the flags ever change)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        name = f"{path}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(name, flags, 0o666), name
        except FileExistsError:  # a 2**-64 collision, or names planted by guessing
            continue
    raise FileExistsError(errno.EEXIST, f"16 random names beside trace={path!r} were all taken; "
                                        f"write the trace to a directory only you can write")


class TraceLog:
    """The records of one loader (see NOTE [ Trace records ]).  Made in main
    before the first fork; every process makes its own Tracer from it."""

    def __init__(self, path, capacity: int = CAPACITY_RECORDS, passable: bool = False):
        self.path = check_path(path)
        self.capacity = capacity
        # passable: start_method="spawn" (NOTE [ Starting clean ] in shared/passable.py)
        self.words = shared_array(HEADER_WORDS + RECORD_WORDS * capacity, "int64", passable)
        self.origin = now()  # the JSON's time zero
        self.written = False
        self.failed = False  # the last attempt raised TraceWriteError

    def tracer(self, role: int) -> "Tracer":
        """This process's (or thread's) writer, announcing itself with a
        NAME record."""
        t = Tracer(self, role)
        t.named(now(), pid=os.getpid(), role=role)
        return t

    def records(self):
        """The records written, as an (n, RECORD_WORDS) int64 array, and how
        many were dropped.  Main only, once the writers are gone (NOTE
        [ Trace records ])."""
        claimed = min(int(self.words[CLAIMED]), self.capacity)
        rows = self.words[HEADER_WORDS:HEADER_WORDS + RECORD_WORDS * claimed]
        rows = rows.reshape(-1, RECORD_WORDS)
        return rows[rows[:, KIND_WORD] != 0].copy(), int(self.words[DROPPED])

    @property
    def pending(self) -> bool:
        """Not written, and never tried: what the loader's __del__ writes.
        After a failure only an explicit close() tries again (the error was
        raised there; garbage collection must not raise it again)."""
        return not self.written and not self.failed

    def write(self) -> None:
        """Write the JSON (main/trace_json.py), unless written already.  A
        failure raises TraceWriteError and keeps the records for a next
        call (NOTE [ Trace records ])."""
        if self.written:
            return
        from loader.main.trace_json import trace_json, write_whole  # (they import this module)

        records, dropped = self.records()
        text = trace_json(records, dropped, self.origin)
        try:
            write_whole(self.path, text)
        except OSError as e:
            self.failed = True
            raise TraceWriteError.of(self.path, len(text), len(records), e) from e
        self.written, self.failed = True, False


class Tracer:
    """One process's or thread's writer of records."""

    def __init__(self, log: TraceLog, role: int):
        self.words, self.capacity = log.words, log.capacity
        self.mv = memoryview(log.words).cast("B")
        self.pack = _RECORD.pack_into
        self.tid = threading.get_native_id()  # == the pid in a worker process
        self.role = role
        self.next = self.end = 0  # the chunk being filled: records [next, end)

    # --- one method per kind of record (see the kinds above) -----------------------------

    def named(self, t0: int, *, pid: int, role: int) -> None:
        self._record(NAME, t0, 0, pid, role, 0, 0)

    def load(self, t0: int, t1: int, *, index: int | None, position: int, samples: int,
             epoch: int) -> None:
        """dataset[index]; index None: a batch's __getitems__, or a stream's
        next() (position: the sample's number in the stream)."""
        self._record(LOAD, t0, t1, NO_VALUE if index is None else index, position, samples,
                     epoch)

    def write(self, t0: int, t1: int, *, position: int, batch: int, run: int,
              rows: int) -> None:
        self._record(WRITE, t0, t1, position, batch, run, rows)

    def collate(self, t0: int, t1: int, *, batch: int | None, samples: int, run: int) -> None:
        """batch None: first-ready, where the batch is known once placed."""
        self._record(COLLATE, t0, t1, NO_VALUE if batch is None else batch, samples, run, 0)

    def batch(self, t0: int, t1: int, *, batch: int, rows: int, run: int) -> None:
        self._record(BATCH, t0, t1, batch, rows, run, 0)

    def run_started(self, t0: int, *, run: int, epoch: int) -> None:
        self._record(RUN, t0, 0, run, epoch, 0, 0)

    def pool(self, t0: int, *, in_use: int, capacity: int) -> None:
        self._record(POOL, t0, 0, in_use, capacity, 0, 0)

    def wait(self, t0: int, t1: int, *, epoch: int) -> None:
        self._record(WAIT, t0, t1, epoch, 0, 0, 0)

    def epoch(self, t0: int, t1: int, *, epoch: int, batches: int | None, samples: int | None,
              complete: bool) -> None:
        """batches, samples: None when the epoch was left early, uncounted."""
        self._record(EPOCH, t0, t1, epoch, NO_VALUE if batches is None else batches,
                     NO_VALUE if samples is None else samples, int(complete))

    def _record(self, kind: int, t0: int, t1: int, a: int, b: int, c: int, d: int) -> None:
        i = self.next
        if i == self.end:
            i = self._claim()
            if i < 0:
                return
        self.next = i + 1
        # kind last: see NOTE [ Trace records ]
        self.pack(self.mv, (HEADER_WORDS + RECORD_WORDS * i) * 8, self.tid, t0, t1, a, b, c, d,
                  kind)

    def _claim(self) -> int:
        first = sync.atomic_add(self.words, CLAIMED, CHUNK)
        if first + CHUNK > self.capacity:
            sync.atomic_add(self.words, DROPPED, 1)
            return -1
        self.next, self.end = first, first + CHUNK
        return first

    # --- hooks: what each process records ------------------------------------------

    def traced_load(self, load, epoch: int, index_of=None):
        """A worker's load(pos) of the sample at a position (its dataset
        index: index_of(pos)), or load(seq) of a stream's seq-th sample
        (index_of None), recording a LOAD (an index that is not an int is
        recorded without it)."""
        record = self.load

        def traced(pos):
            t0 = now()
            sample = load(pos)
            index = None if index_of is None else index_of(pos)
            record(t0, now(), index=index if type(index) is int else None, position=pos,
                   samples=1, epoch=epoch)
            return sample
        return traced

    def traced_collate(self, collate):
        """A worker's collate(run, batch, samples), recording a COLLATE."""
        record = self.collate

        def traced(run, batch, samples):
            t0 = now()
            out = collate(run, batch, samples)
            record(t0, now(), batch=batch, samples=len(samples), run=run)
            return out
        return traced

    def batch_laid_out(self, run: int, batch: int, when: dict) -> None:
        """The batcher published a batch for the workers: its BATCH record
        starts here (the first layout counts; a relayout does not)."""
        when.setdefault((run, batch), now())

    def batch_sent(self, run: int, batch: int, rows: int, when: dict) -> None:
        t1 = now()
        self.batch(when.pop((run, batch), t1), t1, batch=batch, rows=rows, run=run)

    def run_ended(self, run: int, when: dict) -> None:
        """Forget the run's batches laid out and never sent (dropped)."""
        for key in [k for k in when if k[0] == run]:
            del when[key]


class TracedWriter:
    """A worker's RowWriter whose place() records a WRITE."""

    def __init__(self, writer, tracer: Tracer):
        self.writer, self.record = writer, tracer.write

    def place(self, run, batch, row, rows, pos, sample, batched=True):
        t0 = now()
        try:
            return self.writer.place(run, batch, row, rows, pos, sample, batched=batched)
        finally:
            self.record(t0, now(), position=pos, batch=batch, run=run, rows=rows)

    def __getattr__(self, name):
        return getattr(self.writer, name)


class NoTracer:
    """Trace off: every hook does nothing (the batcher's and main's few
    per-batch calls; the per-sample paths are not wrapped at all)."""

    def run_started(self, t0, **record) -> None:
        pass

    def pool(self, t0, **record) -> None:
        pass

    def wait(self, t0, t1, **record) -> None:
        pass

    def epoch(self, t0, t1, **record) -> None:
        pass

    def batch_laid_out(self, run, batch, when) -> None:
        pass

    def batch_sent(self, run, batch, rows, when) -> None:
        pass

    def run_ended(self, run, when) -> None:
        pass


NO_TRACER = NoTracer()


def tracer_of(log: TraceLog | None, role: int):
    return NO_TRACER if log is None else log.tracer(role)
