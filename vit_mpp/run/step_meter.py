"""The bookkeeping of a training loop's steps, the same for both stages: `StepMeter` sums what each step produced,
and at log steps averages it over steps and processes, prints the progress line, writes metrics.jsonl (with the run's
times, the share of time spent waiting for data, MFU, peak memory) and sends it to the trackers; at the end it writes
the run's summary. Where the time goes is read from the host's clock at calls the loop makes anyway, never from a
device synchronisation. See docs/pretrain.md#what-a-run-prints."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from vit_mpp.config.sections import TrainConfig
from vit_mpp.progress import format_duration
from vit_mpp.run import run_clock
from vit_mpp.run.curves import CURVES_NAME, read_metrics, write_run_curves
from vit_mpp.run.flops import peak_flops, training_flops
from vit_mpp.run.run_dir import MetricsLog
from vit_mpp.run.run_summary import RunTimes, summary_lines, summary_record, write_summary
from vit_mpp.run.schedule import itstime
from vit_mpp.run.tracking import log_images, log_scalars

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


def micro_batch_output(out: dict[str, Any], batch: dict[str, Any], set_names: list[str]) -> dict[str, Any]:
    """What the meter keeps of one micro-batch: the model's output, the undecodable samples the stream replaced and,
    for a mixture, the share of each set (`mix_<name>`: averaged, the realised proportions)."""
    metrics = dict(out.get("metrics", {}))
    if len(set_names) > 1:
        counts = torch.bincount(torch.tensor(batch["set"]), minlength=len(set_names)).float() / len(batch["set"])
        metrics.update({f"mix_{name}": counts[i] for i, name in enumerate(set_names)})
    return {**out, "metrics": metrics, "bad_samples": batch["bad"]}


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
    records = read_metrics(log.path.parent)

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


def evaluations_due(step: int, every: int | None, total: int) -> int:
    """How many evaluations are due at steps `step`..`total` (every `every` steps and at the last, as
    vit_mpp/run/schedule.py `itstime` decides; None: the run does not evaluate)."""
    if every is None:
        return 0
    periodic = total // every - (step - 1) // every if every > 0 else 0
    return periodic + (0 if every > 0 and total % every == 0 else int(step <= total))


class StepMeter:
    """Sums what each optimizer step produces; when a log is due, reports it once for all processes.

    Time: the loop calls `data_ready()` once a step's micro-batches are in hand and `log()` after every step; the
    interval before `data_ready` is the wait for data (or a checkpoint's save, when one was saved meanwhile), the
    interval from it to `log` the step's computation, and the interval from `log` to `log_eval` (and KeepBest's
    `evaluation_done`) an evaluation. Only the host's clock is read: no device synchronisation outside log steps."""

    def __init__(self, accelerator: Accelerator, log: MetricsLog, train: TrainConfig, *, start_step: int,
                 total_steps: int, bad_total: int = 0) -> None:
        self.accelerator, self.metrics_log = accelerator, log
        self.total, self.batch_size, self.log_every = total_steps, train.batch_size, train.log_every
        self.bad_total = bad_total  # undecodable samples replaced so far in the run, all processes (checkpointed)
        self.start_step = self.last_step = start_step
        self.start_time = self.mark = time.perf_counter()  # mark: where the interval being timed began
        self.before = previous_times(log) if start_step else Before()  # resumed: the run's times until then
        self.elapsed_before = self.before.elapsed
        self.curves_sent_at: int | None = None
        self.laps, self.logged = Laps(), Laps()  # this process's, and as they were at the last log
        self.saving = False  # a checkpoint was saved since the last step ended
        self.told_data = False  # the loop calls data_ready (else a step's wait is part of its computation)
        self.eval_every: int | None = getattr(train, "eval_every", 0)  # pretraining's; fine-tuning tells its own
        self.mixed_precision, self.peak_tflops = train.mixed_precision, getattr(train, "peak_tflops", 0.0)
        self._flops: tuple[float | None, float | None] | None = None  # (per training image, peak/s), at first use
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.steps = 0  # optimizer steps summed since the last log
        self.images = 0
        self.bad = 0  # on this process, since the last log

    def data_ready(self) -> None:
        """The step's micro-batches are in hand: call right after `next(...)` returns them. The time since the last
        step (or evaluation) ended was spent waiting for them, or saving a checkpoint when one was saved meanwhile."""
        now = time.perf_counter()
        if self.saving:
            self.laps.checkpoint += now - self.mark
        else:
            self.laps.wait += now - self.mark
        self.saving, self.mark, self.told_data = False, now, True

    def evaluates_every(self, steps: int | None) -> None:
        """The run evaluates every `steps` steps and at its last (0: at the last only; None: never), for the ETA.
        Pretraining's `train.eval_every` is the default."""
        self.eval_every = steps

    def evaluation_done(self) -> None:
        """The evaluation logged last went on until now (fine-tuning's confusion matrix and best export): its time
        is the evaluation's, not a wait for data."""
        now = time.perf_counter()
        self.laps.evaluation += now - self.mark
        self.mark = now

    def add(self, outputs: list[dict[str, Any]]) -> None:
        """One optimizer step: the outputs of its micro-batches (`loss`, `metrics`, `bad_samples`)."""
        for out in outputs:
            self.bad += int(out.get("bad_samples", 0))
            for k, v in {"loss": out["loss"].detach(), **out.get("metrics", {})}.items():
                self.sums[k] = self.sums.get(k, 0.0) + v / len(outputs)
        self.steps += 1
        self.images += self.batch_size

    def log(self, step: int, lr: float, **extra: Any) -> dict[str, Any] | None:
        """Call after every step. At a due step (every `log_every` and the last): the averaged record, printed,
        written and tracked."""
        self._lap_step()
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
        interval = self.laps.since(self.logged)
        rate = self.images / max(1e-9, interval.training)  # training time only: an evaluation is no slower step
        costs = self._costs(interval)
        shown = {k: metrics[k] for k in SHOWN if k in metrics}
        self.accelerator.print(progress_line(step, self.total, {**shown, "lr": lr}, rate, self.eta(step), costs))
        record = {"step": step, **extra, "lr": lr, "img_per_s": rate, **costs, "bad_samples": bad_now,
                  "bad_samples_total": self.bad_total, **metrics, "elapsed_s": self.elapsed(),
                  "train_s": round(self.before.training + self.laps.training, 1), "run_s": self.run_time()}
        self.metrics_log.write(record)
        log_scalars(self.accelerator, record, step)
        self.last_step, self.logged = step, dataclasses.replace(self.laps)
        self._reset()
        return record

    def _lap_step(self) -> None:
        """The step that ends now: its time since its data arrived is computation (all of it, for a loop that does
        not call `data_ready`; a checkpoint's save when one was saved meanwhile)."""
        now = time.perf_counter()
        if self.saving:
            self.laps.checkpoint += now - self.mark
        else:
            self.laps.compute += now - self.mark
        self.laps.steps += 1
        if self.laps.steps == 1:
            self.laps.first_step = self.laps.training
        self.saving, self.mark = False, now

    def _costs(self, interval: Laps) -> dict[str, float]:
        """The share of the interval's training time spent waiting for data; MFU when the device's peak is known;
        the device's peak memory since the last log (CUDA; the counter is then reset). Nothing waits for the
        device."""
        costs = {"data_wait": round(interval.wait / max(1e-9, interval.training), 4)} if self.told_data else {}
        flops, peak = self._flops_and_peak()
        if flops and peak and interval.training > 0:
            costs["mfu"] = round(flops * self.images / interval.training / (peak * self.accelerator.num_processes), 4)
        device = self.accelerator.device
        if device.type == "cuda":
            costs["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            torch.cuda.reset_peak_memory_stats(device)
        return costs

    def _flops_and_peak(self) -> tuple[float | None, float | None]:
        """(FLOPs per training image of the run's model, peak FLOP/s of one device), worked out once: the model is
        the one the run prepared with its accelerator (vit_mpp/run/flops.py)."""
        if self._flops is None:
            models = getattr(self.accelerator, "_models", [])  # what accelerator.prepare was given
            flops = training_flops(self.accelerator.unwrap_model(models[0])) if models else None
            self._flops = (flops, peak_flops(self.accelerator.device, self.mixed_precision, self.peak_tflops))
        return self._flops

    def eta(self, step: int) -> float:
        """Seconds left after `step`: the steps left at this process's time per training step (its first step, the
        loader's start and compilation, left out once there are others) plus the evaluations left at their mean
        measured time (none until one is measured)."""
        laps = self.laps
        per_step = ((laps.training - laps.first_step) / (laps.steps - 1) if laps.steps > 1
                    else laps.training / max(1, laps.steps))
        per_eval = laps.evaluation / laps.evaluations if laps.evaluations else 0.0
        return per_step * (self.total - step) + per_eval * evaluations_due(step, self.eval_every, self.total)

    def run_time(self) -> float:
        """The run's wall time in seconds, to 0.1 s: before this process (a resumed run), then since its stage's
        main started (vit_mpp/run/run_clock.py)."""
        return round(self.before.run + time.perf_counter() - run_clock.started(), 1)

    def elapsed(self) -> float:
        """The run's training time in seconds, to 0.1 s: before this process (a resumed run), then since its meter
        was made."""
        return round(self.elapsed_before + time.perf_counter() - self.start_time, 1)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the meter (call on every process: it sums over them). Called as a checkpoint
        is saved: the time until the next step's data arrives is the save's."""
        self.saving = True
        pending = torch.tensor(float(self.bad), device=self.accelerator.device)
        return {"bad_samples_total": self.bad_total + int(round(self.accelerator.reduce(pending, "sum").item()))}

    def log_eval(self, step: int, result: dict[str, Any], label: str, split_size: int,
                 details: dict[str, Any] | None = None) -> None:
        """An evaluation's numbers: printed (`eval LABEL | ...`), written with `details`, and tracked.

        When `result["val_samples"]` is short of the split's `split_size` (undecodable images), a warning says so
        and `val_unread` records how many were not counted."""
        took = time.perf_counter() - self.mark  # since the step before it was logged
        result, warning = with_unread(result, split_size)
        if warning:
            self.accelerator.print(warning)
        shown = " | ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)))
        self.accelerator.print(f"eval {label} | {shown} | took {format_duration(took)}")
        self.metrics_log.write({"step": step, **result, **(details or {}), "eval_s": round(took, 1),
                                "elapsed_s": self.elapsed(), "run_s": self.run_time()})
        log_scalars(self.accelerator, result, step)
        self.last_step = step
        self.draw()
        self.laps.evaluations += 1
        self.evaluation_done()

    def draw(self) -> None:
        """Write the run's curves.png from its metrics.jsonl (main process), and send it to the trackers that take
        images; at each evaluation and at the end."""
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
        flops, peak = self._flops_and_peak()
        mfu = (flops * trained / laps.training / (peak * self.accelerator.num_processes)
               if flops and peak and laps.training > 0 else None)
        training = before.training + laps.training
        times = RunTimes(self.last_step, self.run_time(), training, before.evaluation + laps.evaluation,
                         self.last_step * self.batch_size / training if training > 0 else None,
                         laps.wait / laps.training if laps.training > 0 and self.told_data else None, mfu)
        run_dir = self.metrics_log.path.parent
        summary = summary_record(run_dir, times, exports)
        path = write_summary(run_dir, summary)
        for line in summary_lines(summary, path):
            self.accelerator.print(line)
        return summary

    def realised_shares(self, names: list[str]) -> dict[str, float]:
        """A mixture's realised share of each set over the run: the mean of the `mix_<name>` its logs carry (main
        process; {} elsewhere and for one set)."""
        if not self.metrics_log.is_main or len(names) < 2:
            return {}
        records = read_metrics(self.metrics_log.path.parent)
        shares = {n: [r[f"mix_{n}"] for r in records if isinstance(r.get(f"mix_{n}"), (int, float))] for n in names}
        return {n: round(sum(v) / len(v), 4) for n, v in shares.items() if v}
