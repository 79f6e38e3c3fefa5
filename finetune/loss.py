"""Fine-tuning's forward pass of a micro-batch: the augmentations that run on the device (colour jitter, random
erasing, mixup and cutmix), the classifier and the classification loss (`ClassificationLoss`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from finetune.augment import build_mixup, build_random_erasing, color_jitter
from finetune.config import FinetuneConfig
from vit_mpp.data.stream import normalize


class ClassificationLoss:
    """`loss(model, batch)` -> {"loss", "metrics": {"acc"}} for a uint8 batch on the device."""

    def __init__(self, cfg: FinetuneConfig, num_classes: int, micro_batch: int, device: torch.device,
                 mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        aug, label_smoothing = cfg.augment, cfg.train.label_smoothing
        self.aug, self.label_smoothing, self.mean, self.std = aug, label_smoothing, mean, std
        self.mixup = build_mixup(aug, num_classes, label_smoothing, micro_batch)  # None when off
        self.erasing = build_random_erasing(aug, device)  # None when off
        self.soft_ce = SoftTargetCrossEntropy()

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """A uint8 training batch (B, 3, H, W) -> the model's input: colour jitter, normalisation, random erasing."""
        if self.aug.color_jitter > 0:
            images = color_jitter(images, self.aug.color_jitter)  # (B, 3, H, W) float in [0, 255]
        x = normalize(images, self.mean, self.std)
        if self.erasing is not None:  # in place, on the normalised batch (finetune/augment.py says why)
            x = self.erasing(x)
        return x

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        x, labels = self.inputs(batch["image"]), batch["label"]
        if self.mixup is not None:  # mixes the normalised batch; targets become (B, K) soft labels, smoothed
            x, soft = self.mixup(x, labels)
            logits = model(x)
            loss = self.soft_ce(logits.float(), soft)
        else:
            logits = model(x)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        acc = (logits.argmax(1) == labels).float().mean()  # against the unmixed labels: a rough guide with mixup
        return {"loss": loss, "metrics": {"acc": acc.detach()}}

    def describe(self) -> str:
        """The active device-side augmentations and the loss, for the start-up summary."""
        aug, parts = self.aug, []
        if aug.color_jitter > 0:
            parts.append(f"colour jitter {aug.color_jitter:g}")
        if self.erasing is not None:
            parts.append(f"random erasing p={aug.reprob:g} ({aug.remode}, up to {aug.recount})")
        if self.mixup is not None:
            parts.append(f"mixup {aug.mixup:g} / cutmix {aug.cutmix:g} (p={aug.mix_prob:g}, switch "
                         f"{aug.switch_prob:g})")
        if self.label_smoothing:
            parts.append(f"label smoothing {self.label_smoothing:g}")
        return ", ".join(parts) or "none"
