"""Masked patch prediction pretraining of a timm ViT.

    accelerate launch pretrain --config configs/pretrain/demo.yaml [key=value ...]
    accelerate launch -m pretrain --config ...        (same, from any directory once installed)
    python -m pretrain --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator

from pretrain.config import DESCRIPTION, PretrainConfig
from pretrain.mpp import MaskedPatchPrediction
from pretrain.validation import Validation
from vit_mpp.config.engine import parse_args, to_dict
from vit_mpp.data.manifest import load_split
from vit_mpp.data.stream import build_eval_loader, build_train_loader, to_device
from vit_mpp.data.training_data import TrainingData
from vit_mpp.models.export import strip_prefix, write_export
from vit_mpp.models.vit import count_params, create_vit, norm_stats, patch_size
from vit_mpp.run import dry_run
from vit_mpp.run.accelerator import prepare_model
from vit_mpp.run.checkpoint import Checkpointer, resume_run
from vit_mpp.run.hub import publish
from vit_mpp.run.optimizer import build_optimizer
from vit_mpp.run.preemption import StepBoundary, StopSignals
from vit_mpp.run.schedule import describe_lr, itstime, lr_at, scaled_lr, set_lr, warmup_steps
from vit_mpp.run.start import start_run
from vit_mpp.run.step_meter import StepMeter, micro_batch_output
from vit_mpp.run.tracking import finish_trackers, start_trackers


def corruption_generator(device: torch.device, seed: int, rank: int, step: int = 0) -> torch.Generator:
    """The generator of this rank's corruption draws: its own stream (saved in every checkpoint), so a resumed run
    draws exactly what the uninterrupted run would have, whatever else consumes the global random state. A run
    resumed on another number of processes derives its ranks' generators from the step it resumes at."""
    tag = f"mpp-{seed}-{rank}" if step == 0 else f"mpp-{seed}-{rank}-{step}"
    return torch.Generator(device=device).manual_seed(int(hashlib.sha256(tag.encode()).hexdigest()[:15], 16))


def main(argv: list[str] | None = None) -> None:
    """`pretrain --config FILE key=value ...`: parse the config, then train."""
    train(parse_args(PretrainConfig, argv, prog="pretrain", description=DESCRIPTION))


def train(cfg: PretrainConfig) -> None:
    """Run the stage for a loaded config; preemption signals are caught for the whole run."""
    with StopSignals(cfg.train.preempt_signals) as signals:
        _train(cfg, signals)


def _train(cfg: PretrainConfig, signals: StopSignals) -> None:
    """The spine of a run, top to bottom."""
    tc = cfg.train
    run = start_run(cfg)  # accelerator, checks, seed, data manifests, run directory, logs
    accelerator, gbatch, data, log, audit = run.accelerator, run.gbatch, run.data, run.log, run.audit

    # Model: timm ViT + the MPP objective (mask token, corruption, head, targets).
    encoder = create_vit(cfg.model)
    mean, std = norm_stats(encoder)
    model = MaskedPatchPrediction(encoder, cfg.mpp, mean, std).to(accelerator.device)
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    warmup = warmup_steps(cfg.optim, tc.steps)
    optimizer = build_optimizer(model, cfg.optim, peak_lr)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc.compile)

    schedule = partial(lr_at, peak_lr=peak_lr, warmup=warmup, total_steps=tc.steps, min_lr_ratio=cfg.optim.min_lr_ratio)
    if run.dry_run:
        return dry_run.report(run, cfg, summary(cfg, encoder, data, gbatch.describe(), warmup), tc.steps, warmup,
                              schedule)

    # Resume from the newest complete checkpoint of this run directory, if any, also on another layout.
    resumed = resume_run(accelerator, tc.run_dir, run.changed, run.layout, data.sizes, data.weights, tc.seed,
                         [log, audit], tc.steps, schedule)
    start_step = resumed.step
    gen = corruption_generator(accelerator.device, tc.seed, accelerator.process_index,
                               resumed.step if resumed.layout_changed else 0)
    if resumed.own is not None and "mpp_generator" in resumed.own and not resumed.layout_changed:
        gen.set_state(resumed.own["mpp_generator"])

    # The loaders split themselves across processes and workers, so they are NOT passed to accelerator.prepare
    # (which would re-split them, or make rank 0 decode for everyone); batches are moved to the device by hand.
    stream, loader = build_train_loader(data.sets, cfg.data, cfg.model.img_size, resumed.generation,
                                        rank=accelerator.process_index, resume_step=start_step, seed=tc.seed)
    validation = _validation(accelerator, cfg, data, gbatch.micro_batch, mean, std)
    accelerator.print(summary(cfg, encoder, data, gbatch.describe(), warmup))
    start_trackers(accelerator, tc, cfg)
    checkpointer = Checkpointer(accelerator, tc.run_dir, tc.ckpt_every, tc.keep_last, tc.steps,
                                StepBoundary(accelerator, signals, tc.ckpt_every_minutes), audit.flush)

    batches = iter(loader)
    meter = StepMeter(accelerator, log, start_step=start_step, total_steps=tc.steps, batch_size=tc.batch_size,
                      log_every=tc.log_every, bad_total=resumed.state.get("bad_samples_total", 0))
    last_eval: dict[str, float] = {}
    model.train()
    signals.in_loop = True
    for step in range(start_step, tc.steps):
        lr = schedule(step)
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
            outputs.append(micro_batch_output(out, batch, data.names))
            audit.add(batch)
        meter.add(outputs)
        done = step + 1
        audit.write(done)
        meter.log(done, lr)
        if validation is not None and itstime(done, tc.eval_every, tc.steps):
            last_eval = validation(model)
            meter.log_eval(done, last_eval, label=f"step {done}", split_size=data.val_split.num_samples)
        checkpointer.after_step(done, lambda: {"config": to_dict(cfg), "stream": resumed.generation.to_dict(),
                                               **meter.checkpoint_state()},
                                lambda: {"mpp_generator": gen.get_state()})

    checkpointer.close()
    meter.draw()
    audit.flush()
    export_encoder(accelerator, model, cfg, mean, std, last_eval, data, peak_lr)
    finish_trackers(accelerator, tc, last_eval)
    accelerator.end_training()


