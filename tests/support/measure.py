"""Figures for the measured table of docs/reliability.md.

With SHMQ_RELIABILITY_LOG=<file> set, the tests of the kill, fuzz and stress
tiers append one JSON line per repetition that passed all its checks:
the matrix id, the scenario, and what was timed (how long until a death was
reported, or until every process of a killed program was gone).  A
repetition that fails raises before it records, so the test's failure, not
the table, reports it.  Without the variable, record() does nothing.

    SHMQ_RELIABILITY_LOG=/tmp/r.jsonl python -m pytest -m stress ...
    python tests/support/measure.py /tmp/r.jsonl      # the Markdown table
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

LOG_VARIABLE = "SHMQ_RELIABILITY_LOG"


def record(rid: str, scenario: str, seconds: float | None = None, count: int = 1,
           what: str = "") -> None:
    """One passed repetition (or `count` of them) of scenario `rid`;
    `seconds`: the time it measures, `what` says which (same for a
    scenario's every line)."""
    path = os.environ.get(LOG_VARIABLE)
    if not path:
        return
    line = json.dumps({"id": rid, "scenario": scenario, "seconds": seconds, "count": count,
                       "what": what, "pid": os.getpid()})
    # O_APPEND: whole lines, even from several pytest processes at once
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def table(lines: list[dict]) -> str:
    rows: dict[tuple[str, str], dict] = defaultdict(lambda: {"count": 0, "seconds": [], "what": ""})
    for entry in lines:
        row = rows[entry["id"], entry["scenario"]]
        row["count"] += entry["count"]
        row["what"] = entry["what"] or row["what"]
        if entry["seconds"] is not None:
            row["seconds"].append(entry["seconds"])
    out = ["| id | scenario | passed | timed | median | max |", "|---|---|---:|---|---:|---:|"]

    def order(key):
        rid = key[0]
        return int(rid[1:]) if rid[1:].isdigit() else 999, key[1]

    for key in sorted(rows, key=order):
        row = rows[key]
        secs = row["seconds"]
        median = f"{_quantile(secs, 0.5) * 1e3:.0f} ms" if secs else ""
        worst = f"{max(secs) * 1e3:.0f} ms" if secs else ""
        out.append(f"| {key[0]} | {key[1]} | {row['count']:,} | {row['what']} | {median} | {worst} |")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table([json.loads(line) for line in f if line.strip()]))
