"""Masked patch prediction pretraining of a timm ViT.

    accelerate launch pretrain --config configs/pretrain/demo.yaml [key=value ...]
    accelerate launch -m pretrain --config ...        (same, from any directory once installed)
    python -m pretrain --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_seed

from common.checkpoint import export_encoder, save_checkpoint
from common.config import parse_args, to_dict
from common.data_stream import build_loaders, to_device
from common.manifest import load_split
from common.models import count_params, create_encoder, norm_stats, patch_size
from common.run_dir import MetricsLog, Throughput, prepare_run_dir, progress_line
from common.runtime import (
    build_optimizer,
    make_accelerator,
    mean_across_processes,
    optimizer_step,
    prepare_model,
    resume_latest,
    set_lr,
)
from common.schedule import lr_at, scaled_lr, warmup_steps
from pretrain.config import PretrainConfig
from pretrain.mpp import MaskedPatchPrediction


def mpp_forward(model, batch):
    return model(batch["image"])


@torch.no_grad()
def evaluate(accelerator, model, loader, seed: int) -> dict[str, float]:
    """MPP loss (and accuracy) on the validation split, each sample once, with a fixed corruption draw."""
    model.eval()
    gen = torch.Generator(device=accelerator.device).manual_seed(seed + accelerator.process_index)
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, acc sum, weight
    for batch in loader:
        batch = to_device(batch, accelerator.device)
        with accelerator.autocast():
            out = model(batch["image"], valid=batch["valid"], generator=gen)
        w = out["weight"] if batch["valid"].any() else torch.zeros((), device=accelerator.device)
        acc = out["metrics"].get("acc", torch.zeros((), device=accelerator.device))
        totals += torch.stack([out["loss"].float() * w, acc * w, w])
    totals = accelerator.reduce(totals, reduction="sum")
    model.train()
    result = {"val_loss": (totals[0] / totals[2].clamp(min=1)).item()}
    if model.cfg.target != "l2":
        result["val_acc"] = (totals[1] / totals[2].clamp(min=1)).item()
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(PretrainConfig, argv, prog="pretrain", description=__doc__.split("\n\n")[0])
    tc = cfg.train
    accelerator, plan = make_accelerator(tc)
    set_seed(tc.seed, device_specific=True)  # a different corruption draw on every process
    with accelerator.main_process_first():
        changed = prepare_run_dir(tc.run_dir, cfg, accelerator.is_main_process)
    log = MetricsLog(tc.run_dir, accelerator.is_main_process)

    # Data: the manifest gives sizes, so every process knows the step counts without scanning shards.
    train_split, _ = load_split(cfg.data.shards, cfg.data.train_split)
    val_split = load_split(cfg.data.shards, cfg.data.val_split)[0] if cfg.data.val_split else None

    # Model: timm ViT + the MPP objective (mask token, corruption, head, targets).
    encoder = create_encoder(cfg.model)
    mean, std = norm_stats(encoder)
    model = MaskedPatchPrediction(encoder, cfg.mpp, mean, std).to(accelerator.device)
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    warmup = warmup_steps(cfg.optim, tc.steps)
    optimizer = build_optimizer(model, cfg.optim, peak_lr)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc.compile)

    # Resume from the newest complete checkpoint of this run directory, if any.
    start_step = resume_latest(accelerator, tc.run_dir, changed, log).get("step", 0)

    # The loader splits itself across processes and workers, so it is NOT passed to accelerator.prepare
    # (which would re-split it, or make rank 0 decode for everyone); batches are moved to the device by hand.
    stream, loader, val_loader = build_loaders(
        train_split, val_split, cfg.data, cfg.model.img_size, plan.micro_batch, rank=accelerator.process_index,
        world_size=accelerator.num_processes, seed=tc.seed, start_batch=start_step * plan.accum_steps)

    steps_per_epoch = stream.batches_per_epoch // plan.accum_steps
    accelerator.print(
        f"model {cfg.model.name} ({count_params(encoder) / 1e6:.2f}M params, patch {patch_size(encoder)}, "
        f"{encoder.patch_embed.num_patches} patches) | target {cfg.mpp.target}, corrupt {cfg.mpp.mask_ratio:.0%} "
        f"({cfg.mpp.mask_prob:.0%} mask / {cfg.mpp.random_prob:.0%} random / rest kept)\n"
        f"data {train_split.num_samples} train images in {len(train_split.urls)} shards, {steps_per_epoch} steps/epoch "
        f"| {plan.describe()}\n"
        f"optim {cfg.optim.name} lr {peak_lr:.3g} (base {cfg.optim.base_lr:g} @ {cfg.optim.base_batch_size}), warmup "
        f"{warmup}, cosine to step {tc.steps} | mixed precision {tc.mixed_precision} | run dir {tc.run_dir}"
    )
    accelerator.init_trackers("pretrain", config={k: str(v) for k, v in to_dict(cfg).items()})

    batches = iter(loader)
    speed = Throughput(start_step, tc.steps)
    sums: dict[str, float] = {}
    bad = 0
    model.train()
    for step in range(start_step, tc.steps):
        lr = lr_at(step, peak_lr, warmup, tc.steps, cfg.optim.min_lr_ratio)
        set_lr(optimizer, lr)
        for out in optimizer_step(accelerator, model, optimizer, batches, mpp_forward, plan.accum_steps,
                                  cfg.optim.clip_grad_norm):
            bad += out["bad_samples"]
            for k, v in {"loss": out["loss"].detach(), **out["metrics"]}.items():
                sums[k] = sums.get(k, 0.0) + v / plan.accum_steps
        speed.add(tc.batch_size)
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            n = (done - 1) % tc.log_every + 1
            metrics = mean_across_processes(accelerator, {k: v / n for k, v in sums.items()})
            sums = {}
            rate, eta = speed.report(done)
            shown = {"loss": metrics["loss"], **({"acc": metrics["acc"]} if "acc" in metrics else {}), "lr": lr}
            accelerator.print(progress_line(done, tc.steps, shown, rate, eta))
            record = {"step": done, "lr": lr, "img_per_s": rate, "bad_samples": bad, **metrics}
            log.write(record)
            accelerator.log(record, step=done)
        if val_loader is not None and ((tc.eval_every and done % tc.eval_every == 0) or done == tc.steps):
            result = evaluate(accelerator, accelerator.unwrap_model(model), val_loader, tc.seed)
            accelerator.print(f"eval step {done} | " + " | ".join(f"{k} {v:.4g}" for k, v in result.items()))
            log.write({"step": done, **result})
            accelerator.log(result, step=done)
        if done % tc.ckpt_every == 0 or done == tc.steps:
            save_checkpoint(accelerator, tc.run_dir, done, {"config": to_dict(cfg)}, tc.keep_last)

    # The hand-off to fine-tuning: the encoder's weights (timm names) and the config to rebuild it. The state dict
    # is gathered on every process (FSDP shards need all of them); the main process writes it.
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        path = export_encoder(state, to_dict(cfg.model), Path(tc.run_dir) / "export", prefix="encoder.", extra={
            "mean": list(mean), "std": list(std), "pretrain": {"steps": tc.steps, "target": cfg.mpp.target,
                                                                "mask_ratio": cfg.mpp.mask_ratio},
        })
        accelerator.print(f"exported encoder to {path}")
    accelerator.end_training()
