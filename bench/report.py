"""Benchmark results: collected per workload and printed as a table of
msg/s, GB/s and how many times faster shmq is than each peer."""

import os
import platform

RESULTS: dict[str, dict[str, tuple[float, float]]] = {}


def record(workload, transport, nbytes, count, seconds):
    RESULTS.setdefault(workload, {})[transport] = (count / seconds, count * nbytes / seconds / 1e9)


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"


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
