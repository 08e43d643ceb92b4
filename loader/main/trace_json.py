"""The trace's records (NOTE [ Trace records ] in shared/trace.py) as a Chrome-trace
/ Perfetto JSON file (the Trace Event Format: "X" complete events with ts
and dur in microseconds, "b"/"e" async slices, "C" counters, "i" instants,
"M" process_name and thread_name metadata).  Runs once, in main, at close().

The events, by process:
    worker w        "load"     dataset[i] (args.samples: 1), or one __getitems__ call
                               (args.samples: the batch's)
                    "write"    the sample (or a collate_fn's output) into its slab
                    "collate"  a collate_fn
    the batcher    "batch"    async slice from its slab being laid out to BatchReady
                    "run"      instant: a pass over the data (its epoch) starts
                    "slab pool" counter: bytes of batch memory in use
    main            "next()"   the training loop waiting in next() (stats'
                               loop_wait_seconds is their sum)
                    "epoch"    on the "epochs" track: first next() to the end
                               (stats' seconds), and an instant at its start
"""

from __future__ import annotations

import json
import os

from loader.shared.trace import (BATCH, COLLATE, EPOCH, LOAD, NAME, NO_VALUE, POOL, ROLE_BATCHER,
                                 ROLE_MAIN, RUN, WAIT, WRITE, create_beside)

EPOCHS_TID_OFFSET = 1 << 30  # the synthetic "epochs" track of main's process


def _role_name(role: int) -> str:
    if role == ROLE_MAIN:
        return "training loop (main)"
    if role == ROLE_BATCHER:
        return "batcher"
    return f"worker {role}"


def trace_events(records, origin_ns: int) -> list[dict]:
    """The JSON events of the records (an (n, 8) int64 array)."""
    whois: dict[int, tuple[int, int]] = {}   # tid -> (pid, role)
    epoch_of_run: dict[int, int] = {}
    for tid, t0, _, a, b, _, _, kind in records.tolist():
        if kind == NAME:
            whois[tid] = (a, b)
        elif kind == RUN:
            epoch_of_run[a] = b
    events = _metadata(whois)

    def us(t):
        return (t - origin_ns) / 1e3

    for tid, t0, t1, a, b, c, d, kind in records.tolist():
        pid = whois.get(tid, (tid, 0))[0]
        at = {"pid": pid, "tid": tid, "ts": us(t0)}
        if kind == LOAD:
            events.append({"name": "load", "cat": "worker", "ph": "X", **at, "dur": us(t1) - us(t0),
                           "args": _given(samples=c, position=b, epoch=d, index=a)})
        elif kind == WRITE:
            events.append({"name": "write", "cat": "worker", "ph": "X", **at,
                           "dur": us(t1) - us(t0),
                           "args": {"position": a, "batch": b, "run": c, "rows": d}})
        elif kind == COLLATE:
            events.append({"name": "collate", "cat": "worker", "ph": "X", **at,
                           "dur": us(t1) - us(t0), "args": _given(batch=a, samples=b, run=c)})
        elif kind == BATCH:
            ident = f"{c}:{a}"
            args = _given(batch=a, rows=b, run=c, epoch=epoch_of_run.get(c, NO_VALUE))
            events.append({"name": "batch", "cat": "batcher", "ph": "b", "id": ident, **at,
                           "args": args})
            events.append({"name": "batch", "cat": "batcher", "ph": "e", "id": ident,
                           "pid": pid, "tid": tid, "ts": us(t1)})
        elif kind == RUN:
            events.append({"name": "run", "cat": "batcher", "ph": "i", "s": "t", **at,
                           "args": {"run": a, "epoch": b}})
        elif kind == POOL:
            events.append({"name": "slab pool", "cat": "batcher", "ph": "C", **at,
                           "args": {"bytes in use": a}})
        elif kind == WAIT:
            events.append({"name": "next()", "cat": "main", "ph": "X", **at,
                           "dur": us(t1) - us(t0), "args": {"epoch": a}})
        elif kind == EPOCH:
            track = {"pid": pid, "tid": EPOCHS_TID_OFFSET + tid}
            events.append({"name": "epoch", "cat": "main", "ph": "X", **track, "ts": us(t0),
                           "dur": us(t1) - us(t0),
                           "args": {**_given(epoch=a, batches=b, samples=c),
                                    "complete": bool(d)}})
            events.append({"name": f"epoch {a}", "cat": "main", "ph": "i", "s": "g", **track,
                           "ts": us(t0)})
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0)))
    return events


def _given(**values) -> dict:
    """The values that apply: a word of NO_VALUE (None when recorded) is left out."""
    return {k: v for k, v in values.items() if v != NO_VALUE}


def _metadata(whois: dict) -> list[dict]:
    events = []
    pids: dict[int, list[int]] = {}
    for tid, (pid, role) in whois.items():
        pids.setdefault(pid, []).append(role)
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": _role_name(role)}})
        if role == ROLE_MAIN:
            events.append({"name": "thread_name", "ph": "M", "pid": pid,
                           "tid": EPOCHS_TID_OFFSET + tid, "args": {"name": "epochs"}})
    for pid, roles in pids.items():
        # one process per worker (its pid tells a respawned one apart); worker
        # threads live in main's process
        name = ("ShmLoader main" if ROLE_MAIN in roles
                else f"ShmLoader {_role_name(roles[0])} (pid {pid})")
        sort = 0 if ROLE_MAIN in roles else (1 if ROLE_BATCHER in roles else 2 + max(roles))
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid,
                       "args": {"sort_index": sort}})
    return events


def trace_json(records, dropped: int, origin_ns: int) -> str:
    """The whole JSON document of the records."""
    doc = {"traceEvents": trace_events(records, origin_ns), "displayTimeUnit": "ms",
           "otherData": {"writer": "loader.ShmLoader(trace=...)", "clock": "CLOCK_MONOTONIC",
                         "records": len(records), "dropped_records": dropped}}
    return json.dumps(doc, separators=(",", ":"))  # (json.dump writes in small pieces)


def write_whole(path: str, text: str) -> None:
    """Write text to a new file beside `path` (create_beside: made
    exclusively, never through a link, under a name nobody can guess),
    flushed to the disk, then renamed over `path`: `path` is the whole
    trace or what it was before, never a torn file.  On any failure the
    new file is removed and the error raised."""
    fd, tmp = create_beside(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # a file system that fills up late (delayed allocation) fails here
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
