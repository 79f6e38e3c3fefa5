"""The pretraining config: model, MPP objective, data, optimizer (the paper's recipe by default), run.

Config modules import no torch, so a bad config is reported before the heavy imports start.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

from vit_mpp.config.engine import above, at_least, between, opt, section
from vit_mpp.config.sections import ARCH_KEYS, DataConfig, ExportConfig, ModelConfig, OptimConfig, TrainConfig

DESCRIPTION = "Masked patch prediction pretraining of a timm ViT."


@dataclass
class MPPConfig:
    """The corruption rule and target (docs/method.md: 50% corrupted; of those 80% [mask], 10% random patch, 10%
    kept)."""

    mask_ratio: float = opt(0.5, "fraction of patches corrupted per image (exactly round(ratio * N))",
                            between(0, 1, lo_open=True))
    mask_prob: float = opt(0.8, "of the corrupted: fraction replaced by the [mask] embedding", between(0, 1))
    random_prob: float = opt(0.1, "of the corrupted: fraction replaced by another patch of the same image",
                             between(0, 1))
    target: Literal["mean_color", "pixels_4x4", "l2"] = opt("mean_color", "what the head predicts")
    # 2**(3 * bits) classes: 512 at 3 bits (the paper), 4096 at 4; 5 bits would be a 32768-way head (x16 for
    # pixels_4x4), which is no longer a small head.
    bits: int = opt(3, "bits per colour channel for the classification targets", between(1, 4))

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.mask_prob + self.random_prob > 1:
            yield "random_prob", f"+ mpp.mask_prob must be at most 1, got {self.random_prob} + {self.mask_prob}"


@dataclass
class KnnConfig:
    """The k-NN monitor (pretrain/knn.py): at each evaluation, when the shards carry labels, k-NN top-1 of validation
    images against labelled training images, from the [class] token and from the patch mean."""

    train_images: int = opt(5000, "labelled reference images read at each evaluation (0: no k-NN monitor)",
                            at_least(0))
    val_images: int = opt(1000, "validation images classified at each evaluation", at_least(1))
    k: int = opt(20, "neighbours that vote", at_least(1))
    temperature: float = opt(0.07, "each vote weighs exp(cosine similarity / temperature) (DINO's rule)", above(0))
    train_split: str = opt("", "the labelled split references come from ('' = data.train_split)")


@dataclass
class PretrainTrainConfig(TrainConfig):
    run_dir: str = opt("runs/pretrain", "run directory (config, metrics, checkpoints, export); re-running resumes")
    steps: int = opt(1000, "optimizer steps (the paper: 1M at batch 4096)", at_least(1))
    eval_every: int = opt(500, "evaluate the MPP loss on the validation split every N steps (0: only at the end)",
                          at_least(0))


@dataclass
class PretrainConfig:
    # What a resumed run cannot change: the checkpoint's tensors (model, head, optimizer state) have these shapes.
    FIXED_ON_RESUME: ClassVar[tuple[str, ...]] = (*(f"model.{k}" for k in ARCH_KEYS), "model.img_size",
                                                  "mpp.target", "mpp.bits", "optim.name")

    LENGTH_KEY: ClassVar[str] = "train.steps"

    def total_steps(self, steps_per_epoch: int | None = None) -> int:
        """The run's length in optimizer steps."""
        return self.train.steps

    model: ModelConfig = section(ModelConfig)
    mpp: MPPConfig = section(MPPConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    train: PretrainTrainConfig = section(PretrainTrainConfig)
    knn: KnnConfig = section(KnnConfig)
    export: ExportConfig = section(ExportConfig)