def _validation(accelerator: Accelerator, cfg: PretrainConfig, data: TrainingData, micro_batch: int,
                mean: tuple[float, ...], std: tuple[float, ...]) -> Validation | None:
    """The evaluation of this run (MPP validation and the k-NN monitor), or None without a validation split."""
    if data.val_split is None:
        return None
    _, val_loader = build_eval_loader(data.val_split, cfg.data, cfg.model.img_size, micro_batch,
                                      rank=accelerator.process_index, world_size=accelerator.num_processes)
    # The k-NN monitor's labelled references (pretrain/knn.py) come from the set evaluation reads.
    knn_split = None
    if cfg.knn.train_images:
        knn_split = load_split(data.val_location, cfg.knn.train_split or cfg.data.train_split)[0]
    return Validation(accelerator, val_loader, data.val_split, knn_split, cfg.data, cfg.model.img_size, micro_batch,
                      cfg.knn, mean, std, cfg.train.seed)


def summary(cfg: PretrainConfig, encoder: torch.nn.Module, data: TrainingData, batching: str, warmup: int) -> str:
    """The start-up summary: model, objective, data and batch, optimizer and schedule, augmentations."""
    tc = cfg.train
    steps_per_epoch = max(1, data.samples_per_epoch() // tc.batch_size)
    return (
        f"model {cfg.model.name} ({count_params(encoder) / 1e6:.2f}M params, patch {patch_size(encoder)}, "
        f"{encoder.patch_embed.num_patches + 1} tokens, drop path {cfg.model.drop_path_rate:g}) | target "
        f"{cfg.mpp.target}, corrupt {cfg.mpp.mask_ratio:.0%} ({cfg.mpp.mask_prob:.0%} mask / "
        f"{cfg.mpp.random_prob:.0%} random / rest kept)\n"
        f"{data.describe()}, {steps_per_epoch} steps/epoch | {batching} | augment: crop scale "
        f"{list(cfg.data.crop_scale)}, flips {cfg.data.hflip}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}, warmup {warmup}, cosine to step "
        f"{tc.steps}, weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g} | mixed precision "
        f"{tc.mixed_precision} | run dir {tc.run_dir}"
    )


def export_encoder(accelerator: Accelerator, model: torch.nn.Module, cfg: PretrainConfig, mean: tuple[float, ...],
                   std: tuple[float, ...], metrics: dict[str, float], data: TrainingData, peak_lr: float) -> None:
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
            "metrics": metrics, "data": data.record()})
    accelerator.print(f"exported encoder to {path}")
    url = publish(path, tc.run_dir, cfg.export, data.val_location, push_it=True)
    if url:
        accelerator.print(f"uploaded to {url}")
