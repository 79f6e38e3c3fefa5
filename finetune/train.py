"""Fine-tuning a ViT encoder into a classifier (the paper's rule: zero head, resized position embeddings).

    accelerate launch finetune --config configs/finetune/demo.yaml [key=value ...]
    accelerate launch -m finetune --config ...        (same, from any directory once installed)
    python -m finetune --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from finetune.augment import RandAugmentU8
from finetune.classifier_export import ClassifierExporter, publish_exports
from finetune.config import FinetuneConfig
from finetune.ema import build_ema
from finetune.init_model import build_classifier, resolve_architecture
from finetune.keep_best import KeepBest
from finetune.modes import set_train_mode
from finetune.objective import ClassificationObjective
from vit_mpp.config.engine import ConfigError, replaced, to_dict
from vit_mpp.config.sections import ModelConfig
from vit_mpp.data.manifest import check_every_sample_labelled, manifest_classes
from vit_mpp.data.training_data import TrainingData
from vit_mpp.models.vit import count_params
from vit_mpp.run import dry_run
from vit_mpp.run.accelerator import prepare_model
from vit_mpp.run.checkpoint import RunState, saved_step
from vit_mpp.run.curves import read_metrics
from vit_mpp.run.optimizer import build_optimizer
from vit_mpp.run.preemption import StopSignals
from vit_mpp.run.schedule import describe_lr, itstime, lr_at, scaled_lr, set_lr, warmup_steps
from vit_mpp.run.start import Run, start_run
from vit_mpp.run.step_meter import plain_number
from vit_mpp.run.tracking import finish_trackers, start_trackers
from vit_mpp.run.train_step import optimizer_step


def train(cfg: FinetuneConfig) -> None:
    """Run the stage for a loaded config; preemption signals are caught for the whole run."""
    with StopSignals(cfg.train.preempt_signals, partial(saved_step, cfg.train.run_dir)) as signals:
        _train(cfg, signals)


def _train(cfg: FinetuneConfig, signals: StopSignals) -> None:
    """The spine of a run, top to bottom."""
    tc = cfg.train
    # The checkpoint's architecture (a model.* key set otherwise is refused before any write), so that config.yaml
    # names the model this run trains, not model.name's default.
    cfg = replaced(cfg, model=resolve_architecture(cfg.init, cfg.model))
    # accelerator, checks, seed, data manifests (classes and labels checked), run directory, logs
    run = start_run(cfg, partial(classes_of, cfg))
    accelerator, gbatch, data, audit = run.accelerator, run.gbatch, run.data, run.audit
    num_classes, _ = run.data_check

    # Model: encoder (pretrained or not) with position embeddings resized to model.img_size and a zero head.
    model, mean, std, model_cfg = build_classifier(cfg.init, cfg.model, num_classes, freeze=tc.mode == "linear_probe")
    model.to(accelerator.device)
    ema = build_ema(accelerator, model, tc.ema_decay)  # None when off; checkpointed with the training state
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    optimizer = build_optimizer(model, cfg.optim, peak_lr, layer_decay=cfg.optim.layer_decay)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc)
    objective = ClassificationObjective(cfg, num_classes, gbatch.micro_batch, accelerator.device, mean, std)

    steps_per_epoch = max(1, data.samples_per_epoch() // tc.batch_size)
    total_steps = cfg.total_steps(steps_per_epoch)
    warmup = warmup_steps(cfg.optim, total_steps)
    schedule = partial(lr_at, peak_lr=peak_lr, warmup=warmup, total_steps=total_steps,
                       min_lr_ratio=cfg.optim.min_lr_ratio)
    about = summary(run, model, model_cfg, steps_per_epoch, warmup, objective)
    if run.dry_run:
        return dry_run.report(run, about, total_steps, warmup, schedule)

    # Resume from the newest complete checkpoint of this run directory, if any, also on another layout.
    resumed = run.resume(total_steps, schedule)
    augment = RandAugmentU8(cfg.augment.auto_augment, cfg.model.img_size, mean) if cfg.augment.auto_augment else None
    batches = run.train_loader(resumed, num_classes, augment)  # this rank's share, from its own stream
    accelerator.print(about)
    start_trackers(accelerator, tc, cfg)
    exporter = ClassifierExporter.for_run(run, model_cfg, mean, std, peak_lr)
    meter = run.meter(resumed, total_steps)
    keep_best = KeepBest.for_run(run, exporter, meter, resumed.state)  # evaluates, exports the best so far
    checkpointer = run.checkpointer(resumed, total_steps, signals, RunState(trainer=lambda: {
        "config": to_dict(cfg), "stream": resumed.generation.to_dict(), "steps_per_epoch": steps_per_epoch,
        **keep_best.state(), **meter.checkpoint_state()}))
    set_train_mode(accelerator.unwrap_model(model), tc.mode)
    signals.in_loop = True
    for step in range(resumed.step, total_steps):
        micro_batches = checkpointer.next_step(batches, gbatch.accum_steps)  # a stop is agreed here (as pretraining)
        meter.data_ready()  # the step's batches are in hand: the time before was the wait for them
        lr = schedule(step)
        set_lr(optimizer, lr)
        # device-side augmentation, classifier and loss (finetune/objective.py), backward, clipping, the update
        meter.add(optimizer_step(run, model, optimizer, micro_batches, partial(objective, model)))
        if ema is not None:
            ema.update(accelerator.unwrap_model(model))
        done = step + 1
        checkpointer.completed(done)
        audit.write(done)
        meter.log(done, lr, epoch=done / steps_per_epoch)
        if keep_best.evaluates and itstime(done, steps_per_epoch * tc.eval_every_epochs, total_steps):
            keep_best(model, ema, done, label=f"epoch {plain_number(done / steps_per_epoch)}")
            set_train_mode(accelerator.unwrap_model(model), tc.mode)
        checkpointer.save_if_due()

    batches.close()  # now, not at the interpreter's exit
    meter.draw()
    audit.flush()
    finish(run, keep_best, model, ema, total_steps)


def finish(run: Run, keep_best: KeepBest, model: torch.nn.Module, ema: Any, total_steps: int) -> None:
    """The end of a run: the last model (and its EMA) exported, model cards and the upload, the final line."""
    accelerator, tc, num_classes = run.accelerator, run.cfg.train, run.data_check[0]
    exporter, result, ema_result = keep_best.exporter, keep_best.result, keep_best.ema_result
    if not result and keep_best.evaluates:  # the run had finished before this process: its last evaluation
        result, ema_result = last_evaluation(run.run_dir)
    run.data.realised = keep_best.meter.realised_shares(run.data.names)  # a mixture's, for the exports' records
    exporter.write(model, run.run_dir / "export", total_steps, result)
    if ema is not None:
        exporter.write(ema.module, run.run_dir / "export_ema", total_steps, ema_result, ema=True)
    publish_exports(accelerator, tc.run_dir, run.cfg.export, run.data.val_location, with_ema=ema is not None)
    if result:
        accelerator.print(f"final validation top-1: {result['val_top1']:.4f} on {result['val_samples']} images "
                          f"({num_classes} classes, chance {1 / num_classes:.4f}); best {keep_best.best.top1:.4f}, "
                          f"exported to {run.run_dir / 'export' / 'best'}")
    else:
        accelerator.print(f"exported the classifier to {run.run_dir / 'export'}")
    finish_trackers(accelerator, tc, {**result, **{f"ema_{k}": v for k, v in ema_result.items()}})
    accelerator.end_training()
    exports = [run.run_dir / "export", run.run_dir / "export" / "best"]
    keep_best.meter.report_run(exports + ([run.run_dir / "export_ema"] if ema is not None else []))  # summary.json


def last_evaluation(run_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The last evaluation a run's metrics.jsonl holds: (the model's metrics, its EMA's), each {} without one."""
    records = [r for r in read_metrics(run_dir) if "val_top1" in r]
    if not records:
        return {}, {}
    last = records[-1]
    result = {k: v for k, v in last.items() if k.startswith("val_") and isinstance(v, (int, float))}
    ema = {k[4:]: v for k, v in last.items() if k.startswith("ema_val_") and isinstance(v, (int, float))}
    return result, ema


