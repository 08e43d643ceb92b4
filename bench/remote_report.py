"""The tables of bench/remote.md from the JSON of one or more runs of
bench/remote.py (`python bench/remote.py --markdown run.json ...`).

Every figure is the median over the runs' rounds, with the range; a ratio
is taken within a round (the loaders of a round ran one after another
under the same load) and then its median over rounds."""

from __future__ import annotations

import re
import statistics

from remote import BATCH, CACHE_FRACTIONS, FIRST_SECONDS, LABELS, LOADERS, sample_bytes

TARGETS = {"first": 0.8, "mosaic_e1": 1.5, "litdata_e1": 1.0, "peers_warm": 1.2, "local_warm": 0.95,
           "cpu_ms_per_GB": 20.0, "fraction": 0.95}


# --- figures of one cell ----------------------------------------------------------------------

def rate(epochs: list[dict]) -> float:
    """MB/s (10^6 bytes) over these epochs together."""
    return sum(e["bytes"] for e in epochs) / sum(e["seconds"] for e in epochs) / 1e6


def cpu_ms_per_gb(epochs: list[dict]) -> float:
    return sum(e["main_cpu_s"] for e in epochs) * 1e3 / (sum(e["bytes"] for e in epochs) / 1e9)


def after_first(epoch: dict) -> float | None:
    """MB/s after the epoch's first 2 s; None when the first batch came later
    than that (its start-up was not over, and the window would rate bytes
    fetched before it as if they arrived after)."""
    if not epoch.get("after_first") or (epoch.get("first_batch_s") or 0) > FIRST_SECONDS:
        return None
    nbytes, seconds = epoch["after_first"]
    return nbytes / seconds / 1e6


def figures(cell: dict) -> dict:
    e = cell["epochs"]
    return {"e1": rate(e[:1]), "warm": rate(e[1:]), "after": after_first(e[0]),
            "cpu_e1": cpu_ms_per_gb(e[:1]), "cpu_warm": cpu_ms_per_gb(e[1:]),
            "setup": cell["setup_s"], "exact": all(x["exact"] for x in e),
            "first_batch": e[0]["first_batch_s"]}


def link_rate(cell: dict) -> float:
    return cell["bytes"] / cell["seconds"] / 1e6


# --- gathering ----------------------------------------------------------------------------------

def rounds(reports: list[dict]) -> dict:
    """(size, rtt) -> [round: {loader: cell}] over every report."""
    out: dict = {}
    for ri, report in enumerate(reports):
        current: dict = {}
        for cell in report.get("cells", []):
            key = (cell["size"], cell["rtt_ms"])
            if cell["loader"] == "link":
                current = {"link": cell}
                out.setdefault(key, []).append(current)
            else:
                current[cell["loader"]] = cell
    return out


