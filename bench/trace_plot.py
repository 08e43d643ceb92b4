"""One W11 run's timeline, drawn from its trace (ShmLoader(trace=PATH)):
the picture in docs/where-the-time-goes.md (issue 16).

    python bench/trace_plot.py [--images 640] [--epochs 2] [--step-ms 0]
                               [--json /tmp/w11-trace.json] [--png docs/trace_w11.png]

W11 as bench/realistic.py runs it (Pillow decode + RandomResizedCrop(224) +
flip of locally made 500x375 JPEGs, batch 64, 2 workers), for a few epochs,
with an optional busy "train step" per batch.  The JSON is the one to open
in https://ui.perfetto.dev; the PNG draws the same events with matplotlib:
one lane per worker (each sample's load, then its write into the slab),
the batcher's batches (laid out -> sent to main), the training loop's waits
in next(), epochs, and the slab pool's occupancy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from loader import ShmLoader  # noqa: E402
from report import machine  # noqa: E402


def run(images: int, epochs: int, step_ms: float, path: str) -> list[dict]:
    from loaders import busy
    from realistic import Jpegs, make_jpegs

    dataset = Jpegs(make_jpegs(2000)[:images])
    with ShmLoader(dataset, batch_size=64, num_workers=2, seed=0, trace=path) as ld:
        for _ in range(epochs):
            for batch in ld:
                busy(step_ms / 1e3)
                del batch
            print(ld.stats()["summary"])
    with open(path) as f:
        return json.load(f)["traceEvents"]


def draw(events: list[dict], png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    workers = sorted({k for k, v in names.items() if v.startswith("worker")}, key=names.get)
    lanes = [names[k] for k in workers] + ["batcher: batches", "training loop: next()",
                                           "epochs"]
    y = {name: len(lanes) - 1 - i for i, name in enumerate(lanes)}
    fig, (ax, pool) = plt.subplots(2, 1, figsize=(13, 5.2), sharex=True,
                                   gridspec_kw={"height_ratios": [4, 1]})
    ms = 1e-3

    def bars(lane, spans, color, height=0.6, offset=0.0):
        ax.broken_barh([(s * ms, max(d * ms, 0.05)) for s, d in spans],
                       (y[lane] - height / 2 + offset, height), facecolors=color, linewidth=0)

    for k in workers:
        mine = [e for e in events if e["ph"] == "X" and (e["pid"], e["tid"]) == k]
        bars(names[k], [(e["ts"], e["dur"]) for e in mine if e["name"] == "load"], "tab:blue")
        bars(names[k], [(e["ts"], e["dur"]) for e in mine if e["name"] == "write"], "tab:orange")
    begins = {e["id"]: e for e in events if e["name"] == "batch" and e["ph"] == "b"}
    for e in events:
        if e["name"] == "batch" and e["ph"] == "e" and e["id"] in begins:
            b = begins[e["id"]]
            k = b["args"]["batch"]
            row = (k % 6 - 2.5) * 0.12  # batches in flight overlap: six sub-rows
            bars("batcher: batches", [(b["ts"], e["ts"] - b["ts"])],
                 "tab:green" if k % 2 else "tab:olive", 0.1, row)
    bars("training loop: next()", [(e["ts"], e["dur"]) for e in events if e["name"] == "next()"],
         "tab:red")
    for e in events:
        if e["name"] == "epoch" and e["ph"] == "X":
            bars("epochs", [(e["ts"], e["dur"])], "0.75")
            ax.text((e["ts"] + e["dur"] / 2) * ms, y["epochs"], f"epoch {e['args']['epoch']}",
                    ha="center", va="center", fontsize=8)
            ax.axvline(e["ts"] * ms, color="0.5", linewidth=0.6, linestyle=":")
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:blue", label="load: dataset[i] (decode, crop, flip)"),
                       Patch(color="tab:orange", label="write into the batch slab"),
                       Patch(color="tab:green", label="a batch: laid out -> ready"),
                       Patch(color="tab:red", label="training loop waits in next()")],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, fontsize=8, frameon=False)
    counter = sorted((e["ts"], e["args"]["bytes in use"]) for e in events
                     if e["name"] == "slab pool")
    if counter:
        pool.step([t * ms for t, _ in counter], [v / 1e6 for _, v in counter], where="post",
                  color="tab:purple")
    pool.set_ylabel("slab pool\nMB in use", fontsize=8)
    pool.set_xlabel("ms since the loader was made")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=640)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--json", default="/tmp/w11-trace.json")
    parser.add_argument("--png", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                      "trace_w11.png"))
    args = parser.parse_args(argv)
    events = run(args.images, args.epochs, args.step_ms, args.json)
    title = (f"W11 traced: {args.images} JPEGs x {args.epochs} epochs, batch 64, 2 workers, "
             f"train step {args.step_ms:g} ms; {machine()}, load {os.getloadavg()[0]:.1f}, "
             f"{time.strftime('%Y-%m-%d')}")
    draw(events, args.png, title)
    print(f"trace: {args.json} (open it in https://ui.perfetto.dev); picture: {args.png}")


if __name__ == "__main__":
    main()
