"""The bookkeeping of the training loop's steps (vit_mpp/run/loop.py), the same for both stages: `StepMeter` sums
what each step produced and where the loop says its time went (waiting for data, computing, saving checkpoints,
evaluating: the host's clock, never a device synchronisation), and at log steps averages it over steps and processes,
prints the progress line, writes metrics.jsonl (with the run's times, the share of time spent waiting for data, MFU,
peak memory) and sends it to the trackers; at the end it writes the run's summary. See
docs/pretrain.md#what-a-run-prints."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from vit_mpp.config.sections import TrainConfig
from vit_mpp.models.flops import peak_flops
from vit_mpp.progress import format_duration
from vit_mpp.run.metering import run_clock
from vit_mpp.run.metering.curves import CURVES_NAME, write_run_curves
from vit_mpp.run.metering.metrics_log import MetricsLog
from vit_mpp.run.metering.summary import RunTimes, summary_lines, summary_record, write_summary
from vit_mpp.run.metering.tracking import log_images, log_scalars

CURVES_EVERY_S = 60.0  # curves.png redrawn at an evaluation at most this often (and at the end)
SHOWN = ("loss", "acc")  # the metrics the progress line shows, besides lr, rate and eta


def plain_number(value: float) -> str:
    """A count as people write it: `1160`, not `1.16e+03`; `2.5` or `0.33` when it is not whole."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.2f}".rstrip("0")


def progress_line(step: int, total: int, metrics: dict[str, float], img_per_s: float, eta_s: float,
                  costs: dict[str, float] | None = None) -> str:
    """`step 500/100000 | loss 0.731 | acc 0.42 | lr 1.5e-4 | 4830 img/s | data wait 2% | MFU 41% | mem 12.3 GiB |
    eta 5h51m` (`costs`: `data_wait`, `mfu`, `peak_mem_gib`, each shown when given)."""
    parts = [f"step {step}/{total}"]
    for k, v in metrics.items():
        parts.append(f"{k} {v:.2e}" if k == "lr" else f"{k} {v:.4g}")
    parts.append(f"{img_per_s:.0f} img/s")
    costs = costs or {}
    if "data_wait" in costs:
        parts.append(f"data wait {costs['data_wait']:.0%}")
    if "mfu" in costs:
        parts.append(f"MFU {costs['mfu']:.0%}")
    if "peak_mem_gib" in costs:
        parts.append(f"mem {costs['peak_mem_gib']:.1f} GiB")
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


@dataclass
class Before:
    """What the run's records reached before this process (a resumed run): `elapsed_s`, `run_s` and `train_s` at
    their last record, and the evaluations' `eval_s` summed."""

    elapsed: float = 0.0
    run: float = 0.0
    training: float = 0.0
    evaluation: float = 0.0


def previous_times(log: MetricsLog) -> Before:
    """The times the run's metrics.jsonl (rewound to the step this process resumes from) carries; zeros without
    records that carry them, and off the main process (only it writes records)."""
    if not log.is_main:
        return Before()
    records = log.records()

    def numbers(key: str) -> list[float]:
        return [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]

    return Before(max(numbers("elapsed_s"), default=0.0), max(numbers("run_s"), default=0.0),
                  max(numbers("train_s"), default=0.0), sum(numbers("eval_s")))


@dataclass
class Laps:
    """Where this process's time went since its meter was made, in seconds: training steps (waiting for their
    data, computing, saving checkpoints) and evaluations."""

    wait: float = 0.0
    compute: float = 0.0
    checkpoint: float = 0.0
    evaluation: float = 0.0
    evaluations: int = 0
    steps: int = 0
    first_step: float = 0.0  # the first step's time, which carries the loader's start, compilation, warm-up

    @property
    def training(self) -> float:
        return self.wait + self.compute + self.checkpoint

    def since(self, earlier: Laps) -> Laps:
        return Laps(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(earlier))))


@dataclass
class Evaluation:
    """What one evaluation reports: its numbers (printed, written, tracked; `val_samples` counts the images scored),
    the step or epoch it names, the size of the split it read, and `details` written to metrics.jsonl only."""

    metrics: dict[str, Any]
    label: str
    split_size: int
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Workload:
    """What the run trains on and with: its training sets' names (a mixture's shares are logged as `mix_<name>`) and
    the training FLOPs of one image of its model (for MFU; None when unknown)."""

    set_names: list[str]
    flops_per_image: float | None = None