def classes_of(cfg: FinetuneConfig, data: TrainingData) -> tuple[int, list[str] | None]:
    """(number of classes, class names): `num_classes`, or the most the training sets' manifests count; every set of
    a mixture must name the same classes (labels are class indices), and no set read (training, evaluation) may have
    more classes, be unlabelled or count samples without a usable label. Run by `start_run` before the run
    directory is touched."""
    names = [m.get("class_names") or None for m in data.manifests]
    if any(n != names[0] for n in names[1:]):
        raise ConfigError("the sets of data.shards name different classes: a classifier's labels must mean the same "
                          "class in every set")
    # the training sets' classes: with indexed sets (no class names) a mixture's sets may count different numbers
    num_classes = cfg.num_classes or max(manifest_classes(m) for m in data.manifests)
    if not num_classes:
        raise ConfigError("num_classes is not set and the manifest names no classes: the shards carry no labels, "
                          "which pretraining accepts but a classifier cannot learn from")
    checked = [(location, manifest, cfg.data.train_split) for location, manifest in zip(data.locations, data.manifests)]
    if data.val_manifest is not None:
        checked.append((data.val_location, data.val_manifest, cfg.data.val_split))
    for location, manifest, split in checked:
        check_every_sample_labelled(location, manifest, split)
        has = manifest_classes(manifest)
        if has > num_classes:  # the stream would stop at the first label beyond them
            given = "" if cfg.num_classes else " (from the training sets' manifests)"
            raise ConfigError(f"num_classes={num_classes}{given} is below the {has} classes of {location} (labels "
                              f"up to {has - 1}): a classifier needs a class for every label")
    return num_classes, names[0]


def summary(run: Run, model: torch.nn.Module, model_cfg: ModelConfig, steps_per_epoch: int, warmup: int,
            objective: ClassificationObjective) -> str:
    """The start-up summary: model, data and batch, optimizer and schedule, every regulariser and augmentation."""
    cfg, data, num_classes = run.cfg, run.data, run.data_check[0]
    tc, aug = cfg.train, cfg.augment
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"model {model_cfg.name} at {cfg.model.img_size} ({count_params(model) / 1e6:.2f}M params, "
        f"{trainable / 1e6:.2f}M trained: {tc.mode}), {num_classes} classes, "
        f"init: {cfg.init.checkpoint or 'random (from scratch)'}, drop path {cfg.model.drop_path_rate:g}\n"
        f"{data.describe()}, {steps_per_epoch} steps/epoch x {tc.epochs} epochs "
        f"= {tc.epochs * steps_per_epoch} steps | {run.gbatch.describe()}\n"
        f"augment in the loader: crop scale {list(cfg.data.crop_scale)}, flips {cfg.data.hflip}, RandAugment "
        f"{aug.auto_augment or 'off'} | on the device: {objective.describe()}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}"
        f"{f', layer decay {cfg.optim.layer_decay:g}' if cfg.optim.layer_decay else ''}, warmup {warmup}, cosine"
        f", weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g}"
        f"{f', EMA decay {tc.ema_decay:g} (averages about {1 / (1 - tc.ema_decay):.0f} steps)' if tc.ema_decay else ''}"
        f" | mixed precision {tc.mixed_precision} | run dir {tc.run_dir}"
    )