def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def span(values, fmt="{:.0f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    m = fmt.format(statistics.median(values))
    if len(values) == 1:
        return m
    return f"{m} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def loads(cells) -> str:
    ones = [float(c[k].split()[0]) for c in cells for k in ("load_before", "load_after") if k in c]
    return f"{min(ones):.1f}–{max(ones):.1f}" if ones else "?"


def ok(cell) -> bool:
    return cell is not None and "error" not in cell


# --- tables ---------------------------------------------------------------------------------------

def markdown(reports: list[dict]) -> str:
    by = rounds(reports)
    first = reports[0]
    lines = [f"Machine: {first['machine']}; Python {first['python']}; "
             f"versions {first.get('versions')}; objects per size {first['counts']}; "
             f"{first['epochs']} epochs per cell; rounds per report "
             f"{[r['rounds'] for r in reports]}."]
    for name, why in first.get("skipped", {}).items():
        lines.append(f"Skipped: {name}: {why}")
    sizes = sorted({s for s, _ in by}, key=lambda s: sample_bytes(s))
    for size in sizes:
        lines += throughput_table(by, size)
        lines += ratio_table(by, size)
    lines += targets_table(by, sizes)
    lines += remote_table(by, sizes)
    fractions = [c for r in reports for c in r.get("fractions", [])]
    if fractions:
        lines += fraction_table(fractions, reports[0]["counts"]["256KiB"])
    return "\n".join(lines)


def throughput_table(by, size) -> list[str]:
    cells = [c for rtt in sorted(r for s, r in by if s == size) for rnd in by[(size, rtt)]
             for c in rnd.values()]
    out = [f"\n**{size} objects, batch {BATCH[size]}, 2 workers, shuffled** "
           f"(1-minute load {loads(cells)} on the 2 cores): MB/s into the loop, median of rounds (range)\n",
           "| RTT | loader | link MB/s | epoch 1 MB/s | epoch 1 after 2 s | warm (2-3) MB/s | "
           "samples/s e1 / warm | main CPU ms/GB e1 / warm | setup s | load | exact |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    per_sample = sample_bytes(size) / 1e6
    for rtt in sorted(r for s, r in by if s == size):
        rnds = by[(size, rtt)]
        link = span([link_rate(r["link"]) for r in rnds if ok(r.get("link"))])
        for name in LOADERS:
            cs = [r.get(name) for r in rnds]
            if not any(c is not None for c in cs):
                continue
            errors = [c["error"] for c in cs if c is not None and "error" in c]
            fs = [figures(c) for c in cs if ok(c)]
            if not fs:
                out.append(f"| {rtt} ms | {LABELS[name]} | {link} | failed: {_short(errors[0])} "
                           f"|||||| {loads(c for c in cs if c is not None)} ||")
                continue
            sps = f"{med(f['e1'] for f in fs) / per_sample:.0f} / {med(f['warm'] for f in fs) / per_sample:.0f}"
            cpu = f"{med(f['cpu_e1'] for f in fs):.0f} / {med(f['cpu_warm'] for f in fs):.0f}"
            exact = "yes" if all(f["exact"] for f in fs) else "**no**"
            if errors:
                exact += f"; {len(errors)} round(s) failed: {_short(errors[0])}"
            out.append(f"| {rtt} ms | {LABELS[name]} | {link} | {span(f['e1'] for f in fs)} | "
                       f"{span(f['after'] for f in fs)} | {span(f['warm'] for f in fs)} | {sps} | {cpu} | "
                       f"{span((f['setup'] for f in fs), '{:.1f}')} | {loads(c for c in cs if ok(c))} | {exact} |")
    return out


def _short(error: str) -> str:
    """The exception's line (the last "Name: message" line of the traceback;
    warnings printed after it at exit are not the error)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
    return (raised[-1] if raised else lines[-1] if lines else error)[:160].replace("|", "/")


def round_ratios(by, size, rtt, peer, which) -> list[float]:
    out = []
    for rnd in by[(size, rtt)]:
        a, b = rnd.get("shm"), rnd.get(peer)
        if ok(a) and ok(b):
            out.append(figures(a)[which] / figures(b)[which])
    return out


def ratio_table(by, size) -> list[str]:
    peers = [p for p in LOADERS if p != "shm"]
    out = [f"\n{size}: ShmLoader + FileDataset(s3://) is ×, per round, median (range)\n",
           "| RTT | epoch | " + " | ".join(LABELS[p] for p in peers) + " |",
           "|---|---|" + "---:|" * len(peers)]
    for rtt in sorted(r for s, r in by if s == size):
        for which, label in (("e1", "1 (cold)"), ("warm", "2-3 (warm)")):
            out.append(f"| {rtt} ms | {label} | " + " | ".join(
                span(round_ratios(by, size, rtt, p, which), "{:.2f}×") for p in peers) + " |")
    return out


def verdict(value, target, higher=True) -> str:
    if value is None:
        return "not measured"
    met = value >= target if higher else value <= target
    return "met" if met else f"**missed** by {abs(value - target):.2f}"


def targets_table(by, sizes) -> list[str]:
    out = ["\n**Targets** (ShmLoader + FileDataset(s3://), train_on=\"all\"; medians over rounds)\n",
           "| size | RTT | epoch 1 after 2 s / min(link, local) ≥ 0.8 | e1 vs MosaicML ≥ 1.5× | "
           "e1 vs litdata ≥ 1.0× | warm vs MosaicML ≥ 1.2× | warm vs litdata ≥ 1.2× | "
           "warm vs local ≥ 0.95× | main CPU ≤ 20 ms/GB (e1 / warm) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        for rtt in sorted(r for s, r in by if s == size):
            rnds = by[(size, rtt)]
            first, whole = [], []
            for rnd in rnds:
                a, loc, link = rnd.get("shm"), rnd.get("local"), rnd.get("link")
                if ok(a) and ok(loc) and ok(link):
                    bound = min(link_rate(link), figures(loc)["warm"])
                    whole.append(figures(a)["e1"] / bound)
                    if figures(a)["after"] is not None:
                        first.append(figures(a)["after"] / bound)
            cells = [_target(first, TARGETS["first"])
                     + (f" (whole epoch 1: {span(whole, '{:.2f}')})" if whole else ""),
                     _target(round_ratios(by, size, rtt, "mosaic", "e1"), TARGETS["mosaic_e1"]),
                     _target(round_ratios(by, size, rtt, "litdata", "e1"), TARGETS["litdata_e1"]),
                     _target(round_ratios(by, size, rtt, "mosaic", "warm"), TARGETS["peers_warm"]),
                     _target(round_ratios(by, size, rtt, "litdata", "warm"), TARGETS["peers_warm"]),
                     _target(round_ratios(by, size, rtt, "local", "warm"), TARGETS["local_warm"])]
            fs = [figures(r["shm"]) for r in rnds if ok(r.get("shm"))]
            e1, warm = med(f["cpu_e1"] for f in fs), med(f["cpu_warm"] for f in fs)
            cpu = (f"{e1:.0f} / {warm:.0f} ms/GB: {verdict(max(e1, warm), TARGETS['cpu_ms_per_GB'], False)}"
                   if fs else "not measured")
            out.append(f"| {size} | {rtt} ms | " + " | ".join(cells) + f" | {cpu} |")
    return out


def _target(values, target) -> str:
    m = med(values)
    return "not measured" if m is None else f"{span(values, '{:.2f}')}: {verdict(m, target)}"


def remote_table(by, sizes) -> list[str]:
    out = ["\n**ShmLoader's stats()[\"remote\"]** after each epoch (cumulative; round 1): "
           "objects fetched / cache hits / fetch wait in the workers (s)\n",
           "| size | RTT | objects | after epoch 1 | after epoch 2 | after epoch 3 |", "|---|---|---:|---|---|---|"]
    for size in sizes:
        for rtt in sorted(r for s, r in by if s == size):
            cell = by[(size, rtt)][0].get("shm")
            if not ok(cell):
                continue
            n = cell["epochs"][0]["samples"]
            out.append(f"| {size} | {rtt} ms | {n} | " + " | ".join(
                f"{e['remote']['objects_fetched']} / {e['remote']['cache_hits']} / "
                f"{e['remote']['fetch_wait_s']:.1f}" for e in cell["epochs"]) + " |")
    return out


def fraction_table(cells, count) -> list[str]:
    """The target's figure is "served": 1 - objects fetched / objects read,
    over the warm epochs together (a fetch is a read the cache did not serve).
    The fetcher starts an epoch before the loop has the last batches of the
    one before, so a few fetches land in the previous epoch's figure; over
    the warm epochs together that moves as much in as out.  "in the cache as
    the epoch began" (stats cache_hits) is an upper bound: an object there
    at the start may be evicted before its turn and fetched again."""
    from remote import fraction_fetched, fraction_hits

    out = [f"\n**Cache smaller than the data** (256KiB × {count}, 0 ms, train_on=\"all\", "
           f"1-minute load {loads(cells)}): the fraction of each epoch's bytes served from the "
           "cache; median of rounds\n",
           "| cache | served, epochs 1 / 2 / 3 / 4 (1 − fetched / objects) | "
           "in the cache as epochs 2 / 3 / 4 / 5 began (stats cache_hits) | "
           "served in warm epochs / cache fraction (range) | ≥ 0.95× |", "|---|---|---|---|---|"]
    for frac in CACHE_FRACTIONS:
        cs = [c for c in cells if c.get("fraction") == frac and ok(c)]
        if not cs:
            continue
        hits = [fraction_hits(c, count) for c in cs]
        fetched = [fraction_fetched(c, count) for c in cs]
        per_hits = [med(h[k] for h in hits) for k in range(len(hits[0]))]
        per_fetched = [med(f[k] for f in fetched) for k in range(len(fetched[0]))]
        warm = [statistics.mean(f[1:]) / frac for f in fetched]
        out.append(f"| {frac:.0%} | " + " / ".join(f"{x:.3f}" for x in per_fetched) + " | "
                   + " / ".join(f"{x:.3f}" for x in per_hits)
                   + f" | {span(warm, '{:.2f}')} | {_fraction_verdict(med(warm))} |")
    return out


def _fraction_verdict(ratio: float) -> str:
    if ratio >= TARGETS["fraction"]:
        return "met"
    return f"**missed** by {TARGETS['fraction'] - ratio:.2f}"
