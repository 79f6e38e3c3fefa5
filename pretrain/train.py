"""Masked patch prediction pretraining of a timm ViT.

    accelerate launch pretrain --config configs/pretrain/demo.yaml [key=value ...]
    accelerate launch -m pretrain --config ...        (same, from any directory once installed)
    python -m pretrain --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from pretrain.config import DESCRIPTION, PretrainConfig
from pretrain.mpp import MaskedPatchPrediction
from pretrain.validation import Validation
from vit_mpp.accelerator import make_accelerator, prepare_model
from vit_mpp.checkpoint import resume_latest, save_checkpoint
from vit_mpp.config import parse_args, to_dict
from vit_mpp.data_stream import build_loaders, to_device
from vit_mpp.export import strip_prefix, write_export
from vit_mpp.hub import check_hub, publish
from vit_mpp.manifest import Split, data_record, load_split
from vit_mpp.models import count_params, create_vit, norm_stats, patch_size
from vit_mpp.optimizer import build_optimizer
from vit_mpp.run_dir import MetricsLog, prepare_run_dir
from vit_mpp.schedule import describe_lr, itstime, lr_at, scaled_lr, set_lr, warmup_steps
from vit_mpp.step_meter import StepMeter
from vit_mpp.tracking import finish_trackers, start_trackers


def corruption_generator(device: torch.device, seed: int, rank: int) -> torch.Generator:
    """The generator of this rank's corruption draws: its own stream (saved in every checkpoint), so a resumed run
    draws exactly what the uninterrupted run would have, whatever else consumes the global random state."""
    return torch.Generator(device=device).manual_seed(int(hashlib.sha256(f"mpp-{seed}-{rank}".encode())
                                                          .hexdigest()[:15], 16))


def main(argv: list[str] | None = None) -> None:
    """`pretrain --config FILE key=value ...`: parse the config, then train."""
    train(parse_args(PretrainConfig, argv, prog="pretrain", description=DESCRIPTION))


def train(cfg: PretrainConfig) -> None:
    """Run the stage for a loaded config: the spine below reads top to bottom."""
    tc = cfg.train
    accelerator, gbatch = make_accelerator(tc)
    if accelerator.is_main_process:
        check_hub(cfg.export)  # a push at the end of a long run must not fail for want of a token
    set_seed(tc.seed, device_specific=True)  # a different corruption draw on every process
    with accelerator.main_process_first():
        changed = prepare_run_dir(tc.run_dir, cfg, accelerator.is_main_process)
    log = MetricsLog(tc.run_dir, accelerator.is_main_process)

    # Data: the manifest gives sizes, so every process knows the step counts without scanning shards.
    train_split, info = load_split(cfg.data.shards, cfg.data.train_split)
    val_split = load_split(cfg.data.shards, cfg.data.val_split)[0] if cfg.data.val_split else None
    # The k-NN monitor's labelled references (pretrain/knn.py); it runs only beside a validation split.
    knn_split = None
    if cfg.knn.train_images and val_split is not None:
        knn_split = load_split(cfg.data.shards, cfg.knn.train_split or cfg.data.train_split)[0]

    # Model: timm ViT + the MPP objective (mask token, corruption, head, targets).
    encoder = create_vit(cfg.model)
    mean, std = norm_stats(encoder)
    model = MaskedPatchPrediction(encoder, cfg.mpp, mean, std).to(accelerator.device)
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    warmup = warmup_steps(cfg.optim, tc.steps)
    optimizer = build_optimizer(model, cfg.optim, peak_lr)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc.compile)

    # Resume from the newest complete checkpoint of this run directory, if any.
    resumed, own = resume_latest(accelerator, tc.run_dir, changed)
    start_step = resumed.get("step", 0)
    log.rewind(start_step)  # records logged after the checkpoint are logged again
    gen = corruption_generator(accelerator.device, tc.seed, accelerator.process_index)
    if own is not None and "mpp_generator" in own:
        gen.set_state(own["mpp_generator"])

    # The loader splits itself across processes and workers, so it is NOT passed to accelerator.prepare
    # (which would re-split it, or make rank 0 decode for everyone); batches are moved to the device by hand.
    stream, loader, val_loader = build_loaders(
        train_split, val_split, cfg.data, cfg.model.img_size, gbatch.micro_batch, rank=accelerator.process_index,
        world_size=accelerator.num_processes, seed=tc.seed, start_batch=start_step * gbatch.accum_steps)

    validation = Validation(accelerator, val_loader, val_split, knn_split, cfg.data, cfg.model.img_size,
                            gbatch.micro_batch, cfg.knn, mean, std, tc.seed) if val_loader is not None else None
    accelerator.print(summary(cfg, encoder, train_split, stream.batches_per_epoch // gbatch.accum_steps,
                              gbatch.describe(), warmup))
    start_trackers(accelerator, tc, cfg)

    batches = iter(loader)
    meter = StepMeter(accelerator, log, start_step=start_step, total_steps=tc.steps, batch_size=tc.batch_size,
                      log_every=tc.log_every, bad_total=resumed.get("bad_samples_total", 0))
    last_eval: dict[str, float] = {}
    model.train()
    for step in range(start_step, tc.steps):
        lr = lr_at(step, peak_lr, warmup, tc.steps, cfg.optim.min_lr_ratio)
        set_lr(optimizer, lr)
        outputs = []
        for _ in range(gbatch.accum_steps):  # gradients are synchronised on the last micro-batch only
            batch = to_device(next(batches), accelerator.device)  # this rank's share, from its own stream
            with accelerator.accumulate(model):
                out = model(batch["image"], generator=gen)  # corruption, encoder, head and loss (pretrain/mpp.py)
                accelerator.backward(out["loss"])
                if accelerator.sync_gradients and cfg.optim.clip_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            outputs.append({**out, "bad_samples": batch["bad"]})
        meter.add(outputs)
        done = step + 1
        meter.log(done, lr)
        if validation is not None and itstime(done, tc.eval_every, tc.steps):
            last_eval = validation(model)
            meter.log_eval(done, last_eval, label=f"step {done}", split_size=val_split.num_samples)
        if itstime(done, tc.ckpt_every, tc.steps):
            save_checkpoint(accelerator, tc.run_dir, done, {"config": to_dict(cfg), **meter.checkpoint_state()},
                            tc.keep_last, rank_state={"mpp_generator": gen.get_state()})

    meter.draw()
    export_encoder(accelerator, model, cfg, mean, std, last_eval, info, peak_lr)
    finish_trackers(accelerator, tc, last_eval)
    accelerator.end_training()


def summary(cfg: PretrainConfig, encoder: torch.nn.Module, split: Split, steps_per_epoch: int, batching: str,
            warmup: int) -> str:
    """The start-up summary: model, objective, data and batch, optimizer and schedule, augmentations."""
    tc = cfg.train
    return (
        f"model {cfg.model.name} ({count_params(encoder) / 1e6:.2f}M params, patch {patch_size(encoder)}, "
        f"{encoder.patch_embed.num_patches} patches, drop path {cfg.model.drop_path_rate:g}) | target "
        f"{cfg.mpp.target}, corrupt {cfg.mpp.mask_ratio:.0%} ({cfg.mpp.mask_prob:.0%} mask / "
        f"{cfg.mpp.random_prob:.0%} random / rest kept)\n"
        f"data {split.num_samples} train images in {len(split.urls)} shards, {steps_per_epoch} steps/epoch | "
        f"{batching} | augment: crop scale {list(cfg.data.crop_scale)}, flips {cfg.data.hflip}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}, warmup {warmup}, cosine to step "
        f"{tc.steps}, weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g} | mixed precision "
        f"{tc.mixed_precision} | run dir {tc.run_dir}"
    )


def export_encoder(accelerator: Accelerator, model: torch.nn.Module, cfg: PretrainConfig, mean: tuple[float, ...],
                   std: tuple[float, ...], metrics: dict[str, float], info: dict, peak_lr: float) -> None:
    """The hand-off to fine-tuning: the encoder's weights (timm names), the config to rebuild it, its model card, and
    the upload when asked. The state dict is gathered on every process (FSDP shards need all of them); the main
    process writes it."""
    tc = cfg.train
    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    path = write_export(
        Path(tc.run_dir) / "export", strip_prefix(state, "encoder."), cfg.model, kind="encoder", mean=mean,
        std=std, crop_pct=cfg.data.eval_crop_pct, record={
            "pretrain": {"steps": tc.steps, "batch_size": tc.batch_size, "target": cfg.mpp.target,
                         "mask_ratio": cfg.mpp.mask_ratio, "optimizer": cfg.optim.name, "lr": peak_lr},
            "metrics": metrics, "data": data_record(cfg.data.shards, info)})
    accelerator.print(f"exported encoder to {path}")
    url = publish(path, tc.run_dir, cfg.export, cfg.data.shards, push_it=True)
    if url:
        accelerator.print(f"uploaded to {url}")
