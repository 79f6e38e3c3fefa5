"""Training augmentations of fine-tuning, from timm: RandAugment in the data-loader workers (`RandAugmentU8`, timm's
own PIL ops on the worker's uint8 crop); colour jitter, random erasing and mixup/cutmix on the device
(`color_jitter`, `build_random_erasing`, `build_mixup`). Where each runs, why, and what it costs:
docs/finetune.md#where-each-augmentation-runs-and-what-it-costs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from timm.data import Mixup
from timm.data.auto_augment import posterize, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torchvision.transforms.v2.functional import pil_to_tensor

from finetune.config import AugmentConfig, SemiConfig
from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import img_hw

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


class RandAugmentU8:
    """timm's RandAugment (a config string such as `rand-m9-mstd0.5-inc1`) on a uint8 image tensor (3, H, W).

    The ops' settings are those timm's `create_transform` gives them for MAE/DeiT fine-tuning: geometric ops resample
    bicubic and fill with the normalisation mean, translations reach 45% of the shorter side.
    """

    def __init__(self, config_str: str, img_size: int | list[int], mean: tuple[float, ...]) -> None:
        h, w = img_hw(img_size)
        hparams = {"translate_const": int(min(h, w) * 0.45), "interpolation": Image.Resampling.BICUBIC,
                   "img_mean": tuple(min(255, round(255 * m)) for m in mean)}
        self.transform = rand_augment_transform(config_str, hparams)
        for op in self.transform.ops:
            if op.name.startswith("Posterize"):
                op.aug_fn = _posterize

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        hwc = np.ascontiguousarray(image.permute(1, 2, 0).numpy())  # no copy for a channels-last crop
        return pil_to_tensor(self.transform(Image.fromarray(hwc))).contiguous()  # (3, H, W) uint8


def _posterize(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize, also for 0 bits kept (or fewer), which `PosterizeIncreasing` asks for at magnitude 10 (reached
    with `mstd` noise): recent Pillow (13 here) raises for it, so in a worker the image would count as undecodable;
    older Pillow and the TensorFlow original return a black image, as this does."""
    return Image.new(img.mode, img.size) if bits_to_keep <= 0 else posterize(img, bits_to_keep)


def build_random_erasing(aug: AugmentConfig, device: torch.device) -> RandomErasing | None:
    """timm's RandomErasing for the normalised training batch when `augment.reprob` > 0, else None."""
    if aug.reprob <= 0:
        return None
    return RandomErasing(probability=aug.reprob, mode=aug.remode, max_count=aug.recount, device=device)


def unchanged(image: torch.Tensor) -> torch.Tensor:
    """The crop as it is: the pool's strong view when it has erasing of its own but no RandAugment (a function of the
    module, so that a loader worker started by pickling its stream can take it)."""
    return image


def pool_augment(semi: SemiConfig, img_size: int | list[int],
                 mean: tuple[float, ...]) -> RandAugmentU8 | Callable[[torch.Tensor], torch.Tensor] | None:
    """What the loader workers do to a pool image's crop for its strong view: `semi.strong`'s RandAugment, the crop
    unchanged when the view is the pool's own without it (`semi.strong_erasing` only), or None when the pool's
    student view is a labelled image's (`augment.*`)."""
    if not semi.own_strong_view:
        return None
    return RandAugmentU8(semi.strong, img_size, mean) if semi.strong else unchanged


def pool_erasing(semi: SemiConfig, device: torch.device) -> RandomErasing | None:
    """timm's RandomErasing of the pool's strong view (`semi.strong_erasing`): one rectangle filled with 0 in
    normalised units, the mean colour, as FixMatch's Cutout fills with grey; None when off."""
    if semi.strong_erasing <= 0:
        return None
    return RandomErasing(probability=semi.strong_erasing, mode="const", max_count=1, device=device)
