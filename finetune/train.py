"""Fine-tuning a ViT encoder into a classifier (the paper's rule: zero head, resized position embeddings): the stage's
spine (`train`) and its part of the one loop (`Finetuning`: the forward pass, EMA, evaluations, the exports).

    accelerate launch finetune --config configs/finetune/demo.yaml [key=value ...]
    accelerate launch -m finetune --config ...        (same, from any directory once installed)
    python -m finetune --config ...                   (one process)

Reads top to bottom: run -> model -> optimizer -> resume -> the loop (vit_mpp/run/loop.py) -> exports.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch

from finetune.augment import RandAugmentU8, pool_augment
from finetune.classes import Classes, classes_of
from finetune.classifier_export import ClassifierExporter, publish_exports
from finetune.config import FinetuneConfig
from finetune.ema import build_ema
from finetune.init_model import build_classifier, resolve_architecture
from finetune.keep_best import KeepBest
from finetune.loss import ClassificationLoss
from finetune.modes import PROBES, set_train_mode
from finetune.pool_gate import PoolGate, check_validation_apart
from finetune.semi import PseudoLabelLoss
from vit_mpp.config.engine import replaced
from vit_mpp.config.sections import ModelConfig
from vit_mpp.data.manifest import ManifestError, check_every_sample_labelled
from vit_mpp.data.training_data import Pool, TrainingData
from vit_mpp.data.urls import ReadPolicy
from vit_mpp.models.vit import count_params
from vit_mpp.processes.stop_signals import StopSignals
from vit_mpp.run.loop import At, Finished, Objective, Schedule, describe_lr, fit
from vit_mpp.run.metering.metrics_log import MetricsLog
from vit_mpp.run.metering.step_meter import Evaluation, plain_number
from vit_mpp.run.optimizer import build_optimizer
from vit_mpp.run.start import dry_run
from vit_mpp.run.start.run import Resumed, Run, start_run


def check_data(cfg: FinetuneConfig, data: TrainingData) -> Classes:
    """Fine-tuning's own checks of the sets it reads, before the run directory is touched: the gate's validation
    split apart from the training images, and the classes (returned)."""
    check_validation_apart(cfg.semi.gate, data, ReadPolicy(cfg.data.read_timeout_s, cfg.data.read_retries))
    return classes_of(cfg, data)


def train(cfg: FinetuneConfig) -> None:
    """The stage, top to bottom: the run (its classes checked against every set it reads), the classifier and its
    optimizer, where it resumes, and the loop (vit_mpp/run/loop.py `fit`), which ends with the exports. Preemption
    signals are caught for the whole run."""
    # The checkpoint's architecture (a model.* key set otherwise is refused before any write), so that config.yaml
    # names the model this run trains, not model.name's default.
    cfg = replaced(cfg, model=resolve_architecture(cfg.init, cfg.model))
    with StopSignals.for_run(cfg.train) as signals:
        pool = Pool(cfg.semi.pool_sets(), cfg.semi.pool_split, cfg.semi.ratio)  # semi-supervised: the unlabelled sets
        run = start_run(cfg, signals, partial(check_data, cfg), pool)  # accelerator, checks, data, run directory, logs
        classes: Classes = run.data_check
        # the encoder (pretrained or not) with position embeddings resized to model.img_size and a zero head
        model, mean, std, model_cfg = build_classifier(cfg.init, cfg.model, classes.count,
                                                       freeze=cfg.train.mode in PROBES)
        model.to(run.device)
        ema = build_ema(run.accelerator, model, cfg.train.ema_decay)  # None when off; checkpointed with the state
        schedule = Schedule.of(cfg.optim, cfg.train.batch_size, cfg.total_steps(run.steps_per_epoch))
        model, optimizer = run.prepare(  # data parallel, or sharded (FSDP)
            model, lambda m: build_optimizer(m, cfg.optim, schedule.peak, layer_decay=cfg.optim.layer_decay))
        supervised = ClassificationLoss(cfg, classes.count, run.gbatch.micro_batch, run.device, mean, std)
        loss: ClassificationLoss | PseudoLabelLoss = supervised
        if pool.locations and ema is not None:  # the pool's images learn the labels the EMA gives their weak view
            loss = PseudoLabelLoss(cfg.semi, supervised, ema, run.accelerator, classes.count,
                                   pool_labelled=pool_labelled(run.data))
            if (warning := loss.warning(classes.count)) and run.accelerator.is_main_process:
                print(warning, file=sys.stderr, flush=True)
        if (unused := cfg.semi.unused()) and run.accelerator.is_main_process:
            print(f"warning: {', '.join(unused)} set without semi.pool: this run fine-tunes on the labels alone, and "
                  f"{'they do' if len(unused) > 1 else 'it does'} nothing", file=sys.stderr, flush=True)
        about = summary(run, model, model_cfg, schedule.warmup, loss)
        if run.dry_run:
            return dry_run.report(run, about, schedule)
        resumed = run.resume(schedule.total, schedule.lr)  # the newest checkpoint, also on another layout
        exporter = ClassifierExporter.for_run(run, model_cfg, mean, std, schedule.peak)
        objective = Finetuning(run, loss, ema, exporter, resumed)
        run.print(about)
        fit(run, model, optimizer, objective, schedule, resumed)


class Finetuning(Objective):
    """Fine-tuning's part of the loop: the classifier's loss with the device's augmentations (finetune/loss.py) and
    the loader's RandAugment, the linear probe's training mode, the EMA, the evaluations that keep the best model,
    and the exports at the end."""

    def __init__(self, run: Run, loss: ClassificationLoss | PseudoLabelLoss, ema: Any, exporter: ClassifierExporter,
                 resumed: Resumed) -> None:
        cfg = run.cfg
        self.run, self.loss, self.ema, self.exporter = run, loss, ema, exporter
        labeller = loss.thresholds.label if isinstance(loss, PseudoLabelLoss) else None  # the teacher's rule
        self.keep_best = KeepBest.for_run(run, exporter, resumed.state, labeller)  # evaluates, exports the best so far
        self.eval_every = run.steps_per_epoch * cfg.train.eval_every_epochs if self.keep_best.evaluates else None
        self.total_steps = cfg.total_steps(run.steps_per_epoch)
        if isinstance(loss, PseudoLabelLoss):
            self.pool_augment = pool_augment(cfg.semi, cfg.model.img_size, exporter.mean)  # semi.strong, when set
            loss.gate = PoolGate.resumed(cfg.semi.gate, resumed.state)  # semi.gate, as the checkpoint left it
            self.keep_best.warned = loss.gate.gates  # a gated run says what its gate does instead of the warning
            late = loss.gate.late_warning(self.eval_every, self.total_steps)
            if late and run.accelerator.is_main_process:
                print(late, file=sys.stderr, flush=True)
        self.num_classes = exporter.num_classes
        if cfg.augment.auto_augment:
            self.augment = RandAugmentU8(cfg.augment.auto_augment, cfg.model.img_size, exporter.mean)

    def forward(self, model: torch.nn.Module, batch: dict) -> dict:
        """Device-side augmentation, the classifier and its loss (finetune/loss.py)."""
        return self.loss(model, batch)

    def train_mode(self, model: torch.nn.Module) -> None:
        set_train_mode(self.run.accelerator.unwrap_model(model), self.run.cfg.train.mode)

    def after_update(self, model: torch.nn.Module) -> None:
        if self.ema is not None:
            self.ema.update(self.run.accelerator.unwrap_model(model))

    def log_extra(self, step: int) -> dict[str, Any]:
        pool = self.loss.log_extra() if isinstance(self.loss, PseudoLabelLoss) else {}
        return {"epoch": step / self.run.steps_per_epoch, **pool}

    def evaluate(self, model: torch.nn.Module, at: At) -> Evaluation:
        evaluation = self.keep_best(model, self.ema, at,
                                    label=f"epoch {plain_number(at.step / self.run.steps_per_epoch)}")
        if isinstance(self.loss, PseudoLabelLoss) and (line := self.loss.gate.update(self.keep_best.ema_result,
                                                                                      at.step, self.total_steps)):
            self.run.print(line)
        return evaluation

    def state(self) -> dict[str, Any]:
        gate = self.loss.gate.state() if isinstance(self.loss, PseudoLabelLoss) else {}
        return {"steps_per_epoch": self.run.steps_per_epoch, **self.keep_best.state(), **gate}

    def finish(self, model: torch.nn.Module, at: At) -> Finished:
        """The last model (and its EMA) exported, model cards and the upload, the final line."""
        run, keep_best, ema, exporter = self.run, self.keep_best, self.ema, self.exporter
        result, ema_result = keep_best.result, keep_best.ema_result
        if not result and keep_best.evaluates:  # the run had finished before this process: its last evaluation
            result, ema_result = last_evaluation(run.log)
        exporter.write(model, run.run_dir / "export", at, result)
        if ema is not None:
            exporter.write(ema.module, run.run_dir / "export_ema", at, ema_result, ema=True)
        exports = publish_exports(run.accelerator, run.cfg.train.run_dir, run.cfg.export, run.data.val_location,
                                  with_ema=ema is not None)
        if result:
            run.print(f"final validation top-1: {result['val_top1']:.4f} on {result['val_samples']} images "
                      f"({exporter.num_classes} classes, chance {1 / exporter.num_classes:.4f}); best "
                      f"{keep_best.best.top1:.4f}, exported to {run.run_dir / 'export' / 'best'}")
        else:
            run.print(f"exported the classifier to {run.run_dir / 'export'}")
        return Finished(exports, {**result, **{f"ema_{k}": v for k, v in ema_result.items()}})


def pool_labelled(data: TrainingData) -> bool:
    """Whether every set of the pool says it is labelled (a proxy experiment's pool): its pseudo-labels' accuracy can
    then be measured (never trained on)."""
    for location, manifest, s in zip(data.locations, data.manifests, data.sets):
        if s.labelled:
            continue
        try:
            check_every_sample_labelled(location, manifest, s.split.name)
        except ManifestError:
            return False
    return True


def last_evaluation(log: MetricsLog) -> tuple[dict[str, float], dict[str, float]]:
    """The last evaluation a run's metrics.jsonl holds: (the model's metrics, its EMA's), each {} without one."""
    records = [r for r in log.records() if "val_top1" in r]
    if not records:
        return {}, {}
    last = records[-1]
    result = {k: v for k, v in last.items() if k.startswith("val_") and isinstance(v, (int, float))}
    ema = {k[4:]: v for k, v in last.items() if k.startswith("ema_val_") and isinstance(v, (int, float))}
    return result, ema


def summary(run: Run, model: torch.nn.Module, model_cfg: ModelConfig, warmup: int,
            loss: ClassificationLoss | PseudoLabelLoss) -> str:
    """The start-up summary: model, data and batch, optimizer and schedule, every regulariser and augmentation."""
    cfg, data, num_classes, steps_per_epoch = run.cfg, run.data, run.data_check.count, run.steps_per_epoch
    tc, aug = cfg.train, cfg.augment
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"model {model_cfg.name} at {cfg.model.img_size} ({count_params(model) / 1e6:.2f}M params, "
        f"{trainable / 1e6:.2f}M trained: {tc.mode}), {num_classes} classes, "
        f"init: {cfg.init.checkpoint or 'random (from scratch)'}, drop path {cfg.model.drop_path_rate:g}\n"
        f"{data.describe()}, {steps_per_epoch} steps/epoch x {tc.epochs} epochs "
        f"= {tc.epochs * steps_per_epoch} steps | {run.gbatch.describe()}\n"
        f"augment in the loader: crop scale {list(cfg.data.crop_scale)}, flips {cfg.data.hflip}, RandAugment "
        f"{aug.auto_augment or 'off'} | on the device: {loss.describe()}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}"
        f"{f', layer decay {cfg.optim.layer_decay:g}' if cfg.optim.layer_decay else ''}, warmup {warmup}, cosine"
        f", weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g}"
        f"{f', EMA decay {tc.ema_decay:g} (averages about {1 / (1 - tc.ema_decay):.0f} steps)' if tc.ema_decay else ''}"
        f" | mixed precision {tc.mixed_precision} | run dir {tc.run_dir}"
    )
