"""One PNG of the side-by-side ratios recorded in report.RATIOS
(`python bench/loaders.py --plot PATH`); needs matplotlib (the [bench] extra)."""

from __future__ import annotations


def plot_ratios(ratios: dict[str, dict[str, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    palette = plt.get_cmap("tab10")
    for k, (workload, peers) in enumerate(ratios.items()):
        for peer, ratio in peers.items():
            labels.append(f"{workload}: vs {peer}")
            values.append(ratio)
            colors.append(palette(k % 10))
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(labels) + 1.4))
    y = range(len(labels))[::-1]
    ax.barh(list(y), values, color=colors)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.set_xscale("log")  # ratios from 0.5x to 50x on one axis
    ax.axvline(1.0, color="black", linewidth=0.8)
    for yi, v in zip(y, values):
        ax.text(v, yi, f" {v:.2f}x", va="center", fontsize=7)
    ax.set_xlabel("ShmLoader's figure / the peer's (> 1: ShmLoader ahead; log scale)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
