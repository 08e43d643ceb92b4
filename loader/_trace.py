"""ShmLoader(trace=PATH): a Chrome-trace / Perfetto JSON of a run, from
fixed-size records every process appends while it works.

NOTE [ Trace records ]
~~~~~~~~~~~~~~~~~~~~~~
Main maps one array of int64 words in anonymous shared memory before it
forks anything (shmq.shared_array: no name, so nothing to leak; pages are
taken only as records fill them).  Every process of the loader, and every
process it forks later (a respawned pool, num_workers="auto" growing),
inherits the mapping; worker threads share it.

    words[0]                  HEAD: records claimed so far (may pass the capacity)
    words[8 + 8*i : 16 + 8*i] record i: kind, tid, t0, t1, a, b, c, d

A writer claims record i with one atomic fetch-add on HEAD, stores the
seven payload words, then stores `kind` (never 0) last:

    SYNC POINT: release store of `kind`; main reads the records only after
    every child has exited or been joined, and skips those whose kind is
    still 0 (a process killed between its claim and its kind store).

so a killed worker's records up to its death are kept and its half-written
one is dropped, never misread.  Past the capacity, a claim writes nothing:
the JSON says how many were dropped.  Times are time.perf_counter_ns(),
CLOCK_MONOTONIC on Linux: one clock in every process, the one stats()
uses (NOTE [ Wait clocks ] in _stats.py), so the two add up.

Nothing is formatted while the loader runs: main turns the records into
JSON at close() (_trace_json.py), writing a temporary file beside PATH and
renaming it, so PATH is either the whole trace or absent.
"""

from __future__ import annotations

import os
import threading
import time

import shmq

HEADER_WORDS = 8
RECORD_WORDS = 8
CAPACITY_RECORDS = 1 << 20   # 64 MiB at most, only as far as it fills

# kinds (0: not written)
NAME = 1      # a tracer started: t0 = when; a = pid; b = role (ROLE_*, or a worker id >= 0)
LOAD = 2      # dataset[i] / __getitems__: a = index (-1: a batch), b = position, c = samples, d = epoch
WRITE = 3     # a worker's write into the slab: a = position, b = batch, c = run, d = rows
COLLATE = 4   # a collate_fn in a worker: a = batch, b = samples, c = run
BATCH = 5     # the collator: t0 = laid out, t1 = sent to main; a = batch, b = rows, c = run
RUN = 6       # the collator saw a run start: a = run, b = epoch
POOL = 7      # slab pool occupancy: a = bytes in use, b = capacity
WAIT = 8      # the training loop in next(): a = epoch, b = batch handed out (-1: none)
EPOCH = 9     # an epoch from its first next() to its end: a = epoch, b = batches,
              # c = samples, d = 1 if it ran to its end, else 0

ROLE_COLLATOR = -1
ROLE_MAIN = -2

now = time.perf_counter_ns


