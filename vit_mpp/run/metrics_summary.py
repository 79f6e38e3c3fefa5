"""What a run's metrics.jsonl says once it is over: the final and the best value of each metric, and the wall time.
One reading for every tool that reports on runs (the trackers' `best/` numbers, `python -m analysis summary`).
"""

from __future__ import annotations

from typing import Any

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


def wall_time_s(records: list[dict[str, Any]]) -> float | None:
    """Seconds of training, from the `elapsed_s` the records carry (the run's training time when each was written,
    a resumed run's included: vit_mpp/run/step_meter.py). None when the records carry no time (runs of older
    versions)."""
    times = _numbers(records, "elapsed_s")
    return max(times) if times else None
