"""Masked patch prediction pretraining of a timm ViT: the stage's spine (`train`) and its part of the one loop
(`Pretraining`: the forward pass, the validation, the export).

    accelerate launch pretrain --config configs/pretrain/demo.yaml [key=value ...]
    accelerate launch -m pretrain --config ...        (same, from any directory once installed)
    python -m pretrain --config ...                   (one process)

Reads top to bottom: run -> model -> optimizer -> resume -> the loop (vit_mpp/run/loop.py) -> export.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pretrain.config import PretrainConfig
from pretrain.mpp import MaskedPatchPrediction
from pretrain.validation import Validation
from vit_mpp.models.export import Export, strip_prefix, write_export
from vit_mpp.models.hub import publish
from vit_mpp.models.vit import count_params, create_vit, norm_stats, patch_size
from vit_mpp.processes.stop_signals import StopSignals
from vit_mpp.run.loop import At, Finished, Objective, Schedule, describe_lr, fit
from vit_mpp.run.metering.curves import CURVES_NAME
from vit_mpp.run.metering.step_meter import Evaluation
from vit_mpp.run.optimizer import build_optimizer
from vit_mpp.run.start import dry_run
from vit_mpp.run.start.run import Resumed, Run, start_run
from vit_mpp.run.start.sharding import whole_state_dict

Norm = tuple[tuple[float, ...], tuple[float, ...]]  # the encoder's normalisation: mean and std


def corruption_generator(device: torch.device, seed: int, rank: int, step: int = 0) -> torch.Generator:
    """The generator of this rank's corruption draws: its own stream (saved in every checkpoint), so a resumed run
    draws exactly what the uninterrupted run would have, whatever else consumes the global random state. A run
    resumed on another number of processes derives its ranks' generators from the step it resumes at."""
    tag = f"mpp-{seed}-{rank}" if step == 0 else f"mpp-{seed}-{rank}-{step}"
    return torch.Generator(device=device).manual_seed(int(hashlib.sha256(tag.encode()).hexdigest()[:15], 16))


def train(cfg: PretrainConfig) -> None:
    """The stage, top to bottom: the run, the model and its optimizer, where it resumes, and the loop
    (vit_mpp/run/loop.py `fit`), which ends with the export. Preemption signals are caught for the whole run."""
    with StopSignals.for_run(cfg.train) as signals:
        run = start_run(cfg, signals)  # accelerator, checks, seed, data manifests, run directory, logs
        encoder = create_vit(cfg.model)  # timm's ViT, and the MPP objective around it (pretrain/mpp.py)
        norm = norm_stats(encoder)
        model = MaskedPatchPrediction(encoder, cfg.mpp, *norm).to(run.device)
        schedule = Schedule.of(cfg.optim, cfg.train.batch_size, cfg.train.steps)
        model, optimizer = run.prepare(model, lambda m: build_optimizer(m, cfg.optim, schedule.peak))  # or sharded
        about = summary(run, encoder, schedule.warmup)
        if run.dry_run:
            return dry_run.report(run, about, schedule)
        resumed = run.resume(schedule.total, schedule.lr)  # the newest checkpoint, also on another layout
        objective = Pretraining(run, resumed, norm, schedule.peak)
        run.print(about)
        fit(run, model, optimizer, objective, schedule, resumed)


