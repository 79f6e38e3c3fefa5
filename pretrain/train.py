"""Masked patch prediction pretraining of a timm ViT.

    accelerate launch pretrain --config configs/pretrain/demo.yaml [key=value ...]
    accelerate launch -m pretrain --config ...        (same, from any directory once installed)
    python -m pretrain --config ...                   (one process)

Reads top to bottom: config -> accelerator -> data -> model -> optimizer -> resume -> step loop -> export.
"""

from __future__ import annotations

import hashlib
from functools import partial

import torch

from pretrain.config import PretrainConfig
from pretrain.mpp import MaskedPatchPrediction
from pretrain.validation import Validation
from vit_mpp.config.engine import to_dict
from vit_mpp.models.export import Export, strip_prefix, write_export
from vit_mpp.models.vit import count_params, create_vit, norm_stats, patch_size
from vit_mpp.run import dry_run
from vit_mpp.run.accelerator import prepare_model
from vit_mpp.run.checkpoint import RunState, saved_step
from vit_mpp.run.hub import publish
from vit_mpp.run.optimizer import build_optimizer
from vit_mpp.run.preemption import StopSignals
from vit_mpp.run.schedule import describe_lr, itstime, lr_at, scaled_lr, set_lr, warmup_steps
from vit_mpp.run.start import Run, start_run
from vit_mpp.run.tracking import finish_trackers, start_trackers
from vit_mpp.run.train_step import optimizer_step


def corruption_generator(device: torch.device, seed: int, rank: int, step: int = 0) -> torch.Generator:
    """The generator of this rank's corruption draws: its own stream (saved in every checkpoint), so a resumed run
    draws exactly what the uninterrupted run would have, whatever else consumes the global random state. A run
    resumed on another number of processes derives its ranks' generators from the step it resumes at."""
    tag = f"mpp-{seed}-{rank}" if step == 0 else f"mpp-{seed}-{rank}-{step}"
    return torch.Generator(device=device).manual_seed(int(hashlib.sha256(tag.encode()).hexdigest()[:15], 16))


def train(cfg: PretrainConfig) -> None:
    """Run the stage for a loaded config; preemption signals are caught for the whole run."""
    with StopSignals(cfg.train.preempt_signals, partial(saved_step, cfg.train.run_dir)) as signals:
        _train(cfg, signals)


def _train(cfg: PretrainConfig, signals: StopSignals) -> None:
    """The spine of a run, top to bottom."""
    tc = cfg.train
    run = start_run(cfg)  # accelerator, checks, seed, data manifests, run directory, logs (vit_mpp/run/start.py)
    accelerator, gbatch, data, audit = run.accelerator, run.gbatch, run.data, run.audit

    # Model: timm ViT + the MPP objective (mask token, corruption, head, targets).
    encoder = create_vit(cfg.model)
    mean, std = norm_stats(encoder)
    model = MaskedPatchPrediction(encoder, cfg.mpp, mean, std).to(accelerator.device)
    peak_lr = scaled_lr(cfg.optim, tc.batch_size)
    warmup = warmup_steps(cfg.optim, tc.steps)
    optimizer = build_optimizer(model, cfg.optim, peak_lr)
    model, optimizer = prepare_model(accelerator, model, optimizer, tc)

    schedule = partial(lr_at, peak_lr=peak_lr, warmup=warmup, total_steps=tc.steps, min_lr_ratio=cfg.optim.min_lr_ratio)
    if run.dry_run:
        return dry_run.report(run, summary(run, encoder, warmup), tc.steps, warmup, schedule)

    # Resume from the newest complete checkpoint of this run directory, if any, also on another layout.
    resumed = run.resume(tc.steps, schedule)
    gen = corruption_generator(accelerator.device, tc.seed, accelerator.process_index,
                               resumed.step if resumed.layout_changed else 0)
    if resumed.own is not None and "mpp_generator" in resumed.own and not resumed.layout_changed:
        gen.set_state(resumed.own["mpp_generator"])

    batches = run.train_loader(resumed)  # this rank's share of every step, from its own stream
    validation = Validation(run, mean, std) if data.val_split is not None else None
    accelerator.print(summary(run, encoder, warmup))
    start_trackers(accelerator, tc, cfg)
    meter = run.meter(resumed, tc.steps)
    checkpointer = run.checkpointer(resumed, tc.steps, signals, RunState(
        trainer=lambda: {"config": to_dict(cfg), "stream": resumed.generation.to_dict(), **meter.checkpoint_state()},
        rank=lambda: {"mpp_generator": gen.get_state()}))
    last_eval: dict[str, float] = {}

    def forward(batch: dict) -> dict:  # corruption, encoder, head and loss (pretrain/mpp.py)
        return model(batch["image"], generator=gen)

    model.train()
    signals.in_loop = True
    for step in range(resumed.step, tc.steps):
        # This rank's micro-batches of the step, once every rank has its own: a stop is agreed here, before any rank
        # commits to the step, and the last step is saved (vit_mpp/run/checkpoint.py).
        micro_batches = checkpointer.next_step(batches, gbatch.accum_steps)
        meter.data_ready()  # the step's batches are in hand: the time before was the wait for them
        lr = schedule(step)
        set_lr(optimizer, lr)
        meter.add(optimizer_step(run, model, optimizer, micro_batches, forward))  # backward, clipping, the update
        done = step + 1
        checkpointer.completed(done)
        audit.write(done)
        meter.log(done, lr)
        if validation is not None and itstime(done, tc.eval_every, tc.steps):
            last_eval = validation(model)  # its batches pass the same stop agreement
            meter.log_eval(done, last_eval, label=f"step {done}", split_size=data.val_split.num_samples)
        checkpointer.save_if_due()

    batches.close()  # now, not at the interpreter's exit
    data.realised = meter.realised_shares(data.names)  # a mixture's realised shares, for the export's record
    meter.draw()
    audit.flush()
    export_encoder(run, model, (mean, std), last_eval, peak_lr)
    finish_trackers(accelerator, tc, last_eval)
    accelerator.end_training()
    meter.report_run([run.run_dir / "export"])  # the summary block and summary.json, the export's time included


