"""Training curves as a picture, from runs' metrics.jsonl: no tracker needed. Every run writes `run_dir/curves.png`
at the end and at evaluations at most once a minute (`write_run_curves`, called by step_meter.py), and `python -m
analysis plot RUN_DIR ...` overlays runs (`plot_curves`), a panel for each group of metrics some run logged. See
docs/pretrain.md#trackers-and-curves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.tools.figures import pyplot, save_figure

CURVES_NAME = "curves.png"
# (panel title, [(metrics.jsonl key, legend suffix)]) in drawing order; a panel appears when any run logged a key.
PANELS = [
    ("training loss", [("loss", "")]),
    ("training accuracy (MPP target, or class)", [("acc", "")]),
    ("validation loss", [("val_loss", "")]),
    ("validation accuracy", [("val_acc", "MPP"), ("val_top1", "top-1"), ("val_top5", "top-5"),
                             ("ema_val_top1", "EMA top-1")]),
    ("k-NN top-1 (representation quality)", [("knn_top1_cls", "[class]"), ("knn_top1_avg", "patch mean")]),
    ("learning rate", [("lr", "")]),
    ("images / s", [("img_per_s", "")]),
]


def plot_curves(runs: dict[str, list[dict[str, Any]]], out: str | Path, title: str = "") -> Path | None:
    """Draw the panels that `runs` (label -> records) have data for into `out`; None when there is nothing to draw."""
    panels = [(name, keys) for name, keys in PANELS
              if any(k in r for records in runs.values() for r in records for k, _ in keys)]
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.4 * rows), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, (name, keys) in zip(axes.flat, panels):
        for i, (label, records) in enumerate(runs.items()):
            for j, (key, suffix) in enumerate(keys):
                points = [(r["step"], r[key]) for r in records if key in r and isinstance(r[key], (int, float))]
                if not points:
                    continue
                steps, values = zip(*points)
                style = ["-", "--", ":", "-."][j % 4]
                marker = "o" if len(points) <= 30 and key.startswith(("val", "ema", "knn")) else None
                ax.plot(steps, values, style, color=colours(i % 10), marker=marker, markersize=3,
                        label=" ".join(x for x in (label, suffix) if x))
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if name == "learning rate" or (name == "training loss" and _spans_decades(runs, "loss")):
            ax.set_yscale("log")
        if len(runs) > 1 or len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, out)


def _spans_decades(runs: dict[str, list[dict[str, Any]]], key: str) -> bool:
    values = [r[key] for records in runs.values() for r in records if isinstance(r.get(key), (int, float))]
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) > 1 and max(positive) / min(positive) > 30


def write_run_curves(run_dir: str | Path) -> Path | None:
    """`run_dir/curves.png` from the run's own metrics.jsonl."""
    run_dir = Path(run_dir)
    return plot_curves({run_dir.name: read_metrics(run_dir)}, run_dir / CURVES_NAME, title=str(run_dir))
