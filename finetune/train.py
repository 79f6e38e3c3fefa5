"""Fine-tuning a ViT encoder into a classifier (the paper's rule: zero head, resized position embeddings).

    accelerate launch finetune --config configs/finetune/demo.yaml [key=value ...]
    accelerate launch -m finetune --config ...        (same, from any directory once installed)
    python -m finetune --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from finetune.augment import RandAugmentU8
from finetune.classifier_export import ClassifierExporter, publish_exports
from finetune.config import DESCRIPTION, FinetuneConfig
from finetune.ema import build_ema
from finetune.init_model import build_classifier, resolve_architecture
from finetune.keep_best import Best, evaluate_and_keep_best
from finetune.modes import set_train_mode
from finetune.objective import ClassificationObjective
from vit_mpp.config.engine import parse_args, replaced, to_dict
from vit_mpp.config.sections import ConfigError, ModelConfig
from vit_mpp.data.manifest import check_every_sample_labelled, manifest_classes
from vit_mpp.data.stream import build_eval_loader, build_train_loader, to_device
from vit_mpp.data.training_data import TrainingData
from vit_mpp.models.vit import count_params
from vit_mpp.run import dry_run
from vit_mpp.run.accelerator import prepare_model
from vit_mpp.run.checkpoint import Checkpointer, resume_run
from vit_mpp.run.optimizer import build_optimizer
from vit_mpp.run.preemption import StepBoundary, StopSignals
from vit_mpp.run.schedule import describe_lr, itstime, lr_at, scaled_lr, set_lr, warmup_steps
from vit_mpp.run.start import start_run
from vit_mpp.run.step_meter import StepMeter, micro_batch_output, plain_number
from vit_mpp.run.tracking import finish_trackers, start_trackers


def main(argv: list[str] | None = None) -> None:
    """`finetune --config FILE key=value ...`: parse the config, then train."""
    train(parse_args(FinetuneConfig, argv, prog="finetune", description=DESCRIPTION))


def train(cfg: FinetuneConfig) -> None:
    """Run the stage for a loaded config; preemption signals are caught for the whole run."""
    with StopSignals(cfg.train.preempt_signals) as signals:
        _train(cfg, signals)


def _train(cfg: FinetuneConfig, signals: StopSignals) -> None:
    """The spine of a run, top to bottom."""
    tc = cfg.train
    # The checkpoint's architecture (a model.* key set otherwise is refused before any write), so that config.yaml
    # names the model this run trains, not model.name's default.
    cfg = replaced(cfg, model=resolve_architecture(cfg.init, cfg.model))
    # accelerator, checks, seed, data manifests (classes and labels checked), run directory, logs
    run = start_run(cfg, partial(classes_of, cfg))
    accelerator, gbatch, data, log, audit = run.accelerator, run.gbatch, run.data, run.log, run.audit
    num_classes, class_names = run.data_check

    # Model: encoder (pretrained or not) with position embeddings resized to model.img_size and a zero head.
    model, mean, std, model_cfg = build_classifier(cfg.init, cfg.model, num_classes, freeze=tc.mode == "linear_probe")
    model.to(accelerator.device)
    ema = build_ema(accelerator, model, tc.ema_decay)  # None when off; checkpointed with the training state
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    optimizer = build_optimizer(model, cfg.optim, peak_lr, layer_decay=cfg.optim.layer_decay)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc.compile)
    objective = ClassificationObjective(cfg.augment, num_classes, tc.label_smoothing, gbatch.micro_batch,
                                        accelerator.device, mean, std)

    steps_per_epoch = max(1, data.samples_per_epoch() // tc.batch_size)
    total_steps = cfg.total_steps(steps_per_epoch)
    warmup = warmup_steps(cfg.optim, total_steps)
    schedule = partial(lr_at, peak_lr=peak_lr, warmup=warmup, total_steps=total_steps,
                       min_lr_ratio=cfg.optim.min_lr_ratio)
    about = summary(cfg, model, model_cfg, num_classes, data, steps_per_epoch, gbatch.describe(), warmup, objective)
    if run.dry_run:
        return dry_run.report(run, cfg, about, total_steps, warmup, schedule)

    # Resume from the newest complete checkpoint of this run directory, if any, also on another layout.
    resumed = resume_run(accelerator, tc.run_dir, run.changed, run.layout, data.sizes, data.weights, tc.seed,
                         [log, audit], total_steps, schedule)
    start_step = resumed.step
    best = Best(resumed.state.get("best_top1", -1.0), resumed.state.get("best_ema_top1", -1.0))

    # The loaders split themselves across processes and workers, so they are NOT passed to accelerator.prepare
    # (which would re-split them, or make rank 0 decode for everyone); batches are moved to the device by hand.
    augment = RandAugmentU8(cfg.augment.auto_augment, cfg.model.img_size, mean) if cfg.augment.auto_augment else None
    _, loader = build_train_loader(data.sets, cfg.data, cfg.model.img_size, resumed.generation, seed=tc.seed,
                                   rank=accelerator.process_index, resume_step=start_step, num_classes=num_classes,
                                   augment=augment)
    val_loader = _val_loader(accelerator, cfg, data, gbatch.micro_batch, num_classes)
    accelerator.print(about)
    start_trackers(accelerator, tc, cfg)
    exporter = ClassifierExporter.for_run(accelerator, cfg, model_cfg, num_classes, mean, std, class_names,
                                          data.record(), peak_lr)
    checkpointer = Checkpointer(accelerator, tc.run_dir, tc.ckpt_every, tc.keep_last, total_steps,
                                StepBoundary(accelerator, signals, tc.ckpt_every_minutes), audit.flush)

    batches = iter(loader)
    meter = StepMeter(accelerator, log, start_step=start_step, total_steps=total_steps, batch_size=tc.batch_size,
                      log_every=tc.log_every, bad_total=resumed.state.get("bad_samples_total", 0))
    result: dict[str, float] = {}  # the last evaluation's, of the model and of its EMA
    ema_result: dict[str, float] = {}
    set_train_mode(accelerator.unwrap_model(model), tc.mode)
    signals.in_loop = True
    for step in range(start_step, total_steps):
        lr = schedule(step)
        set_lr(optimizer, lr)
        outputs = []
        for _ in range(gbatch.accum_steps):  # gradients are synchronised on the last micro-batch only
            batch = to_device(next(batches), accelerator.device)  # this rank's share, from its own stream
            with accelerator.accumulate(model):
                out = objective(model, batch)  # device-side augmentation, classifier and loss
                accelerator.backward(out["loss"])
                if accelerator.sync_gradients and cfg.optim.clip_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            outputs.append(micro_batch_output(out, batch, data.names))
            audit.add(batch)
        meter.add(outputs)
        if ema is not None:
            ema.update(accelerator.unwrap_model(model))
        done = step + 1
        audit.write(done)
        meter.log(done, lr, epoch=done / steps_per_epoch)
        if val_loader is not None and itstime(done, steps_per_epoch * tc.eval_every_epochs, total_steps):
            result, ema_result = evaluate_and_keep_best(
                accelerator, model, ema, val_loader, exporter, best, meter, step=done, run_dir=tc.run_dir,
                label=f"epoch {plain_number(done / steps_per_epoch)}", split_size=data.val_split.num_samples)
            set_train_mode(accelerator.unwrap_model(model), tc.mode)
        checkpointer.after_step(done, lambda: {"config": to_dict(cfg), "stream": resumed.generation.to_dict(),
                                               "steps_per_epoch": steps_per_epoch, "best_top1": best.top1,
                                               "best_ema_top1": best.ema_top1, **meter.checkpoint_state()})

    checkpointer.close()
    meter.draw()
    audit.flush()
    exporter.write(model, Path(tc.run_dir) / "export", total_steps, result)
    if ema is not None:
        exporter.write(ema.module, Path(tc.run_dir) / "export_ema", total_steps, ema_result, ema=True)
    publish_exports(accelerator, tc.run_dir, cfg.export, data.val_location, with_ema=ema is not None)
    if result:
        accelerator.print(f"final validation top-1: {result['val_top1']:.4f} on {result['val_samples']} images "
                          f"({num_classes} classes, chance {1 / num_classes:.4f}); best {best.top1:.4f}, exported "
                          f"to {Path(tc.run_dir) / 'export' / 'best'}")
    finish_trackers(accelerator, tc, {**result, **{f"ema_{k}": v for k, v in ema_result.items()}})
    accelerator.end_training()


def _val_loader(accelerator: Accelerator, cfg: FinetuneConfig, data: TrainingData, micro_batch: int,
                num_classes: int) -> DataLoader | None:
    """The validation loader of this rank, or None without a validation split."""
    if data.val_split is None:
        return None
    return build_eval_loader(data.val_split, cfg.data, cfg.model.img_size, micro_batch, rank=accelerator.process_index,
                             world_size=accelerator.num_processes, num_classes=num_classes)[1]


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


def summary(cfg: FinetuneConfig, model: torch.nn.Module, model_cfg: ModelConfig, num_classes: int,
            data: TrainingData, steps_per_epoch: int, batching: str, warmup: int,
            objective: ClassificationObjective) -> str:
    """The start-up summary: model, data and batch, optimizer and schedule, every regulariser and augmentation."""
    tc, aug = cfg.train, cfg.augment
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"model {model_cfg.name} at {cfg.model.img_size} ({count_params(model) / 1e6:.2f}M params, "
        f"{trainable / 1e6:.2f}M trained: {tc.mode}), {num_classes} classes, "
        f"init: {cfg.init.checkpoint or 'random (from scratch)'}, drop path {cfg.model.drop_path_rate:g}\n"
        f"{data.describe()}, {steps_per_epoch} steps/epoch x {tc.epochs} epochs "
        f"= {tc.epochs * steps_per_epoch} steps | {batching}\n"
        f"augment in the loader: crop scale {list(cfg.data.crop_scale)}, flips {cfg.data.hflip}, RandAugment "
        f"{aug.auto_augment or 'off'} | on the device: {objective.describe()}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}"
        f"{f', layer decay {cfg.optim.layer_decay:g}' if cfg.optim.layer_decay else ''}, warmup {warmup}, cosine"
        f", weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g}"
        f"{f', EMA decay {tc.ema_decay:g} (averages about {1 / (1 - tc.ema_decay):.0f} steps)' if tc.ema_decay else ''}"
        f" | mixed precision {tc.mixed_precision} | run dir {tc.run_dir}"
    )