class StepMeter:
    """Sums what each optimizer step produces; when the loop logs, reports it once for all processes.

    `state`: the trainer state of the checkpoint the run resumes from ({} for a new run): its step, and what the meter
    saved there (`state()`)."""

    def __init__(self, accelerator: Accelerator, log: MetricsLog, train: TrainConfig, total_steps: int,
                 state: dict[str, Any], workload: Workload) -> None:
        self.accelerator, self.metrics_log = accelerator, log
        self.total, self.batch_size = total_steps, train.batch_size
        self.start_step = self.last_step = int(state.get("step", 0))
        self.bad_total = int(state.get("bad_samples_total", 0))  # undecodable samples replaced so far, all processes
        self.set_samples = Counter({int(k): v for k, v in state.get("set_samples", {}).items()})  # this rank's
        self.start_time = time.perf_counter()
        self.before = previous_times(log) if self.start_step else Before()  # resumed: the run's times until then
        self.curves_sent_at: int | None = None
        self.drawn_at = self.start_time  # curves.png: drawn at an evaluation CURVES_EVERY_S after the last
        self.laps, self.logged = Laps(), Laps()  # this process's, and as they were at the last log
        self.peak = peak_flops(accelerator.device, train.mixed_precision, getattr(train, "peak_tflops", 0.0))
        self.names, self.flops_per_image = workload.set_names, workload.flops_per_image
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.steps = 0  # optimizer steps summed since the last log
        self.images = 0
        self.bad = 0  # on this process, since the last log

    def step_done(self, outputs: list[dict[str, Any]], micro_batches: list[dict[str, Any]], wait_s: float,
                  compute_s: float) -> None:
        """One optimizer step: its micro-batches' outputs (`loss`, `metrics`) and the batches themselves (undecodable
        samples replaced, and for a mixture each set's share, `mix_<set>`), the time the loop waited for them and
        the time the step took. Nothing here reads a device tensor."""
        names = self.names
        for out, batch in zip(outputs, micro_batches):
            self.bad += int(batch["bad"])
            metrics = {"loss": out["loss"].detach(), **out.get("metrics", {})}
            if len(names) > 1:
                counts = Counter(batch["set"])
                self.set_samples.update(counts)
                metrics.update({f"mix_{name}": counts[i] / len(batch["set"]) for i, name in enumerate(names)})
            for k, v in metrics.items():
                self.sums[k] = self.sums.get(k, 0.0) + v / len(outputs)
        self.steps += 1
        self.images += self.batch_size
        self.laps.wait += wait_s
        self.laps.compute += compute_s
        self.laps.steps += 1
        if self.laps.steps == 1:
            self.laps.first_step = self.laps.training

    def spent(self, what: str, seconds: float) -> None:
        """Time the loop spent outside its steps: on `checkpoint` saves, or `compute` (its own bookkeeping)."""
        setattr(self.laps, what, getattr(self.laps, what) + seconds)

    def log(self, step: int, lr: float, evaluations_left: int, extra: dict[str, Any]) -> dict[str, Any] | None:
        """The record of the steps since the last log, averaged over them and over processes (one collective):
        printed, written with `extra`, and tracked. `evaluations_left`: evaluations the loop will still run, for the
        ETA. None when no step was summed since the last log."""
        if not self.steps:
            return None
        keys = sorted(self.sums)
        values = [torch.as_tensor(self.sums[k], dtype=torch.float32, device=self.accelerator.device) / self.steps
                  for k in keys]
        bad = torch.tensor(float(self.bad), device=self.accelerator.device)
        totals = self.accelerator.reduce(torch.stack([*values, bad]), reduction="sum").tolist()  # one collective
        metrics = {k: v / self.accelerator.num_processes for k, v in zip(keys, totals)}
        bad_now = int(round(totals[-1]))
        self.bad_total += bad_now
        interval = self.laps.since(self.logged)
        rate = self.images / max(1e-9, interval.training)  # training time only: an evaluation is no slower step
        costs = self._costs(interval)
        shown = {k: metrics[k] for k in SHOWN if k in metrics}
        self.accelerator.print(progress_line(step, self.total, {**shown, "lr": lr}, rate,
                                             self.eta(step, evaluations_left), costs))
        record = {"step": step, **extra, "lr": lr, "img_per_s": rate, **costs, "bad_samples": bad_now,
                  "bad_samples_total": self.bad_total, **metrics, "elapsed_s": self.elapsed(),
                  "train_s": round(self.before.training + self.laps.training, 1), "run_s": self.run_time()}
        self.metrics_log.write(record)
        log_scalars(self.accelerator, record, step)
        self.last_step, self.logged = step, dataclasses.replace(self.laps)
        self._reset()
        return record

    def _costs(self, interval: Laps) -> dict[str, float]:
        """The share of the interval's training time spent waiting for data; MFU when the device's peak is known;
        the device's peak memory since the last log (CUDA; the counter is then reset). Nothing waits for the
        device."""
        costs = {"data_wait": round(interval.wait / max(1e-9, interval.training), 4)}
        mfu = self._mfu(self.images, interval.training)
        if mfu is not None:
            costs["mfu"] = round(mfu, 4)
        device = self.accelerator.device
        if device.type == "cuda":
            costs["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            torch.cuda.reset_peak_memory_stats(device)
        return costs

    def _mfu(self, images: int, seconds: float) -> float | None:
        """The model FLOPs utilisation of `images` trained in `seconds` by every process, when FLOPs and peak are
        known."""
        if not (self.flops_per_image and self.peak and seconds > 0):
            return None
        return self.flops_per_image * images / seconds / (self.peak * self.accelerator.num_processes)

    def eta(self, step: int, evaluations_left: int) -> float:
        """Seconds left after `step`: the steps left at this process's time per training step (its first step, the
        loader's start and compilation, left out once there are others) plus `evaluations_left` at their mean
        measured time (none until one is measured)."""
        laps = self.laps
        per_step = ((laps.training - laps.first_step) / (laps.steps - 1) if laps.steps > 1
                    else laps.training / max(1, laps.steps))
        per_eval = laps.evaluation / laps.evaluations if laps.evaluations else 0.0
        return per_step * (self.total - step) + per_eval * evaluations_left

    def run_time(self) -> float:
        """The run's wall time in seconds, to 0.1 s: before this process (a resumed run), then since its stage's
        main started (vit_mpp/run/metering/run_clock.py)."""
        return round(self.before.run + time.perf_counter() - run_clock.started(), 1)

    def elapsed(self) -> float:
        """The run's training time in seconds, to 0.1 s: before this process (a resumed run), then since its meter
        was made."""
        return round(self.before.elapsed + time.perf_counter() - self.start_time, 1)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the meter: undecodable samples replaced so far (a sum over processes: call it
        on every process) and the samples taken from each set of a mixture."""
        pending = torch.tensor(float(self.bad), device=self.accelerator.device)
        bad = self.bad_total + int(round(self.accelerator.reduce(pending, "sum").item()))
        return {"bad_samples_total": bad, "set_samples": {str(k): v for k, v in sorted(self.set_samples.items())}}

    def log_eval(self, step: int, evaluation: Evaluation, took: float) -> None:
        """An evaluation of `took` seconds: printed (`eval LABEL | ...`), written with its details, and tracked.

        When `val_samples` is short of the split's size (undecodable images), a warning says so and `val_unread`
        records how many were not counted."""
        result, warning = with_unread(evaluation.metrics, evaluation.split_size)
        if warning:
            self.accelerator.print(warning)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)))
        self.accelerator.print(f"eval {evaluation.label} | {shown} | took {format_duration(took)}")
        self.metrics_log.write({"step": step, **result, **evaluation.details, "eval_s": round(took, 1),
                                "elapsed_s": self.elapsed(), "run_s": self.run_time()})
        log_scalars(self.accelerator, result, step)
        self.last_step = step
        if time.perf_counter() - self.drawn_at >= CURVES_EVERY_S:
            self.draw()
        self.laps.evaluation += took
        self.laps.evaluations += 1

    def draw(self) -> None:
        """Write the run's curves.png from its metrics.jsonl (main process), and send it to the trackers that take
        images; at the end, and at an evaluation a minute or more after the last draw (a draw takes a second or two,
        which every other rank waits at its next collective)."""
        self.drawn_at = time.perf_counter()
        if self.accelerator.is_main_process:
            path = write_run_curves(self.metrics_log.path.parent)
            if path is not None and self.curves_sent_at != self.last_step:  # the final draw repeats the last eval's
                log_images(self.accelerator, {CURVES_NAME.removesuffix(".png"): path}, self.last_step)
                self.curves_sent_at = self.last_step

    def report_run(self, exports: list[Path]) -> dict[str, Any] | None:
        """At the very end of a run, after its exports: the run's summary (total time from its stage's start, training
        and evaluation time, mean img/s, data wait, MFU, final and best metrics, the `exports` that exist), printed
        as a short block and written to run_dir/summary.json by the main process, which returns it."""
        if not self.accelerator.is_main_process:
            return None
        laps, before = self.laps, self.before
        trained = (self.last_step - self.start_step) * self.batch_size  # images of this process's steps
        training = before.training + laps.training
        times = RunTimes(self.last_step, self.run_time(), training, before.evaluation + laps.evaluation,
                         self.last_step * self.batch_size / training if training > 0 else None,
                         laps.wait / laps.training if laps.training > 0 else None, self._mfu(trained, laps.training))
        run_dir = self.metrics_log.path.parent
        summary = summary_record(run_dir, times, exports, torch.get_num_threads())
        path = write_summary(run_dir, summary)
        for line in summary_lines(summary, path):
            self.accelerator.print(line)
        return summary

    def realised_shares(self) -> dict[str, float]:
        """A mixture's realised share of each set over the run so far, from the samples its steps took ({} for one
        set)."""
        total = sum(self.set_samples.values())
        if len(self.names) < 2 or not total:
            return {}
        return {name: round(self.set_samples[i] / total, 4) for i, name in enumerate(self.names)}