def check_path(path) -> str:
    """The trace's path as a str, or a typed error naming it: its directory
    must exist and be writable, and the path must not be a directory."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise TypeError(f"trace must be a path (str or os.PathLike) to write a JSON file to, "
                        f"got {type(path).__name__}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"ShmLoader: trace={path!r} is a directory; give a file path "
                                f"such as {os.path.join(path, 'trace.json')!r}")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"ShmLoader: trace={path!r}: its directory {folder!r} does not "
                                f"exist; create it first, or write the trace elsewhere")
    probe = f"{path}.{os.getpid()}.tmp"  # the name close() writes first (_trace_json.py)
    try:  # (access() says yes to root on a read-only mount: try it)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"ShmLoader: trace={path!r}: cannot create a file in {folder!r} "
                              f"({e.strerror}); write the trace to a writable directory") from None
    return path


class TraceLog:
    """The records of one loader (see NOTE [ Trace records ]).  Made in main
    before the first fork; every process makes its own Tracer from it."""

    def __init__(self, path, capacity: int = CAPACITY_RECORDS):
        self.path = check_path(path)
        self.capacity = capacity
        self.words = shmq.shared_array(HEADER_WORDS + RECORD_WORDS * capacity, "int64")
        self.origin = now()  # the JSON's time zero
        self.written = False

    def tracer(self, role: int) -> "Tracer":
        """This process's (or thread's) writer, announcing itself with a
        NAME record."""
        t = Tracer(self, role)
        t.record(NAME, now(), 0, os.getpid(), role, 0, 0)
        return t

    def records(self):
        """The committed records, as an (n, RECORD_WORDS) int64 array, and
        how many claims found the log full.  Main only, once the writers
        are gone (NOTE [ Trace records ])."""
        claimed = int(shmq.atomic_load(self.words, 0))
        kept = min(claimed, self.capacity)
        rows = self.words[HEADER_WORDS:HEADER_WORDS + RECORD_WORDS * kept].reshape(-1, RECORD_WORDS)
        return rows[rows[:, 0] != 0].copy(), claimed - kept

    def write(self) -> None:
        """Write the JSON (once): see _trace_json.py."""
        if self.written:
            return
        self.written = True
        from loader._trace_json import write_trace  # (it imports this module)

        records, dropped = self.records()
        write_trace(self.path, records, dropped, self.origin)


class Tracer:
    """One process's or thread's writer of records."""

    def __init__(self, log: TraceLog, role: int):
        self.words, self.capacity = log.words, log.capacity
        self.mv = memoryview(log.words)  # plain stores of the payload: cheaper than numpy's
        self.tid = threading.get_native_id()  # == the pid in a worker process
        self.role = role

    def record(self, kind: int, t0: int, t1: int, a: int = 0, b: int = 0, c: int = 0,
               d: int = 0) -> None:
        i = shmq.atomic_add(self.words, 0, 1)
        if i >= self.capacity:
            return  # full: counted by HEAD, reported in the JSON
        base = HEADER_WORDS + RECORD_WORDS * i
        mv = self.mv
        mv[base + 1] = self.tid
        mv[base + 2] = t0
        mv[base + 3] = t1
        mv[base + 4] = a
        mv[base + 5] = b
        mv[base + 6] = c
        mv[base + 7] = d
        shmq.atomic_store(self.words, base, kind)  # SYNC POINT: see NOTE [ Trace records ]

    # --- hooks: what each process records ------------------------------------------

    def traced_load(self, load):
        """A worker's _load(epoch, index, pos), recording a LOAD."""
        record = self.record

        def traced(epoch, index, pos):
            t0 = now()
            sample = load(epoch, index, pos)
            record(LOAD, t0, now(), index if type(index) is int else -1, pos, 1, epoch)
            return sample
        return traced

    def traced_collate(self, collate):
        """A worker's _collate(run, batch, samples), recording a COLLATE."""
        record = self.record

        def traced(run, batch, samples):
            t0 = now()
            out = collate(run, batch, samples)
            record(COLLATE, t0, now(), batch, len(samples), run)
            return out
        return traced

    def batch_laid_out(self, run: int, batch: int, when: dict) -> None:
        """The collator published a batch for the workers: its BATCH record
        starts here (the first layout counts; a relayout does not)."""
        when.setdefault((run, batch), now())

    def batch_sent(self, run: int, batch: int, rows: int, when: dict) -> None:
        t1 = now()
        self.record(BATCH, when.pop((run, batch), t1), t1, batch, rows, run)

    def run_ended(self, run: int, when: dict) -> None:
        """Forget the run's batches laid out and never sent (dropped)."""
        for key in [k for k in when if k[0] == run]:
            del when[key]


class TracedWriter:
    """A worker's RowWriter whose place() records a WRITE."""

    def __init__(self, writer, tracer: Tracer):
        self.writer, self.record = writer, tracer.record

    def place(self, run, batch, row, rows, pos, sample, batched=True):
        t0 = now()
        try:
            return self.writer.place(run, batch, row, rows, pos, sample, batched=batched)
        finally:
            self.record(WRITE, t0, now(), pos, batch, run, rows)

    def __getattr__(self, name):
        return getattr(self.writer, name)


class NoTracer:
    """Trace off: every hook does nothing (the collator's and main's few
    per-batch calls; the per-sample paths are not wrapped at all)."""

    def record(self, *args) -> None:
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
