"""Draws benchmarks/kernels.py's results: per workload, each variant's % of the floor.

    python benchmarks/plot_kernels.py DIR/kernels.json [OUT.png]
"""

from __future__ import annotations

import json
import sys


def plot(json_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    # Config-sweep rows ("triton:BLOCK_N=64", ...) stay in the JSON and the table, not the plot.
    rows = [r for r in data["rows"] if r["time_us"] and "=" not in r["variant"]]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(workloads) + 2))
    height = 0.8 / len(variants)
    for j, v in enumerate(variants):
        ys, xs = [], []
        for i, w in enumerate(workloads):
            for r in rows:
                if r["workload"] == w and r["variant"] == v:
                    ys.append(i + j * height)
                    xs.append(100 * r["floor_us"] / r["time_us"])
        ax.barh(ys, xs, height=height, label=v)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(workloads))], workloads, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of the floor (higher is better; 100% = roofline from ANCHORS.md)")
    ax.set_title(f"mlagraph triton kernels vs peers — {data['device']}, torch {data['torch']}, {data['date']}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    print(f"wrote {png_path}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    src = sys.argv[1]
    plot(src, sys.argv[2] if len(sys.argv) > 2 else src.rsplit(".", 1)[0] + ".png")
