"""run_dir/metrics.jsonl, one JSON object per logged step or evaluation: the one module that writes it
(`MetricsLog`, main process), cuts it back on resume (`rewind_jsonl`, also for the sample audit's files) and reads it
(`read_metrics`, for curves, summaries, trackers and `python -m analysis`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vit_mpp.durable import append_whole, write_atomic

METRICS_NAME = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, in order (a torn last line, from a kill mid-write, is skipped)."""
    path = Path(run_dir) / METRICS_NAME
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def rewind_jsonl(path: Path, step: int) -> None:
    """Cut a JSON-lines log of steps back to the records of steps up to `step`, the step a run resumes from.

    A run killed between a record and its next checkpoint has written steps that the resumed run writes again;
    without this the file would hold those steps twice. A line torn by the kill (half-written, not JSON) goes too.
    """
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(line + "\n" for line in kept))


def _step_of(line: str) -> int | None:
    """The step of a JSON-lines record (0 when it names none), or None for a line that is not a JSON object."""
    try:
        record = json.loads(line)
        return int(record.get("step", 0)) if isinstance(record, dict) else None
    except (ValueError, TypeError):
        return None


class MetricsLog:
    """Appends metrics to run_dir/metrics.jsonl (main process only) and reads them back."""

    def __init__(self, run_dir: str | Path, is_main: bool) -> None:
        self.path = Path(run_dir) / METRICS_NAME
        self.is_main = is_main

    def rewind(self, step: int) -> None:
        """Drop records logged after `step`, the step a run resumes from (see `rewind_jsonl`)."""
        if self.is_main:
            rewind_jsonl(self.path, step)

    def write(self, record: dict[str, Any]) -> None:
        if self.is_main:
            append_whole(self.path, json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        """What the log holds, in order ([] off the main process, which alone writes it)."""
        return read_metrics(self.path.parent) if self.is_main else []
