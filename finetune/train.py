"""Fine-tuning a ViT encoder into a classifier (the paper's rule: zero head, resized position embeddings).

    accelerate launch finetune --config configs/finetune/demo.yaml [key=value ...]
    accelerate launch -m finetune --config ...        (same, from any directory once installed)
    python -m finetune --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_seed

from finetune.augment import RandAugmentU8
from finetune.config import DESCRIPTION, FinetuneConfig
from finetune.ema import build_ema
from finetune.exports import ClassifierExporter, publish_exports
from finetune.init_model import build_classifier, check_architecture
from finetune.keep_best import Best, evaluate_and_keep_best
from finetune.modes import freeze_encoder, set_train_mode
from finetune.objective import ClassificationObjective
from vit_mpp.accelerator import make_accelerator, prepare_model
from vit_mpp.checkpoint import resume_latest, save_checkpoint
from vit_mpp.config import ConfigError, ModelConfig, parse_args, to_dict
from vit_mpp.data_stream import build_loaders, to_device
from vit_mpp.hub import check_hub
from vit_mpp.manifest import load_split
from vit_mpp.models import count_params
from vit_mpp.optimizer import build_optimizer
from vit_mpp.run_dir import MetricsLog, prepare_run_dir
from vit_mpp.schedule import describe_lr, itstime, lr_at, scaled_lr, set_lr, warmup_steps
from vit_mpp.step_meter import StepMeter, plain_number
from vit_mpp.tracking import finish_trackers, start_trackers


def main(argv: list[str] | None = None) -> None:
    """`finetune --config FILE key=value ...`: parse the config, then train."""
    train(parse_args(FinetuneConfig, argv, prog="finetune", description=DESCRIPTION))


def train(cfg: FinetuneConfig) -> None:
    """Run the stage for a loaded config: the spine below reads top to bottom."""
    tc = cfg.train
    accelerator, gbatch = make_accelerator(tc)
    if accelerator.is_main_process:
        check_hub(cfg.export)  # a push at the end of a long run must not fail for want of a token
    set_seed(tc.seed, device_specific=True)
    check_architecture(cfg.init, cfg.model)  # a model.* key that the checkpoint fixes: refused before any write
    with accelerator.main_process_first():
        changed = prepare_run_dir(tc.run_dir, cfg, accelerator.is_main_process)
    log = MetricsLog(tc.run_dir, accelerator.is_main_process)

    # Data: the manifest gives sizes (so every process runs the same number of steps) and class names.
    train_split, info = load_split(cfg.data.shards, cfg.data.train_split)
    val_split = load_split(cfg.data.shards, cfg.data.val_split)[0] if cfg.data.val_split else None
    num_classes = cfg.num_classes or info.get("num_classes") or len(info.get("class_names", []))
    if not num_classes:
        raise ConfigError("num_classes is not set and the manifest names no classes")

    # Model: encoder (pretrained or not) with position embeddings resized to model.img_size and a zero head.
    model, mean, std, model_cfg = build_classifier(cfg.init, cfg.model, num_classes)
    if tc.mode == "linear_probe":
        freeze_encoder(model)  # before the optimizer is built: its parameter groups then hold the head only
    model.to(accelerator.device)
    ema = build_ema(accelerator, model, tc.ema_decay)  # None when off; checkpointed with the training state
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    optimizer = build_optimizer(model, cfg.optim, peak_lr, layer_decay=cfg.optim.layer_decay)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc.compile)
    objective = ClassificationObjective(cfg.augment, num_classes, tc.label_smoothing, gbatch.micro_batch,
                                        accelerator.device, mean, std)

    # Resume from the newest complete checkpoint of this run directory, if any.
    resumed, _ = resume_latest(accelerator, tc.run_dir, changed)
    start_step = resumed.get("step", 0)
    log.rewind(start_step)  # records logged after the checkpoint are logged again
    best = Best(resumed.get("best_top1", -1.0), resumed.get("best_ema_top1", -1.0))

    # The loader splits itself across processes and workers, so it is NOT passed to accelerator.prepare
    # (which would re-split it, or make rank 0 decode for everyone); batches are moved to the device by hand.
    stream, loader, val_loader = build_loaders(
        train_split, val_split, cfg.data, cfg.model.img_size, gbatch.micro_batch, rank=accelerator.process_index,
        world_size=accelerator.num_processes, seed=tc.seed, start_batch=start_step * gbatch.accum_steps,
        num_classes=num_classes,
        augment=RandAugmentU8(cfg.augment.auto_augment, cfg.model.img_size, mean) if cfg.augment.auto_augment else None)
    steps_per_epoch = max(1, stream.batches_per_epoch // gbatch.accum_steps)
    total_steps = tc.epochs * steps_per_epoch
    warmup = warmup_steps(cfg.optim, total_steps)
    accelerator.print(summary(cfg, model, model_cfg, num_classes, train_split.num_samples, steps_per_epoch,
                              gbatch.describe(), warmup, objective))
    start_trackers(accelerator, tc, cfg)
    exporter = ClassifierExporter.for_run(accelerator, cfg, model_cfg, num_classes, mean, std, info, peak_lr)

    batches = iter(loader)
    meter = StepMeter(accelerator, log, start_step=start_step, total_steps=total_steps, batch_size=tc.batch_size,
                      log_every=tc.log_every, bad_total=resumed.get("bad_samples_total", 0))
    result: dict[str, float] = {}
    ema_result: dict[str, float] = {}
    set_train_mode(accelerator.unwrap_model(model), tc.mode)
    for step in range(start_step, total_steps):
        lr = lr_at(step, peak_lr, warmup, total_steps, cfg.optim.min_lr_ratio)
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
            outputs.append({**out, "bad_samples": batch["bad"]})
        meter.add(outputs)
        if ema is not None:
            ema.update(accelerator.unwrap_model(model))
        done = step + 1
        meter.log(done, lr, epoch=done / steps_per_epoch)
        if val_loader is not None and itstime(done, steps_per_epoch * tc.eval_every_epochs, total_steps):
            result, ema_result = evaluate_and_keep_best(
                accelerator, model, ema, val_loader, exporter, best, meter, step=done, split_size=val_split.num_samples,
                label=f"epoch {plain_number(done / steps_per_epoch)}", run_dir=tc.run_dir)
            set_train_mode(accelerator.unwrap_model(model), tc.mode)
        if itstime(done, tc.ckpt_every, total_steps):
            save_checkpoint(accelerator, tc.run_dir, done, {"config": to_dict(cfg), "best_top1": best.top1,
                                                            "best_ema_top1": best.ema_top1,
                                                            **meter.checkpoint_state()}, tc.keep_last)

    meter.draw()
    exporter.write(model, Path(tc.run_dir) / "export", total_steps, result)
    if ema is not None:
        exporter.write(ema.module, Path(tc.run_dir) / "export_ema", total_steps, ema_result, ema=True)
    publish_exports(accelerator, tc.run_dir, cfg.export, cfg.data.shards, with_ema=ema is not None)
    if result:
        accelerator.print(f"final validation top-1: {result['val_top1']:.4f} on {result['val_samples']} images "
                          f"({num_classes} classes, chance {1 / num_classes:.4f}); best {best.top1:.4f}, "
                          f"exported to {Path(tc.run_dir) / 'export' / 'best'}")
    finish_trackers(accelerator, tc, {**result, **{f"ema_{k}": v for k, v in ema_result.items()}})
    accelerator.end_training()


def summary(cfg: FinetuneConfig, model: torch.nn.Module, model_cfg: ModelConfig, num_classes: int, images: int,
            steps_per_epoch: int, batching: str, warmup: int, objective: ClassificationObjective) -> str:
    """The start-up summary: model, data and batch, optimizer and schedule, every regulariser and augmentation."""
    tc, aug = cfg.train, cfg.augment
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"model {model_cfg.name} at {cfg.model.img_size} ({count_params(model) / 1e6:.2f}M params, "
        f"{trainable / 1e6:.2f}M trained: {tc.mode}), {num_classes} classes, "
        f"init: {cfg.init.checkpoint or 'random (from scratch)'}, drop path {cfg.model.drop_path_rate:g}\n"
        f"data {images} train images, {steps_per_epoch} steps/epoch x {tc.epochs} epochs "
        f"= {tc.epochs * steps_per_epoch} steps | {batching}\n"
        f"augment in the loader: crop scale {list(cfg.data.crop_scale)}, flips {cfg.data.hflip}, RandAugment "
        f"{aug.auto_augment or 'off'} | on the device: {objective.describe()}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}"
        f"{f', layer decay {cfg.optim.layer_decay:g}' if cfg.optim.layer_decay else ''}, warmup {warmup}, cosine"
        f", weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g}"
        f"{f', EMA decay {tc.ema_decay:g} (averages about {1 / (1 - tc.ema_decay):.0f} steps)' if tc.ema_decay else ''}"
        f" | mixed precision {tc.mixed_precision} | run dir {tc.run_dir}"
    )
