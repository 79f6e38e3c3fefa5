"""Which pretraining monitor ranks MPP recipes as fine-tuning does: for every MPP arm and seed of a `compare`, the
last value of each monitor its pretraining logged (k-NN on the [class] token and on the patch mean, and with
`knn.probe_epochs` the linear and the attentive probe) beside the arm's fine-tuned test top-1, and each monitor's
Spearman rank correlation with fine-tuning over those runs. See docs/experiments.md#which-monitor-predicts-fine-tuning.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vit_mpp.run.metering.metrics_log import read_metrics

MONITORS = ("knn_top1_cls", "knn_top1_avg", "knn_probe_linear", "knn_probe_attentive")


def last_monitors(run_dir: Path) -> dict[str, float]:
    """The last value of each monitor a pretraining logged (those it logged)."""
    found: dict[str, float] = {}
    for record in read_metrics(run_dir):
        found.update({m: float(record[m]) for m in MONITORS if isinstance(record.get(m), (int, float))})
    return found


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (the Pearson correlation of the ranks); None for fewer than 3 pairs or a
    constant side."""
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else None


def monitor_table(runs: list[tuple[str, int, Path, float | None]]) -> dict[str, Any]:
    """From (arm, seed, pretraining run dir, fine-tuned top-1) of every MPP run: each run's monitors and top-1, and
    per monitor its Spearman correlation with top-1 over the runs that have both."""
    rows = [{"arm": arm, "seed": seed, "finetune_top1": top1, **last_monitors(run_dir)}
            for arm, seed, run_dir, top1 in runs]
    correlation = {}
    for m in MONITORS:
        pairs = [(r[m], r["finetune_top1"]) for r in rows if m in r and r["finetune_top1"] is not None]
        if pairs:
            correlation[m] = {"spearman": spearman([a for a, _ in pairs], [b for _, b in pairs]), "runs": len(pairs)}
    return {"runs": rows, "spearman": correlation}


def monitor_markdown(monitors: dict[str, Any]) -> str:
    """The runs' monitors beside their fine-tuning, then each monitor's rank correlation with it."""
    shown = [m for m in MONITORS if m in monitors["spearman"]]
    lines = ["Pretraining monitors (last logged) and fine-tuned test top-1, per MPP run", "",
             f"| arm | seed | fine-tuned | {' | '.join(shown)} |", "|" + " --- |" * (len(shown) + 3)]
    for r in monitors["runs"]:
        cells = " | ".join("–" if r.get(m) is None else f"{r[m]:.3f}" for m in shown)
        top1 = "–" if r["finetune_top1"] is None else f"{r['finetune_top1']:.3f}"
        lines.append(f"| {r['arm']} | {r['seed']} | {top1} | {cells} |")
    corr = " | ".join("–" if monitors["spearman"][m]["spearman"] is None
                      else f"{monitors['spearman'][m]['spearman']:+.2f} ({monitors['spearman'][m]['runs']} runs)"
                      for m in shown)
    lines += ["", f"| Spearman with fine-tuning | {' | '.join(shown)} |", "|" + " --- |" * (len(shown) + 1),
              f"| rank correlation | {corr} |"]
    return "\n".join(lines) + "\n"
