"""The bookkeeping of a training loop's steps, the same for both stages: `StepMeter` sums what each step produced,
and at log steps averages it over steps and processes, prints the progress line, writes metrics.jsonl (with the run's
training time, `elapsed_s`) and sends it to the trackers. See docs/pretrain.md."""

from __future__ import annotations

import time
from typing import Any

import torch
from accelerate import Accelerator

from vit_mpp.config.sections import TrainConfig
from vit_mpp.progress import format_duration
from vit_mpp.run.curves import CURVES_NAME, read_metrics, write_run_curves
from vit_mpp.run.run_dir import MetricsLog
from vit_mpp.run.schedule import itstime
from vit_mpp.run.tracking import log_images, log_scalars

SHOWN = ("loss", "acc")  # the metrics the progress line shows, besides lr, rate and eta


def plain_number(value: float) -> str:
    """A count as people write it: `1160`, not `1.16e+03`; `2.5` or `0.33` when it is not whole."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.2f}".rstrip("0")


def progress_line(step: int, total: int, metrics: dict[str, float], img_per_s: float, eta_s: float) -> str:
    """`step 500/100000 | loss 0.731 | acc 0.42 | lr 1.5e-4 | 4830 img/s | eta 5h51m`."""
    parts = [f"step {step}/{total}"]
    for k, v in metrics.items():
        parts.append(f"{k} {v:.2e}" if k == "lr" else f"{k} {v:.4g}")
    parts.append(f"{img_per_s:.0f} img/s")
    parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def with_unread(result: dict[str, Any], split_size: int) -> tuple[dict[str, Any], str | None]:
    """An evaluation's `result` with `val_unread` (images of the split that were not counted: undecodable) when it
    is short of `split_size`, and the warning that says so; (result, None) when every image counted."""
    unread = split_size - int(result.get("val_samples", split_size))
    if not unread:
        return result, None
    return {**result, "val_unread": unread}, (f"warning: evaluation counted {split_size - unread} of the {split_size} "
                                              f"images of the split: {unread} could not be decoded")


def micro_batch_output(out: dict[str, Any], batch: dict[str, Any], set_names: list[str]) -> dict[str, Any]:
    """What the meter keeps of one micro-batch: the model's output, the undecodable samples the stream replaced and,
    for a mixture, the share of each set (`mix_<name>`: averaged, the realised proportions)."""
    metrics = dict(out.get("metrics", {}))
    if len(set_names) > 1:
        counts = torch.bincount(torch.tensor(batch["set"]), minlength=len(set_names)).float() / len(batch["set"])
        metrics.update({f"mix_{name}": counts[i] for i, name in enumerate(set_names)})
    return {**out, "metrics": metrics, "bad_samples": batch["bad"]}


def previous_elapsed(log: MetricsLog) -> float:
    """The training time the run's records reached before this process (its metrics.jsonl, rewound to the step it
    resumes from); 0 without records that carry it."""
    if not log.is_main:
        return 0.0  # only the main process writes records
    times = [r["elapsed_s"] for r in read_metrics(log.path.parent) if isinstance(r.get("elapsed_s"), (int, float))]
    return float(max(times, default=0.0))


class StepMeter:
    """Sums what each optimizer step produces; when a log is due, reports it once for all processes."""

    def __init__(self, accelerator: Accelerator, log: MetricsLog, train: TrainConfig, *, start_step: int,
                 total_steps: int, bad_total: int = 0) -> None:
        self.accelerator, self.metrics_log = accelerator, log
        self.total, self.batch_size, self.log_every = total_steps, train.batch_size, train.log_every
        self.bad_total = bad_total  # undecodable samples replaced so far in the run, all processes (checkpointed)
        self.start_step = self.last_step = start_step
        self.start_time = self.last_time = time.perf_counter()
        self.elapsed_before = previous_elapsed(log) if start_step else 0.0  # resumed: the run's time until then
        self.curves_sent_at: int | None = None
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.steps = 0  # optimizer steps summed since the last log
        self.images = 0
        self.bad = 0  # on this process, since the last log

    def add(self, outputs: list[dict[str, Any]]) -> None:
        """One optimizer step: the outputs of its micro-batches (`loss`, `metrics`, `bad_samples`)."""
        for out in outputs:
            self.bad += int(out.get("bad_samples", 0))
            for k, v in {"loss": out["loss"].detach(), **out.get("metrics", {})}.items():
                self.sums[k] = self.sums.get(k, 0.0) + v / len(outputs)
        self.steps += 1
        self.images += self.batch_size

    def log(self, step: int, lr: float, **extra: Any) -> dict[str, Any] | None:
        """At a due step (every `log_every` and the last): the averaged record, printed, written and tracked."""
        if not itstime(step, self.log_every, self.total) or not self.steps:
            return None
        keys = sorted(self.sums)
        values = [torch.as_tensor(self.sums[k], dtype=torch.float32, device=self.accelerator.device) / self.steps
                  for k in keys]
        bad = torch.tensor(float(self.bad), device=self.accelerator.device)
        totals = self.accelerator.reduce(torch.stack([*values, bad]), reduction="sum").tolist()  # one collective
        metrics = {k: v / self.accelerator.num_processes for k, v in zip(keys, totals)}
        bad_now = int(round(totals[-1]))
        self.bad_total += bad_now
        now = time.perf_counter()
        rate = self.images / max(1e-9, now - self.last_time)
        eta = (now - self.start_time) / max(1, step - self.start_step) * (self.total - step)
        shown = {k: metrics[k] for k in SHOWN if k in metrics}
        self.accelerator.print(progress_line(step, self.total, {**shown, "lr": lr}, rate, eta))
        record = {"step": step, **extra, "lr": lr, "img_per_s": rate, "bad_samples": bad_now,
                  "bad_samples_total": self.bad_total, **metrics, "elapsed_s": self.elapsed()}
        self.metrics_log.write(record)
        log_scalars(self.accelerator, record, step)
        self.last_time, self.last_step = now, step
        self._reset()
        return record

    def elapsed(self) -> float:
        """The run's training time in seconds, to 0.1 s: before this process (a resumed run), then since its meter
        was made."""
        return round(self.elapsed_before + time.perf_counter() - self.start_time, 1)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the meter (call on every process: it sums over them)."""
        pending = torch.tensor(float(self.bad), device=self.accelerator.device)
        return {"bad_samples_total": self.bad_total + int(round(self.accelerator.reduce(pending, "sum").item()))}

    def log_eval(self, step: int, result: dict[str, Any], label: str, split_size: int,
                 details: dict[str, Any] | None = None) -> None:
        """An evaluation's numbers: printed (`eval LABEL | ...`), written with `details`, and tracked.

        When `result["val_samples"]` is short of the split's `split_size` (undecodable images), a warning says so
        and `val_unread` records how many were not counted."""
        result, warning = with_unread(result, split_size)
        if warning:
            self.accelerator.print(warning)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)))
        self.accelerator.print(f"eval {label} | {shown}")
        self.metrics_log.write({"step": step, **result, **(details or {}), "elapsed_s": self.elapsed()})
        log_scalars(self.accelerator, result, step)
        self.last_step = step
        self.draw()

    def draw(self) -> None:
        """Write the run's curves.png from its metrics.jsonl (main process), and send it to the trackers that take
        images; at each evaluation and at the end."""
        if self.accelerator.is_main_process:
            path = write_run_curves(self.metrics_log.path.parent)
            if path is not None and self.curves_sent_at != self.last_step:  # the final draw repeats the last eval's
                log_images(self.accelerator, {CURVES_NAME.removesuffix(".png"): path}, self.last_step)
                self.curves_sent_at = self.last_step
