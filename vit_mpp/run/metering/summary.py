"""The end of a run in a few lines: its total time (start-up and export included), training and evaluation time,
mean images/s, data wait and MFU, the final and best metrics and where the exports are; printed as a short block and
written to run_dir/summary.json (`write_summary`); and what a finished run's records say, one reading for every tool
that reports on runs (the trackers' `best/` numbers, `python -m analysis summary`): final and best values, the wall
time (from summary.json, which it prefers to metrics.jsonl). See docs/pretrain.md#what-a-run-prints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vit_mpp.durable import write_atomic
from vit_mpp.progress import format_duration
from vit_mpp.run.metering.metrics_log import read_metrics

SUMMARY_NAME = "summary.json"

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


def covers_last_step(summary: dict[str, Any] | None, records: list[dict[str, Any]]) -> bool:
    """Whether `summary` is that of the run whose records these are as they stand: written at the end of the last step
    they reached (a run still going, stopped, or resumed since has none, or an older one)."""
    last = max((int(r["step"]) for r in records if isinstance(r.get("step"), int)), default=0)
    return bool(summary) and isinstance(summary.get("step"), int) and summary["step"] >= last


def wall_time_s(records: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> float | None:
    """The run's wall time in seconds: its summary's `total_s` (start-up, evaluations and export included) when the
    summary covers the last step the records reached (a finished run, not one extended since); else the
    `elapsed_s` the records carry (the time since each process made its meter, a resumed run's included:
    vit_mpp/run/metering/step_meter.py). None when neither has a time (runs of older versions)."""
    if covers_last_step(summary, records) and isinstance(summary.get("total_s"), (int, float)):
        return float(summary["total_s"])
    times = _numbers(records, "elapsed_s")
    return max(times) if times else None


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


def summary_record(run_dir: str | Path, times: RunTimes, exports: list[Path], threads: int) -> dict[str, Any]:
    """What summary.json holds: the times, the training costs, peak device memory (the most any log saw), the CPU
    threads of each process (beside which its img/s was measured), the final and best of the `SHOWN` metrics, and
    the export folders that exist."""
    records = read_metrics(run_dir)
    best = best_metrics(records)
    memory = [r["peak_mem_gib"] for r in records if isinstance(r.get("peak_mem_gib"), (int, float))]
    return {"step": times.step, "total_s": round(times.total, 1), "train_s": round(times.training, 1),
            "eval_s": round(times.evaluation, 1),
            "other_s": round(max(0.0, times.total - times.training - times.evaluation), 1),
            "img_per_s": _rounded(times.img_per_s, 1), "data_wait": _rounded(times.data_wait, 4),
            "mfu": _rounded(times.mfu, 4), "peak_mem_gib": max(memory, default=None),
            "threads": threads, "final": final_metrics(records, SHOWN),
            "best": {k: v for k, v in best.items() if k in SHOWN},
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