class Pretraining(Objective):
    """Pretraining's part of the loop: each rank's corruption draws, the MPP forward pass, the validation with its
    k-NN monitor, and the encoder's export at the end."""

    def __init__(self, run: Run, resumed: Resumed, norm: Norm, peak_lr: float) -> None:
        tc = run.cfg.train
        self.run, self.norm, self.peak_lr = run, norm, peak_lr
        self.gen = corruption_generator(run.device, tc.seed, run.rank, resumed.step if resumed.layout_changed else 0)
        if resumed.own is not None and "mpp_generator" in resumed.own and not resumed.layout_changed:
            self.gen.set_state(resumed.own["mpp_generator"])
        self.validation = Validation(run, *norm) if run.data.val_split is not None else None
        self.eval_every = tc.eval_every if self.validation is not None else None
        self.last: dict[str, float] = {}  # the last evaluation's metrics

    def forward(self, model: torch.nn.Module, batch: dict) -> dict:
        """Corruption, encoder, head and loss (pretrain/mpp.py), with this rank's corruption draws."""
        return model(batch["image"], generator=self.gen)

    def evaluate(self, model: torch.nn.Module, at: At) -> Evaluation:
        self.last = self.validation(model, at.gated)
        return Evaluation(self.last, f"step {at.step}", self.run.data.val_split.num_samples)

    def rank_state(self) -> dict:
        return {"mpp_generator": self.gen.get_state()}

    def finish(self, model: torch.nn.Module, at: At) -> Finished:
        knn = self.validation.knn_references if self.validation is not None else None
        record = {"metrics": self.last, "data": self.run.data.record(at.shares, knn)}
        return Finished([export_encoder(self.run, model, self.norm, record, self.peak_lr)], self.last)


def summary(run: Run, encoder: torch.nn.Module, warmup: int) -> str:
    """The start-up summary: model, objective, data and batch, optimizer and schedule, augmentations."""
    cfg, data, tc, mpp = run.cfg, run.data, run.cfg.train, run.cfg.mpp
    # The options beyond the paper's recipe are named only when set, so the paper's run reads as before.
    target = f"{mpp.target} (norm_pix)" if mpp.norm_pix else mpp.target
    shape = " in block masks" if mpp.mask_shape == "block" else ""
    decoder = f", decoder {mpp.decoder_depth} x {mpp.decoder_dim or encoder.embed_dim}" if mpp.decoder_depth else ""
    return (
        f"model {cfg.model.name} ({count_params(encoder) / 1e6:.2f}M params, patch {patch_size(encoder)}, "
        f"{encoder.patch_embed.num_patches + 1} tokens, drop path {cfg.model.drop_path_rate:g}) | target "
        f"{target}, corrupt {mpp.mask_ratio:.0%}{shape} ({mpp.mask_prob:.0%} mask / "
        f"{mpp.random_prob:.0%} random / rest kept){decoder}\n"
        f"{data.describe()}, {run.steps_per_epoch} steps/epoch | {run.gbatch.describe()} | augment: crop scale "
        f"{list(cfg.data.crop_scale)}, flips {cfg.data.hflip}\n"
        f"optim {cfg.optim.name} {describe_lr(cfg.optim, tc.batch_size)}, warmup {warmup}, cosine to step "
        f"{tc.steps}, weight decay {cfg.optim.weight_decay:g}, clip {cfg.optim.clip_grad_norm:g} | mixed precision "
        f"{tc.mixed_precision} | run dir {tc.run_dir}"
    )


def export_encoder(run: Run, model: torch.nn.Module, norm: Norm, record: dict, peak_lr: float) -> Path:
    """The hand-off to fine-tuning: the encoder's weights (timm names), the config to rebuild it, its model card, and
    the upload when asked; `record`: the run's last metrics and its data. The state dict is gathered on every process
    (a sharded model needs all of them); the main process writes it. Returns the export folder."""
    accelerator, cfg, tc = run.accelerator, run.cfg, run.cfg.train
    (mean, std), state = norm, whole_state_dict(accelerator, model)
    out = run.run_dir / "export"
    if not accelerator.is_main_process:
        return out
    record = {"pretrain": {"steps": tc.steps, "batch_size": tc.batch_size, "target": cfg.mpp.target,
                           "mask_ratio": cfg.mpp.mask_ratio, "optimizer": cfg.optim.name, "lr": peak_lr},
              "metrics": record["metrics"], "data": record["data"]}
    path = write_export(Export(out, strip_prefix(state, "encoder."), cfg.model, mean=mean, std=std,
                               crop_pct=cfg.data.eval_crop_pct, record=record), kind="encoder")
    accelerator.print(f"exported encoder to {path}")
    url = publish(path, run.run_dir / CURVES_NAME, cfg.export, run.data.val_location, push_it=True)
    if url:
        accelerator.print(f"uploaded to {url}")
    return out
