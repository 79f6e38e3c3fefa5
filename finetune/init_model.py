"""The classifier fine-tuning starts from: a pretrained encoder (or random init), resized, with a zero head."""

from __future__ import annotations

import dataclasses
import math

from timm.models.vision_transformer import VisionTransformer

from common.checkpoint import load_encoder_export
from common.config import ModelConfig
from common.models import ARCH_KEYS, create_encoder, img_hw, norm_stats
from finetune.config import InitConfig
from finetune.surgery import attach_zero_head, load_encoder_weights


def build_classifier(init: InitConfig, model_cfg: ModelConfig, num_classes: int,
                     ) -> tuple[VisionTransformer, tuple[float, ...], tuple[float, ...], ModelConfig]:
    """(model, mean, std, resolved model config). With an export, its architecture wins over `model_cfg`'s."""
    if not init.checkpoint:
        model = create_encoder(model_cfg)
        attach_zero_head(model, num_classes)
        mean, std = norm_stats(model)
        return model, mean, std, model_cfg
    state, meta = load_encoder_export(init.checkpoint)
    if meta is not None:
        arch = {k: meta["model"][k] for k in ARCH_KEYS if k in meta["model"]}
        model_cfg = dataclasses.replace(model_cfg, **arch)
        ph = int(state["patch_embed.proj.weight"].shape[-1])
        old_h, old_w = img_hw(meta["model"]["img_size"])
        old_grid = (old_h // ph, old_w // ph)
    else:  # a bare state dict: assume a square grid (the [class] token is the one prefix row)
        side = int(math.isqrt(state["pos_embed"].shape[1] - 1))
        old_grid = (side, side)
    model = create_encoder(model_cfg)
    load_encoder_weights(model, state, old_grid, init.posemb_interp)
    attach_zero_head(model, num_classes)
    default_mean, default_std = norm_stats(model)
    mean = tuple(meta.get("mean", default_mean)) if meta else default_mean
    std = tuple(meta.get("std", default_std)) if meta else default_std
    return model, mean, std, model_cfg
