"""The learning rate as a pure function of the optimizer step (linear warmup, then cosine decay), and when a periodic
action is due (`itstime`)."""

from __future__ import annotations

import math

import torch

from vit_mpp.config.sections import OptimConfig


def scaled_lr(optim: OptimConfig, batch_size: int) -> float:
    """Peak learning rate: `optim.lr` when set, else `optim.base_lr` scaled linearly from `optim.base_batch_size` to
    the global batch size."""
    if optim.lr is not None:
        return optim.lr
    return optim.base_lr * batch_size / optim.base_batch_size


def describe_lr(optim: OptimConfig, batch_size: int) -> str:
    """`lr 0.001 (base 0.0002 @ 4096)` or `lr 0.001 (optim.lr)`, for the start-up summary."""
    origin = "optim.lr" if optim.lr is not None else f"base {optim.base_lr:g} @ {optim.base_batch_size}"
    return f"lr {scaled_lr(optim, batch_size):.3g} ({origin})"


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """Warmup length: `optim.warmup_steps`, capped at `warmup_max_fraction` of the run."""
    return min(optim.warmup_steps, int(optim.warmup_max_fraction * total_steps))


def lr_at(step: int, peak_lr: float, warmup: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = peak_lr * min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every group, honouring per-group scales (layer-wise decay)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def itstime(step: int, every: int, total: int, last: bool = True) -> bool:
    """Whether a periodic action (log, evaluate, checkpoint) is due after optimizer step `step` (1-based): every
    `every` steps (0: never on a period), and, with `last`, at the run's final step `total`. Every periodic decision
    of both loops is asked here."""
    return (every > 0 and step % every == 0) or (last and step == total)
