"""Semi-supervised fine-tuning's loss (`semi.pool`): Semi-ViT's EMA teacher (arXiv 2208.05688), without its
probabilistic pseudo mixup, with FixMatch's strong view of the pool when asked. A micro-batch mixes labelled images
and pool images (vit_mpp/data/stream.py: `pool`, `weak`); the teacher, the model's EMA, sees a pool image's weak view
(crop and flip only), and a pool image whose top probability passes its threshold (finetune/thresholds.py) trains
the student's strong view towards that class. The strong view is a labelled image's augmentation, or with
`semi.strong` / `semi.strong_erasing` the pool's own. docs/finetune.md#semi-supervised-fine-tuning-semi.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from timm.utils import ModelEmaV3

from finetune.augment import pool_erasing
from finetune.config import SemiConfig
from finetune.loss import ClassificationLoss
from finetune.pool_gate import PoolGate
from finetune.thresholds import PoolThresholds
from vit_mpp.data.stream import normalize


class PseudoLabelLoss:
    """`loss(model, batch)` -> {"loss", "metrics"}: the labelled images' cross-entropy (mean over them) plus
    `semi.weight` x the pool images' cross-entropy against the teacher's confident labels (mean over the pool
    images, the unconfident counting 0, as in FixMatch and Semi-ViT). Metrics: `acc` (labelled), `pseudo_kept` (the
    share of pool images above their threshold) and, when the pool's shards are labelled (`pool_labelled`: a proxy
    experiment's), `pseudo_acc` (of the pool images kept, the share whose pseudo-label is their label: a diagnostic;
    the pool's labels are never trained on), `pool_on` (1 while `semi.gate` lets the pool's loss count). `log_extra`
    adds each class's threshold and share kept to a log record. The thresholds' running statistics, when they have
    any, are saved in the run's checkpoints; the gate's state is the trainer's (finetune/train.py)."""

    def __init__(self, semi: SemiConfig, labelled: ClassificationLoss, ema: ModelEmaV3, accelerator: Accelerator,
                 num_classes: int, pool_labelled: bool = False) -> None:
        self.semi, self.labelled, self.ema, self.accelerator = semi, labelled, ema, accelerator
        self.pool_labelled = pool_labelled
        self.thresholds = PoolThresholds(semi, num_classes, lambda t: accelerator.reduce(t, "sum")).to(
            accelerator.device)
        if self.thresholds.stateful:  # before the run resumes, so that load_state restores them
            accelerator.register_for_checkpointing(self.thresholds)
        self.erasing = pool_erasing(semi, accelerator.device)  # None when off
        self.gate = PoolGate.resumed(semi.gate, {})  # a resumed run's replaces it (Finetuning)

    def warning(self, num_classes: int) -> str | None:
        """A fixed threshold the teacher cannot reach: trained with label smoothing s on K classes, its top probability
        settles near 1 - s + s / K (the smoothed target), so above that few pool images, if any, ever pass."""
        smoothing = self.labelled.label_smoothing
        most = 1 - smoothing + smoothing / num_classes
        if smoothing <= 0 or self.semi.threshold <= most or self.semi.threshold_mode != "fixed":
            return None
        return (f"warning: semi.threshold {self.semi.threshold:g} is above {most:.3g}, the top probability of a "
                f"teacher trained with train.label_smoothing={smoothing:g} on {num_classes} classes: few pool images, "
                "if any, will train the student")

    @torch.no_grad()
    def teacher(self, weak: torch.Tensor) -> torch.Tensor:
        """The teacher's probabilities (B, K) on the weak views, in its evaluation mode (no drop path)."""
        teacher = self.ema.module
        teacher.eval()
        with self.accelerator.autocast():
            return teacher(normalize(weak, self.labelled.mean, self.labelled.std)).float().softmax(1)

    def inputs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The student's input: every image through the labelled images' augmentations, and with a strong view of the
        pool's own its pool rows instead through it alone (RandAugment came from the workers; its erasing here)."""
        x = self.labelled.inputs(batch["image"])
        if not self.semi.own_strong_view:
            return x
        strong = normalize(batch["image"], self.labelled.mean, self.labelled.std)
        if self.erasing is not None:  # on the whole batch, then the pool's rows kept: selecting them reads the host
            strong = self.erasing(strong)
        return torch.where(batch["pool"][:, None, None, None], strong, x)

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        pool, labels = batch["pool"], batch["label"]
        # Every row through the teacher, not the pool's rows alone: selecting them would read the mask on the host
        confidence, pseudo, kept = self.thresholds(self.teacher(batch["weak"]), pool)
        logits = model(self.inputs(batch)).float()
        labelled = ~pool
        n_labelled, n_pool = labelled.sum().clamp(min=1), pool.sum().clamp(min=1)
        supervised = F.cross_entropy(logits, labels.clamp(min=0), reduction="none",
                                     label_smoothing=self.labelled.label_smoothing)
        unsupervised = F.cross_entropy(logits, pseudo, reduction="none")
        weight = self.semi.weight if self.gate.open else 0.0  # closed: the pool is labelled, and trains nothing
        loss = (supervised * labelled).sum() / n_labelled + weight * (unsupervised * kept).sum() / n_pool
        metrics = {"acc": ((logits.argmax(1) == labels) & labelled).sum() / n_labelled,
                   "pseudo_kept": kept.sum() / n_pool}
        if self.pool_labelled:
            known = kept & (labels >= 0)
            metrics["pseudo_acc"] = ((pseudo == labels) & known).sum() / known.sum().clamp(min=1)
        metrics = {k: v.detach() for k, v in metrics.items()}
        if self.gate.gates:  # a host number, as the step meter takes it: no copy to the device each step
            metrics["pool_on"] = float(self.gate.open)
        return {"loss": loss, "metrics": metrics}

    def log_extra(self) -> dict[str, Any]:
        """Each class's threshold and share of the pool kept since the last log (a collective: every process)."""
        return self.thresholds.per_class()

    def describe(self) -> str:
        """The labelled loss's augmentations, and the pool's settings, for the start-up summary."""
        semi = self.semi
        if semi.own_strong_view:
            parts = [f"RandAugment {semi.strong}" if semi.strong else "",
                     f"erasing p={semi.strong_erasing:g}" if semi.strong_erasing > 0 else ""]
            view = "its own strong view (" + ", ".join(p for p in parts if p) + ")"
        else:
            view = "the labelled images' augmentations as its strong view"
        return (f"{self.labelled.describe()} | pool: {semi.ratio:g} images per labelled image, {view}, "
                f"pseudo-labels from the EMA {self.thresholds.describe()}, weight {semi.weight:g}"
                f"{self.gate.describe()}")
