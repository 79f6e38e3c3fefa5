"""Semi-supervised fine-tuning's loss (`semi.pool`): Semi-ViT's EMA teacher (arXiv 2208.05688), without its
probabilistic pseudo mixup. A micro-batch mixes labelled images and pool images (vit_mpp/data/stream.py: `pool`,
`weak`); the student sees every image through the training augmentations (the strong view), the teacher, the
model's EMA, sees a pool image's weak view (crop and flip only), and a pool image whose top probability reaches
`semi.threshold` trains the student towards that class. docs/finetune.md#semi-supervised-fine-tuning-semi.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from timm.utils import ModelEmaV3

from finetune.config import SemiConfig
from finetune.loss import ClassificationLoss
from vit_mpp.data.stream import normalize


class PseudoLabelLoss:
    """`loss(model, batch)` -> {"loss", "metrics"}: the labelled images' cross-entropy (mean over them) plus
    `semi.weight` x the pool images' cross-entropy against the teacher's confident labels (mean over the pool
    images, the unconfident counting 0, as in FixMatch and Semi-ViT). Metrics: `acc` (labelled), `pseudo_kept` (the
    share of pool images above the threshold) and, when the pool's shards are labelled (`pool_labelled`: a proxy
    experiment's), `pseudo_acc` (of the pool images kept, the share whose pseudo-label is their label: a diagnostic;
    the pool's labels are never trained on)."""

    def __init__(self, semi: SemiConfig, labelled: ClassificationLoss, ema: ModelEmaV3, accelerator: Accelerator,
                 pool_labelled: bool = False) -> None:
        self.semi, self.labelled, self.ema, self.accelerator = semi, labelled, ema, accelerator
        self.pool_labelled = pool_labelled

    def warning(self, num_classes: int) -> str | None:
        """A threshold the teacher cannot reach: trained with label smoothing s on K classes, its top probability
        settles near 1 - s + s / K (the smoothed target), so above that few pool images, if any, ever pass."""
        smoothing = self.labelled.label_smoothing
        most = 1 - smoothing + smoothing / num_classes
        if smoothing <= 0 or self.semi.threshold <= most:
            return None
        return (f"warning: semi.threshold {self.semi.threshold:g} is above {most:.3g}, the top probability of a "
                f"teacher trained with train.label_smoothing={smoothing:g} on {num_classes} classes: few pool images, "
                "if any, will train the student")

    @torch.no_grad()
    def teacher(self, weak: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(confidence, class) of the teacher on the weak views, in its evaluation mode (no drop path)."""
        teacher = self.ema.module
        teacher.eval()
        with self.accelerator.autocast():
            probs = teacher(normalize(weak, self.labelled.mean, self.labelled.std)).float().softmax(1)
        return probs.max(1)

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        pool, labels = batch["pool"], batch["label"]
        # Every row through the teacher, not the pool's rows alone: selecting them would read the mask on the host
        confidence, pseudo = self.teacher(batch["weak"])
        logits = model(self.labelled.inputs(batch["image"])).float()
        labelled = ~pool
        n_labelled, n_pool = labelled.sum().clamp(min=1), pool.sum().clamp(min=1)
        supervised = F.cross_entropy(logits, labels.clamp(min=0), reduction="none",
                                     label_smoothing=self.labelled.label_smoothing)
        kept = pool & (confidence >= self.semi.threshold)
        unsupervised = F.cross_entropy(logits, pseudo, reduction="none")
        loss = (supervised * labelled).sum() / n_labelled + self.semi.weight * (unsupervised * kept).sum() / n_pool
        metrics = {"acc": ((logits.argmax(1) == labels) & labelled).sum() / n_labelled,
                   "pseudo_kept": kept.sum() / n_pool}
        if self.pool_labelled:
            known = kept & (labels >= 0)
            metrics["pseudo_acc"] = ((pseudo == labels) & known).sum() / known.sum().clamp(min=1)
        return {"loss": loss, "metrics": {k: v.detach() for k, v in metrics.items()}}

    def describe(self) -> str:
        """The labelled loss's augmentations, and the pool's settings, for the start-up summary."""
        semi = self.semi
        return (f"{self.labelled.describe()} | pool: {semi.ratio:g} images per labelled image, pseudo-labels from "
                f"the EMA above {semi.threshold:g}, weight {semi.weight:g}")
