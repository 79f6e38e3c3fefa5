"""The end of a run in a few lines: its total time (start-up and export included), training and evaluation time,
mean images/s, data wait and MFU, the final and best metrics and where the exports are; printed as a short block and
written to run_dir/summary.json, which `python -m analysis summary` prefers to metrics.jsonl for the wall time.
See docs/pretrain.md#what-a-run-prints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vit_mpp.durable import write_atomic
from vit_mpp.progress import format_duration
from vit_mpp.run.curves import read_metrics
from vit_mpp.run.metrics_summary import SUMMARY_NAME, best_metrics, final_metrics

# The metrics a summary gives, final and best, when the run logged them: fine-tuning's validation top-1 (and its
# EMA's), pretraining's k-NN monitor, MPP accuracy and loss.
SHOWN = ("val_top1", "ema_val_top1", "knn_top1_cls", "knn_top1_avg", "val_acc", "val_loss")


@dataclass
class RunTimes:
    """What the run's meter measured, for its summary: seconds (of the whole run, a resumed one's earlier processes
    included) and this process's training costs (None where not measured)."""

    step: int
    total: float
    training: float
    evaluation: float
    img_per_s: float | None
    data_wait: float | None
    mfu: float | None


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def summary_record(run_dir: str | Path, times: RunTimes, exports: list[Path]) -> dict[str, Any]:
    """What summary.json holds: the times, the training costs, peak device memory (the most any log saw), the final
    and best of the `SHOWN` metrics, and the export folders that exist."""
    records = read_metrics(run_dir)
    best = best_metrics(records)
    memory = [r["peak_mem_gib"] for r in records if isinstance(r.get("peak_mem_gib"), (int, float))]
    return {"step": times.step, "total_s": round(times.total, 1), "train_s": round(times.training, 1),
            "eval_s": round(times.evaluation, 1),
            "other_s": round(max(0.0, times.total - times.training - times.evaluation), 1),
            "img_per_s": _rounded(times.img_per_s, 1), "data_wait": _rounded(times.data_wait, 4),
            "mfu": _rounded(times.mfu, 4), "peak_mem_gib": max(memory, default=None),
            "final": final_metrics(records, SHOWN), "best": {k: v for k, v in best.items() if k in SHOWN},
            "exports": [str(p) for p in exports if Path(p).is_dir()]}


def summary_lines(summary: dict[str, Any], path: Path) -> list[str]:
    """The block printed at the end of a run (a few lines; summary.json has the same numbers)."""
    lines = [f"run done at step {summary['step']} in {format_duration(summary['total_s'])}: training "
             f"{format_duration(summary['train_s'])}, evaluation {format_duration(summary['eval_s'])}, start-up and "
             f"export {format_duration(summary['other_s'])}"]
    costs = [f"{summary['img_per_s']:.0f} img/s" if summary["img_per_s"] is not None else None,
             f"data wait {summary['data_wait']:.0%}" if summary["data_wait"] is not None else None,
             f"MFU {summary['mfu']:.0%}" if summary["mfu"] is not None else None,
             f"peak memory {summary['peak_mem_gib']:.1f} GiB" if summary["peak_mem_gib"] is not None else None]
    if any(costs):
        lines.append("training: " + ", ".join(c for c in costs if c))
    shown = [f"{k} {v:.4f}" + (f" (best {summary['best'][k]:.4f})" if k in summary["best"] else "")
             for k, v in summary["final"].items()]
    if shown:
        lines.append("final " + " | ".join(shown))
    lines.append(f"export: {', '.join(summary['exports']) or 'none'} | summary: {path}")
    return lines


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Write run_dir/summary.json (whole or not at all); returns its path."""
    path = Path(run_dir) / SUMMARY_NAME
    write_atomic(path, json.dumps(summary, indent=1) + "\n")
    return path
