"""Run directory bookkeeping: resolved config, metrics.jsonl, and the one-line progress report."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from common.config import save_config, to_dict


def prepare_run_dir(run_dir: str | Path, cfg: Any, is_main: bool) -> list[str]:
    """Create the run directory and write config.yaml; returns keys that differ from a previous run's config."""
    run_dir = Path(run_dir)
    changed: list[str] = []
    previous = run_dir / "config.yaml"
    if previous.is_file():
        old = _flatten(yaml.safe_load(previous.read_text()) or {})
        new = _flatten(to_dict(cfg))
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, previous)
    return changed


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLog:
    """Appends metrics to run_dir/metrics.jsonl (main process only) and formats the progress line."""

    def __init__(self, run_dir: str | Path, is_main: bool) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.is_main = is_main

    def rewind(self, step: int) -> None:
        """Drop records logged after `step`, the step a run resumes from.

        A run killed between a log line and its next checkpoint has logged steps that the resumed run
        repeats; without this the file would hold those steps twice.
        """
        if not self.is_main or not self.path.is_file():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        if self.is_main:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


class Throughput:
    """Images per second and ETA over the steps since the last report."""

    def __init__(self, start_step: int, total_steps: int) -> None:
        self.total = total_steps
        self.start_step = start_step
        self.start_time = self.last_time = time.perf_counter()
        self.images = 0

    def add(self, images: int) -> None:
        self.images += images

    def report(self, step: int) -> tuple[float, float]:
        """(images/s since the last report, seconds left at the average pace since start)."""
        now = time.perf_counter()
        rate = self.images / max(1e-9, now - self.last_time)
        pace = (now - self.start_time) / max(1, step - self.start_step)
        self.images, self.last_time = 0, now
        return rate, pace * (self.total - step)


def progress_line(step: int, total: int, metrics: dict[str, float], img_per_s: float, eta_s: float) -> str:
    """`step 500/100000 | loss 0.731 | acc 0.42 | lr 1.5e-4 | 4830 img/s | eta 5h51m`."""
    parts = [f"step {step}/{total}"]
    for k, v in metrics.items():
        parts.append(f"{k} {v:.2e}" if k == "lr" else f"{k} {v:.4g}")
    parts.append(f"{img_per_s:.0f} img/s")
    parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)
