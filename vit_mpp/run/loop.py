"""The training loop both stages run (`fit`), one step of it and what it asks before each, in the order it runs:

    the step's micro-batches (`next(batches)`, through the run's `StopSignals.take`: a wait a stop signal cuts short)
    -> the stop agreement of every rank (`StopGate`: stop and save the last step, or save for time) -> the learning
    rate (`Schedule`) -> per micro-batch the stage's forward pass (its `Objective`), backward, and on the last one
    clipping and the update (`optimizer_step`) -> the step meter, the sample audit, and when due the log, an
    evaluation and a checkpoint.

A stage builds its model and its `Objective` and hands them to `fit`; the loop owns the order, the checkpointer only
saves, the data stream only hands out batches; the signals and the agreement are vit_mpp/processes/'s.
docs/architecture.md follows one step through it.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator

from vit_mpp.config.engine import to_dict
from vit_mpp.config.sections import OptimConfig
from vit_mpp.data.stream import to_device
from vit_mpp.errors import Preempted, StoppedUnsaved
from vit_mpp.models.flops import training_flops
from vit_mpp.processes.stop_agreement import StopGate
from vit_mpp.run.durability.checkpoint import Checkpointer
from vit_mpp.run.metering.step_meter import Evaluation, StepMeter, Workload
from vit_mpp.run.metering.tracking import finish_trackers, start_trackers
from vit_mpp.run.start.run import Resumed, Run

T = TypeVar("T")
Gate = Callable[[Iterable[Any]], Iterator[Any]]  # an evaluation's batches, each through the stop agreement


# ---------------------------------------------------------------- when: the learning rate and periodic actions

@dataclass(frozen=True)
class Schedule:
    """The learning rate as a pure function of the optimizer step: linear warmup to `peak`, then cosine decay to
    `min_ratio` of it at step `total`."""

    peak: float
    warmup: int
    total: int
    min_ratio: float = 0.0

    @classmethod
    def of(cls, optim: OptimConfig, batch_size: int, total_steps: int) -> Schedule:
        """The schedule of a run of `total_steps` at global batch `batch_size`: its peak is `peak_lr`'s, its warmup
        `optim.warmup_steps`, capped at `optim.warmup_max_fraction` of the run."""
        warmup = min(optim.warmup_steps, int(optim.warmup_max_fraction * total_steps))
        return cls(peak_lr(optim, batch_size), warmup, total_steps, optim.min_lr_ratio)

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        floor = self.peak * self.min_ratio
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def peak_lr(optim: OptimConfig, batch_size: int) -> float:
    """`optim.lr` when set, else `optim.base_lr` scaled linearly from `optim.base_batch_size` to the global batch
    size `batch_size`."""
    return optim.lr if optim.lr is not None else optim.base_lr * batch_size / optim.base_batch_size


def describe_lr(optim: OptimConfig, batch_size: int) -> str:
    """`lr 0.001 (base 0.0002 @ 4096)` or `lr 0.001 (optim.lr)`, for the start-up summary."""
    origin = "optim.lr" if optim.lr is not None else f"base {optim.base_lr:g} @ {optim.base_batch_size}"
    return f"lr {peak_lr(optim, batch_size):.3g} ({origin})"


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every group, honouring per-group scales (layer-wise decay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def itstime(step: int, every: int, total: int, last: bool = True) -> bool:
    """Whether a periodic action (log, evaluate, checkpoint) is due after optimizer step `step` (1-based): every
    `every` steps (0: never on a period), and, with `last`, at the run's final step `total`. Every periodic decision
    of the loop is asked here."""
    return (every > 0 and step % every == 0) or (last and step == total)


def evaluations_due(step: int, every: int | None, total: int) -> int:
    """How many evaluations are due at steps `step`..`total` (every `every` steps and at the last, as `itstime`
    decides; None: the run does not evaluate)."""
    if every is None:
        return 0
    periodic = total // every - (step - 1) // every if every > 0 else 0
    return periodic + (0 if every > 0 and total % every == 0 else int(step <= total))


# ---------------------------------------------------------------- what: the stage's part, and one update

@dataclass(frozen=True)
class At:
    """What the loop tells its objective at an evaluation and at the end: the last completed step, a mixture's
    realised share of each set so far ({} for one set), and `gated`, through which an evaluation takes its batches
    (`for batch in at.gated(loader)`): each passes the stop agreement, so a stop during an evaluation saves the last
    step and ends the run at its next batch."""

    step: int
    shares: dict[str, float]
    gated: Gate


@dataclass
class Finished:
    """What a stage's end made: the export folders (the run's summary lists those that exist) and the final metrics
    the trackers get."""

    exports: list[Path]
    metrics: dict[str, Any]


class Objective:
    """What a stage gives the loop besides its model: the forward pass of a micro-batch and what the stage adds
    around the steps. The defaults do nothing; `forward`, `evaluate` and `finish` are each stage's own."""

    eval_every: int | None = None  # evaluate every this many steps and at the last (0: at the last only; None: never)
    num_classes: int | None = None  # with a classifier's count, every training label must be one of its classes
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None  # on each uint8 crop, in the loader workers
    pool_augment: Callable[[torch.Tensor], torch.Tensor] | None = None  # instead, on a pool's (semi-supervised)

    def forward(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        """A micro-batch on the device -> {"loss": scalar tensor, "metrics": {name: tensor}} (no host read)."""
        raise NotImplementedError

    def train_mode(self, model: torch.nn.Module) -> None:
        """Put the model in training mode: at the start and after each evaluation."""
        model.train()

    def after_update(self, model: torch.nn.Module) -> None:
        """After each optimizer update (an EMA follows the weights)."""

    def log_extra(self, step: int) -> dict[str, Any]:
        """What a log record of `step` carries besides the step's numbers (fine-tuning: its epoch)."""
        return {}

    def evaluate(self, model: torch.nn.Module, at: At) -> Evaluation:
        """Score the model at `at.step` (every process calls it: its reductions are collective)."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What a checkpoint's trainer state keeps of the stage (every process calls it)."""
        return {}

    def rank_state(self) -> dict[str, Any] | None:
        """This process's own state a checkpoint keeps (a generator's), or None."""
        return None

    def finish(self, model: torch.nn.Module, at: At) -> Finished:
        """The end of the run: the exports (every process calls it: gathering a sharded model is collective)."""
        raise NotImplementedError


def optimizer_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   micro_batches: list[dict[str, Any]], forward: Callable[[dict[str, Any]], dict[str, Any]],
                   clip: float) -> list[dict[str, Any]]:
    """Each micro-batch to the device, `forward(batch)` (its outputs, with "loss"), backward; gradients are
    synchronised, clipped to norm `clip` (when > 0) and applied on the last micro-batch only (Accelerate's
    `accumulate`; a sharded model reduces its gradients' shards after every micro-batch). Returns the outputs of the
    micro-batches."""
    outputs = []
    for batch in micro_batches:
        batch = to_device(batch, accelerator.device)
        with accelerator.accumulate(model):
            out = forward(batch)
            accelerator.backward(out["loss"])
            if accelerator.sync_gradients:  # the optimizer of a sharded model is torch's own, not Accelerate's
                if clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        outputs.append(out)
    return outputs


