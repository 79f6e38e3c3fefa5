"""Batch augmentations done on the device: colour jitter, and mixup/cutmix with their soft-target loss.

Crops and flips happen in the data-loader workers (common/data_stream.py); these two need the whole batch or
float pixels, so they run on the accelerator, on the uint8-valued batch before normalisation.
"""

from __future__ import annotations

import torch
from timm.data import Mixup

from common.config import ConfigError
from finetune.config import AugmentConfig

GRAY = (0.299, 0.587, 0.114)  # ITU-R 601 luma, as torchvision's rgb_to_grayscale


def color_jitter(images: torch.Tensor, strength: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random brightness, contrast and saturation per image, each factor drawn from [1 - s, 1 + s].

    `images` (B, 3, H, W) holds values in [0, 255] (uint8 or float); returns float in [0, 255], ready for
    `normalize`. The three adjustments follow torchvision's ColorJitter (blend with black, the mean grey, the
    per-pixel grey), in a fixed order.
    """
    x = images.float()
    b = x.shape[0]

    def factor() -> torch.Tensor:  # (B, 1, 1, 1)
        u = torch.rand(b, 1, 1, 1, device=x.device, generator=generator)
        return 1.0 + (2.0 * u - 1.0) * strength

    gray_w = torch.tensor(GRAY, device=x.device).view(1, 3, 1, 1)
    x = (x * factor()).clamp(0, 255)  # brightness
    mean_gray = (x * gray_w).sum(1, keepdim=True).mean((2, 3), keepdim=True)  # (B, 1, 1, 1)
    x = ((x - mean_gray) * factor() + mean_gray).clamp(0, 255)  # contrast
    gray = (x * gray_w).sum(1, keepdim=True)  # (B, 1, H, W)
    return ((x - gray) * factor() + gray).clamp(0, 255)  # saturation


def build_mixup(aug: AugmentConfig, num_classes: int, label_smoothing: float, micro_batch: int) -> Mixup | None:
    """timm's Mixup (it also smooths the labels) when mixup or cutmix is on, else None."""
    if aug.mixup <= 0 and aug.cutmix <= 0:
        return None
    if micro_batch % 2:
        raise ConfigError(f"mixup/cutmix pair images within a batch: the per-device batch {micro_batch} must be even")
    return Mixup(mixup_alpha=aug.mixup, cutmix_alpha=aug.cutmix, prob=aug.mix_prob, switch_prob=aug.switch_prob,
                 label_smoothing=label_smoothing, num_classes=num_classes)