def summary(run: Run, encoder: torch.nn.Module, warmup: int) -> str:
    """The start-up summary: model, objective, data and batch, optimizer and schedule, augmentations."""
    cfg, data, tc, mpp = run.cfg, run.data, run.cfg.train, run.cfg.mpp
    steps_per_epoch = max(1, data.samples_per_epoch() // tc.batch_size)
    # The options beyond the paper's recipe are named only when set, so the paper's run reads as before.
    target = f"{mpp.target} (norm_pix)" if mpp.norm_pix else mpp.target
    shape = " in block masks" if mpp.mask_shape == "block" else ""
    decoder = f", decoder {mpp.decoder_depth} x {mpp.decoder_dim or encoder.embed_dim}" if mpp.decoder_depth else ""
    return (
        f"model {cfg.model.name} ({count_params(encoder) / 1e6:.2f}M params, patch {patch_size(encoder)}, "
        f"{encoder.patch_embed.num_patches + 1} tokens, drop path {cfg.model.drop_path_rate:g}) | target "
        f"{target}, corrupt {mpp.mask_ratio:.0%}{shape} ({mpp.mask_prob:.0%} mask / "
        f"{mpp.random_prob:.0%} random / rest kept){decoder}\n"
        f"{data.describe()}, {steps_per_epoch} steps/epoch | {run.gbatch.describe()} | augment: crop scale "
        f"{list(cfg.data.crop_scale)}, flips {cfg.data.hflip}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}, warmup {warmup}, cosine to step "
        f"{tc.steps}, weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g} | mixed precision "
        f"{tc.mixed_precision} | run dir {tc.run_dir}"
    )


def export_encoder(run: Run, model: torch.nn.Module, norm: tuple[tuple[float, ...], tuple[float, ...]],
                   metrics: dict[str, float], peak_lr: float) -> None:
    """The hand-off to fine-tuning: the encoder's weights (timm names), the config to rebuild it, its model card, and
    the upload when asked. The state dict is gathered on every process (FSDP shards need all of them); the main
    process writes it."""
    accelerator, cfg, data, tc = run.accelerator, run.cfg, run.data, run.cfg.train
    (mean, std), state = norm, accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    record = {"pretrain": {"steps": tc.steps, "batch_size": tc.batch_size, "target": cfg.mpp.target,
                           "mask_ratio": cfg.mpp.mask_ratio, "optimizer": cfg.optim.name, "lr": peak_lr},
              "metrics": metrics, "data": data.record()}
    path = write_export(Export(run.run_dir / "export", strip_prefix(state, "encoder."), cfg.model, mean=mean, std=std,
                               crop_pct=cfg.data.eval_crop_pct, record=record), kind="encoder")
    accelerator.print(f"exported encoder to {path}")
    url = publish(path, tc.run_dir, cfg.export, data.val_location, push_it=True)
    if url:
        accelerator.print(f"uploaded to {url}")
