"""Fine-tuning a ViT encoder into a classifier (the paper's rule: zero head, resized position embeddings).

    accelerate launch finetune --config configs/finetune/demo.yaml [key=value ...]
    accelerate launch -m finetune --config ...        (same, from any directory once installed)
    python -m finetune --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn.functional as F
from accelerate.utils import set_seed
from timm.loss import SoftTargetCrossEntropy

from finetune.augment import RandAugmentU8, build_mixup, build_random_erasing, color_jitter
from finetune.config import DESCRIPTION, FinetuneConfig
from finetune.ema import build_ema
from finetune.evaluation import evaluate, per_class_accuracy, write_confusion
from finetune.init_model import build_classifier
from finetune.modes import freeze_encoder, set_train_mode
from vit_mpp.checkpoint import save_checkpoint
from vit_mpp.config import ConfigError, parse_args, to_dict
from vit_mpp.data_stream import build_loaders, normalize
from vit_mpp.export import write_export
from vit_mpp.hub import check_hub, publish
from vit_mpp.manifest import data_record, load_split
from vit_mpp.models import count_params
from vit_mpp.run_dir import MetricsLog, prepare_run_dir
from vit_mpp.runtime import build_optimizer, make_accelerator, optimizer_step, prepare_model, resume_latest
from vit_mpp.schedule import describe_lr, lr_at, scaled_lr, set_lr, warmup_steps
from vit_mpp.step_meter import StepMeter
from vit_mpp.tracking import start_trackers


def main(argv: list[str] | None = None) -> None:
    """`finetune --config FILE key=value ...`: parse the config, then train."""
    train(parse_args(FinetuneConfig, argv, prog="finetune", description=DESCRIPTION))


def train(cfg: FinetuneConfig) -> None:
    """Run the stage for a loaded config: the spine below reads top to bottom."""
    tc = cfg.train
    accelerator, plan = make_accelerator(tc)
    if accelerator.is_main_process:
        check_hub(cfg.export)  # a push at the end of a long run must not fail for want of a token
    set_seed(tc.seed, device_specific=True)
    with accelerator.main_process_first():
        changed = prepare_run_dir(tc.run_dir, cfg, accelerator.is_main_process)
    log = MetricsLog(tc.run_dir, accelerator.is_main_process)

    # Data: the manifest gives sizes (so every process runs the same number of steps) and class names.
    train_split, info = load_split(cfg.data.shards, cfg.data.train_split)
    val_split = load_split(cfg.data.shards, cfg.data.val_split)[0] if cfg.data.val_split else None
    num_classes = cfg.num_classes or info.get("num_classes") or len(info.get("class_names", []))
    if not num_classes:
        raise ConfigError("num_classes is not set and the manifest names no classes")
    class_names = info.get("class_names")

    # Model: encoder (pretrained or not) with position embeddings resized to model.img_size and a zero head.
    model, mean, std, model_cfg = build_classifier(cfg.init, cfg.model, num_classes)
    if tc.mode == "linear_probe":
        freeze_encoder(model)  # before the optimizer is built: its parameter groups then hold the head only
    model.to(accelerator.device)
    ema = build_ema(accelerator, model, tc.ema_decay)  # None when off; checkpointed with the training state
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    optimizer = build_optimizer(model, cfg.optim, peak_lr, layer_decay=cfg.optim.layer_decay)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc.compile)
    mixup = build_mixup(cfg.augment, num_classes, tc.label_smoothing, plan.micro_batch)
    erasing = build_random_erasing(cfg.augment, accelerator.device)
    soft_ce = SoftTargetCrossEntropy()

    # Resume from the newest complete checkpoint of this run directory, if any.
    resumed, _ = resume_latest(accelerator, tc.run_dir, changed, log)
    start_step, best_top1 = resumed.get("step", 0), resumed.get("best_top1", -1.0)
    best_ema_top1 = resumed.get("best_ema_top1", -1.0)

    # The loader splits itself across processes and workers, so it is NOT passed to accelerator.prepare
    # (which would re-split it, or make rank 0 decode for everyone); batches are moved to the device by hand.
    stream, loader, val_loader = build_loaders(
        train_split, val_split, cfg.data, cfg.model.img_size, plan.micro_batch, rank=accelerator.process_index,
        world_size=accelerator.num_processes, seed=tc.seed, start_batch=start_step * plan.accum_steps,
        num_classes=num_classes,
        augment=RandAugmentU8(cfg.augment.auto_augment, cfg.model.img_size, mean) if cfg.augment.auto_augment else None)
    steps_per_epoch = max(1, stream.batches_per_epoch // plan.accum_steps)
    total_steps = tc.epochs * steps_per_epoch
    warmup = warmup_steps(cfg.optim, total_steps)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator.print(
        f"model {model_cfg.name} at {cfg.model.img_size} ({count_params(model) / 1e6:.2f}M params, "
        f"{trainable / 1e6:.2f}M trained: {tc.mode}), {num_classes} classes, "
        f"init: {cfg.init.checkpoint or 'random (from scratch)'}\n"
        f"data {train_split.num_samples} train images, {steps_per_epoch} steps/epoch x {tc.epochs} epochs "
        f"= {total_steps} steps | {plan.describe()}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}"
        f"{f', layer decay {cfg.optim.layer_decay:g}' if cfg.optim.layer_decay else ''}, warmup {warmup}, cosine"
        f"{f', EMA decay {tc.ema_decay:g} (averages about {1 / (1 - tc.ema_decay):.0f} steps)' if ema else ''} | "
        f"mixed precision {tc.mixed_precision} | run dir {tc.run_dir}"
    )
    start_trackers(accelerator, tc, cfg)

    def forward(m, batch):
        images, labels = batch["image"], batch["label"]
        if cfg.augment.color_jitter > 0:
            images = color_jitter(images, cfg.augment.color_jitter)  # (B, 3, H, W) float in [0, 255]
        x = normalize(images, mean, std)
        if erasing is not None:  # in place, on the normalised batch (finetune/augment.py says why)
            x = erasing(x)
        if mixup is not None:  # mixes the normalized batch; targets become (B, K) soft labels, smoothed
            x, soft = mixup(x, labels)
            logits = m(x)
            loss = soft_ce(logits.float(), soft)
        else:
            logits = m(x)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=tc.label_smoothing)
        acc = (logits.argmax(1) == labels).float().mean()  # against the unmixed labels: a rough guide with mixup
        return {"loss": loss, "metrics": {"acc": acc.detach()}}

    def export(out_dir: Path, step: int, metrics: dict[str, Any], net: Any = None) -> None:
        """The classifier (or `net`, the EMA) as it is now (all processes call this: FSDP gathers shards; the main
        process writes)."""
        state = accelerator.get_state_dict(net if net is not None else model)
        if accelerator.is_main_process:
            write_export(out_dir, state, model_cfg, kind="classifier", num_classes=num_classes, mean=mean, std=std,
                         crop_pct=cfg.data.eval_crop_pct, class_names=class_names, record={
                             "finetune": {"init": cfg.init.checkpoint, "mode": tc.mode, "step": step,
                                          "epochs": tc.epochs, "batch_size": tc.batch_size,
                                          "optimizer": cfg.optim.name, "lr": peak_lr,
                                          "weights": "ema" if net is not None else "model", "ema_decay": tc.ema_decay},
                             "metrics": metrics, "data": data_record(cfg.data.shards, info)})

    batches = iter(loader)
    meter = StepMeter(accelerator, log, start_step=start_step, total_steps=total_steps, batch_size=tc.batch_size,
                      log_every=tc.log_every, bad_total=resumed.get("bad_samples_total", 0))
    result: dict[str, float] = {}
    ema_result: dict[str, float] = {}
    set_train_mode(accelerator.unwrap_model(model), tc.mode)
    for step in range(start_step, total_steps):
        lr = lr_at(step, peak_lr, warmup, total_steps, cfg.optim.min_lr_ratio)
        set_lr(optimizer, lr)
        meter.add(optimizer_step(accelerator, model, optimizer, batches, forward, plan.accum_steps,
                                 cfg.optim.clip_grad_norm))
        if ema is not None:
            ema.update(accelerator.unwrap_model(model))
        done = step + 1
        meter.log(done, lr, epoch=done / steps_per_epoch)
        epoch_end = done % steps_per_epoch == 0
        if val_loader is not None and (done == total_steps or
                                       (epoch_end and (done // steps_per_epoch) % tc.eval_every_epochs == 0)):
            result, confusion = evaluate(accelerator, model, val_loader, mean, std, num_classes)
            if ema is not None:  # the EMA weights on the same images, logged as ema_val_top1 etc.
                ema_result = evaluate(accelerator, ema.module, val_loader, mean, std, num_classes)[0]
            set_train_mode(accelerator.unwrap_model(model), tc.mode)
            meter.log_eval(done, {**result, **{f"ema_{k}": v for k, v in ema_result.items()}},
                           label=f"epoch {done / steps_per_epoch:.3g}", split_size=val_split.num_samples, details={
                "val_per_class_acc": per_class_accuracy(confusion).tolist(),
                "val_per_class_count": confusion.sum(1).tolist()})
            if accelerator.is_main_process:
                write_confusion(confusion, class_names, tc.run_dir,
                                title=f"step {done}: top-1 {result['val_top1']:.4f} on {result['val_samples']} images")
            if result["val_top1"] > best_top1:  # the best model so far (the same decision on every process)
                export(Path(tc.run_dir) / "export" / "best", done, result)
            best_top1 = max(best_top1, result["val_top1"])
            if ema is not None and ema_result["val_top1"] > best_ema_top1:
                export(Path(tc.run_dir) / "export_ema" / "best", done, ema_result, ema.module)
            best_ema_top1 = max(best_ema_top1, ema_result.get("val_top1", -1.0))
        if done % tc.ckpt_every == 0 or done == total_steps:
            save_checkpoint(accelerator, tc.run_dir, done,
                            {"config": to_dict(cfg), "best_top1": best_top1, "best_ema_top1": best_ema_top1,
                             **meter.checkpoint_state()}, tc.keep_last)

    meter.draw()
    export(Path(tc.run_dir) / "export", total_steps, result)
    if ema is not None:
        export(Path(tc.run_dir) / "export_ema", total_steps, ema_result, ema.module)
    if accelerator.is_main_process:  # a model card for every export; the best model (else the last) goes to the Hub
        run = Path(tc.run_dir)
        upload = run / "export" / "best" if (run / "export" / "best").is_dir() else run / "export"
        for folder in (run / "export", run / "export" / "best", run / "export_ema", run / "export_ema" / "best"):
            if folder.is_dir() and (ema is not None or "export_ema" not in folder.parts):
                url = publish(folder, tc.run_dir, cfg.export, cfg.data.shards, push_it=folder == upload)
                if url:
                    accelerator.print(f"uploaded {folder} to {url}")
    if result:
        accelerator.print(f"final validation top-1: {result['val_top1']:.4f} on {result['val_samples']} images "
                          f"({num_classes} classes, chance {1 / num_classes:.4f}); best {best_top1:.4f}, "
                          f"exported to {Path(tc.run_dir) / 'export' / 'best'}")
    accelerator.end_training()
