"""Benchmark results: collected per workload and printed as a table of
msg/s, GB/s and how many times faster shmq is than each peer."""

import os
import platform

RESULTS: dict[str, dict[str, tuple[float, float]]] = {}


def record(workload, transport, nbytes, count, seconds):
    RESULTS.setdefault(workload, {})[transport] = (count / seconds, count * nbytes / seconds / 1e9)


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it: every figure names it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"


def read_reports(paths) -> list[dict]:
    """The JSON reports a benchmark wrote with --json, for --markdown."""
    import json

    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages: every figure gives the load."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def format_table(results, baseline="shmq get") -> list[str]:
    lines = [f"{'workload':<14} {'transport':<24} {'msg/s':>12} {'GB/s':>8} {baseline + ' is':>14}"]
    for workload, rows in results.items():
        ours = rows.get(baseline)
        for name, (rate, gbs) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
            ratio = f"{ours[0] / rate:.2f}x" if ours else "-"
            lines.append(f"{workload:<14} {name:<24} {rate:>12,.0f} {gbs:>8.2f} {ratio:>14}")
    return lines


# Side-by-side ratios of every loader workload run, for --plot: workload ->
# peer -> how many times better ShmLoader did than that peer on the
# workload's headline figure (> 1: ShmLoader ahead).
RATIOS: dict[str, dict[str, float]] = {}


def record_ratio(workload: str, peer: str, ratio: float) -> None:
    RATIOS.setdefault(workload, {})[peer] = ratio
