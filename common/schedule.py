"""The learning rate as a pure function of the optimizer step: linear warmup, then cosine decay."""

from __future__ import annotations

import math

from common.config import OptimConfig


def scaled_lr(optim: OptimConfig, batch_size: int) -> float:
    """Peak learning rate for a global batch size, by linear scaling from `optim.base_batch_size`."""
    return optim.base_lr * batch_size / optim.base_batch_size


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
