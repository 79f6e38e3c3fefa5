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
    target: Literal["mean_color", "pixels_4x4", "l2", "hog"] = opt(
        "mean_color", "what the head predicts: a patch's 3-bit mean colour, its 4x4 colours, its pixels (L2), or "
        "MaskFeat's histograms of oriented gradients (hog, L2; an even patch size)")
    # 2**(3 * bits) classes: 512 at 3 bits (the paper), 4096 at 4; 5 bits would be a 32768-way head (x16 for
    # pixels_4x4), which is no longer a small head.
    bits: int = opt(3, "bits per colour channel for the classification targets", between(1, 4))
    # Beyond the paper (docs/pretrain.md#beyond-the-papers-recipe): each off by default, so the default is the paper.
    norm_pix: bool = opt(False, "with mpp.target=l2: each patch's target is its own pixels (in [0, 1]) minus their "
                         "mean, over sqrt(variance + 1e-6) (MAE's norm_pix_loss)")
    decoder_depth: int = opt(0, "transformer blocks (timm's Block, MLP ratio 4) between the encoder and the head, "
                             "over all tokens, with fixed 2-D sin-cos position embeddings and a final LayerNorm; "
                             "0: the paper, the head reads the encoder's output", between(0, 4))
    decoder_dim: int = opt(0, "the decoder's width; 0: the encoder's (and its number of heads); else a Linear "
                           "projects to it and the blocks have max(1, decoder_dim // 32) heads, lowered until they "
                           "divide decoder_dim", at_least(0))
    mask_shape: Literal["random", "block"] = opt("random", "where the corrupted patches lie: random (the paper) or "
                                                 "block (BEiT: a union of random rectangles on the patch grid, "
                                                 "trimmed to exactly round(mask_ratio * N))")

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.mask_prob + self.random_prob > 1:
            yield "random_prob", f"+ mpp.mask_prob must be at most 1, got {self.random_prob} + {self.mask_prob}"
        if self.norm_pix and self.target != "l2":
            yield "norm_pix", f"needs mpp.target=l2 (it normalises pixel targets), got mpp.target={self.target}"
        if self.decoder_dim and not self.decoder_depth:
            yield "decoder_dim", (f"needs mpp.decoder_depth >= 1 (the width of a decoder), got "
                                  f"mpp.decoder_depth={self.decoder_depth}")


@dataclass
class KnnConfig:
    """The k-NN monitor (pretrain/knn.py): at each evaluation, when the shards carry labels, k-NN top-1 of validation
    images against labelled training images, from the [class] token and from the patch mean; and, with
    `probe_epochs`, a linear and an attentive probe of the same features (pretrain/probes.py)."""

    train_images: int = opt(5000, "labelled reference images read at each evaluation (0: no k-NN monitor)",
                            at_least(0))
    val_images: int = opt(1000, "validation images classified at each evaluation", at_least(1))
    k: int = opt(20, "neighbours that vote", at_least(1))
    temperature: float = opt(0.07, "each vote weighs exp(cosine similarity / temperature) (DINO's rule)", above(0))
    train_split: str = opt("", "the labelled split references come from ('' = data.train_split)")
    probe_epochs: int = opt(0, "also train a linear and an attentive probe on the same frozen features, this many "
                               "epochs, at each evaluation (knn_probe_linear, knn_probe_attentive; 0: off)",
                            at_least(0))


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
                                                  "mpp.target", "mpp.bits", "mpp.decoder_depth",
                                                  "mpp.decoder_dim", "optim.name")

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