# ---------------------------------------------------------------- the loop

def fit(run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, objective: Objective, schedule: Schedule,
        resumed: Resumed) -> None:
    """Train `model` (prepared by the run's accelerator) from `resumed.step` to `schedule.total`, then end the run:
    the objective's exports, the trackers' last numbers, the run's summary. Every process calls it."""
    Loop(run, model, optimizer, objective, schedule, resumed).train()


class Loop:
    """`fit`'s state: the run's batches, stop agreement, checkpointer and meter, and the last completed step."""

    def __init__(self, run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, objective: Objective,
                 schedule: Schedule, resumed: Resumed) -> None:
        accelerator, tc = run.accelerator, run.cfg.train
        self.run, self.model, self.optimizer, self.objective, self.schedule = run, model, optimizer, objective, schedule
        self.start = self.done = resumed.step  # where this process started; the last completed step
        self.generation = resumed.generation  # the data stream's position, saved in every checkpoint
        self.batches = run.train_loader(resumed, objective.num_classes, objective.augment, objective.pool_augment)
        self.gate = StopGate(accelerator, run.signals, tc.ckpt_every_minutes, tc.collective_timeout_s)
        self.checkpointer = Checkpointer(accelerator, tc.run_dir, tc.keep_last, resumed.step)
        workload = Workload(run.data.names, training_flops(accelerator.unwrap_model(model)))
        self.meter = StepMeter(accelerator, run.log, tc, schedule.total, resumed.state, workload)
        self.mark = time.perf_counter()  # where the interval being timed began
        start_trackers(accelerator, tc, run.cfg)

    def train(self) -> None:
        """Every step left, then the run's end."""
        self.run.signals.in_loop = True  # from now on a stop signal saves the last completed step
        self.objective.train_mode(self.model)
        for step in range(self.start, self.schedule.total):
            self.step(step)
        self.end()

    def step(self, step: int) -> None:
        """One optimizer step, then what is due after it."""
        micro_batches = self.run.signals.take(self.batches, self.run.gbatch.accum_steps)  # None: a signal cut it
        waited = self._lap()
        self._agree(stuck=micro_batches is None)  # stops the run here, before any rank commits to the step
        lr = self.schedule.lr(step)
        set_lr(self.optimizer, lr)
        outputs = optimizer_step(self.run.accelerator, self.model, self.optimizer, micro_batches,
                                 lambda batch: self.objective.forward(self.model, batch),
                                 self.run.cfg.optim.clip_grad_norm)
        self.objective.after_update(self.model)
        self.done = step + 1
        self.meter.step_done(outputs, micro_batches, waited, self._lap())
        self.run.audit.write(self.done, micro_batches)
        self._when_due(lr)

    def _when_due(self, lr: float) -> None:
        """The log, an evaluation and the periodic checkpoint, each when due after the step just done."""
        tc, done, total, every = self.run.cfg.train, self.done, self.schedule.total, self.objective.eval_every
        if itstime(done, tc.log_every, total):
            self.meter.log(done, lr, evaluations_due(done, every, total), self.objective.log_extra(done))
        if every is not None and itstime(done, every, total):
            self.meter.spent("compute", self._lap())
            evaluation = self.objective.evaluate(self.model, self._at())
            self.meter.log_eval(done, evaluation, self._lap())
            self.meter.spent("evaluation", self._lap())  # its line and the curves drawn with it
            self.objective.train_mode(self.model)
        if itstime(done, tc.ckpt_every, total) and self.checkpointer.saved != done:
            self._save()

    def _agree(self, stuck: bool) -> None:
        """The stop agreement (`StopGate`): a save due for time, or a stop, saves the last completed step first (if
        it is not saved yet); a stop then ends the run with Preempted (or StoppedUnsaved before anything exists)."""
        stop, time_due = self.gate.agree(stuck)
        if (stop or time_due) and self.done > 0 and self.checkpointer.saved != self.done:
            self._save()
        if not stop:
            return
        self.run.accelerator.end_training()
        if self.checkpointer.saved is None:
            signum = self.run.signals.received or signal.SIGTERM
            raise StoppedUnsaved(signum, signal.Signals(signum).name)
        raise Preempted(self.done, saved_now=self.done > self.start)  # else: the checkpoint resumed from

    def _gated(self, batches: Iterable[T]) -> Iterator[T]:
        """An evaluation's batches, each passing the stop agreement; every rank gets as many batches."""
        it = iter(batches)
        while True:
            got = self.run.signals.take(it, 1)
            self._agree(stuck=got is None)
            if not got:
                return
            yield got[0]

    def _save(self) -> None:
        """The checkpoint of the last completed step: model, optimizer and RNG (Accelerate's state), the data
        stream's position, the meter's and the stage's state."""
        run = self.run
        self.meter.spent("compute", self._lap())
        run.audit.flush()  # the sample audit's lines reach the disk before the checkpoint says they happened
        trainer = {"config": to_dict(run.cfg), "stream": self.generation.to_dict(), **self.meter.state(),
                   **self.objective.state(), "finished": self.done == self.schedule.total}
        self.checkpointer.save(self.done, trainer, self.objective.rank_state())
        self.gate.saved()
        self.meter.spent("checkpoint", self._lap())

    def _at(self) -> At:
        return At(self.done, self.meter.realised_shares(), self._gated)

    def _lap(self) -> float:
        """Seconds since the last lap (the loop says what they were spent on)."""
        now = time.perf_counter()
        took, self.mark = now - self.mark, now
        return took

    def end(self) -> None:
        """The run's end, once every rank agrees to go on (a stop now ends the run with its last step saved): the
        stream closed (now, not at the interpreter's exit), the curves, the audit, the stage's exports, the trackers'
        last numbers, the summary (with the exports' time)."""
        accelerator, tc = self.run.accelerator, self.run.cfg.train
        self._agree(stuck=False)  # a finished run run again has no step to ask before
        self.batches.close()
        self.meter.draw()
        self.run.audit.flush()
        finished = self.objective.finish(self.model, self._at())
        finish_trackers(accelerator, tc, finished.metrics)
        accelerator.end_training()
        self.meter.report_run(finished.exports)
