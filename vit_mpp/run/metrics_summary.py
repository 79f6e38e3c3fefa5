"""What a run's metrics.jsonl says once it is over: the final and the best value of each metric, and the wall time
(from the run's summary.json when it has one). One reading for every tool that reports on runs (the trackers' `best/`
numbers, `python -m analysis summary`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUMMARY_NAME = "summary.json"  # written at the end of a run (vit_mpp/run/run_summary.py)

# The metrics that have a best, and which way is better.
BEST_OF = {"val_top1": max, "val_top5": max, "val_mean_class_acc": max, "ema_val_top1": max, "val_acc": max,
           "knn_top1_cls": max, "knn_top1_avg": max, "val_loss": min, "ema_val_loss": min}


def _numbers(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]


def final_metrics(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    """The last value logged of each of `keys` that the records hold."""
    return {k: values[-1] for k in keys if (values := _numbers(records, k))}


def best_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """The best value of each metric of `BEST_OF` that the records hold (the highest accuracy, the lowest loss)."""
    return {k: better(values) for k, better in BEST_OF.items() if (values := _numbers(records, k))}


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's summary.json, None when it has none (a run not finished, or of an older version) or it is
    unreadable."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_NAME).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def wall_time_s(records: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> float | None:
    """The run's wall time in seconds: its summary's `total_s` (start-up, evaluations and export included) when the
    summary covers the last step the records reached (a finished run, not one extended since); else the
    `elapsed_s` the records carry (the time since each process made its meter, a resumed run's included:
    vit_mpp/run/step_meter.py). None when neither has a time (runs of older versions)."""
    last = max((int(r["step"]) for r in records if isinstance(r.get("step"), int)), default=0)
    if summary and isinstance(summary.get("total_s"), (int, float)) and summary.get("step", -1) >= last:
        return float(summary["total_s"])
    times = _numbers(records, "elapsed_s")
    return max(times) if times else None
