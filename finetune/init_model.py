"""The classifier fine-tuning starts from: a pretrained encoder (or a random one), resized, with a zero head.

The fine-tuning rule of the ViT paper: drop the pretraining head, attach a D x K linear layer initialised to zero
(weights and bias; timm's `reset_classifier` does not zero it), keep the patch size and resize the position
embeddings to the new resolution (vit_mpp/pretrained.py).
"""

from __future__ import annotations

import dataclasses

import torch
from timm.models.vision_transformer import VisionTransformer

from finetune.config import InitConfig
from finetune.modes import freeze_encoder
from vit_mpp.config import ARCH_KEYS, ConfigError, ModelConfig
from vit_mpp.models import architecture, create_vit, norm_stats
from vit_mpp.pretrained import build_model, read_pretrained


def attach_zero_head(model: VisionTransformer, num_classes: int) -> None:
    """Replace the classifier by a D x K linear layer with zero weight and bias."""
    model.reset_classifier(num_classes)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)


def build_classifier(init: InitConfig, model_cfg: ModelConfig, num_classes: int, freeze: bool = False,
                     ) -> tuple[VisionTransformer, tuple[float, ...], tuple[float, ...], ModelConfig]:
    """(model, mean, std, resolved model config); with `freeze` (a linear probe) only the head keeps gradients, so
    the optimizer's parameter groups hold the head only.

    A checkpoint that names its architecture (an export, a hub model) fixes the architecture keys of `model_cfg`;
    an architecture key set in `model_cfg` that differs from it is an error. `img_size`, `global_pool` and the
    training settings stay `model_cfg`'s. timm and npz checkpoints are loaded into the architecture `model_cfg` names.
    """
    mean = std = None
    if init.checkpoint:
        pre = read_pretrained(init.checkpoint, model_cfg, init.kind, init.grid)
        if pre.model is not None:
            _check_same_architecture(model_cfg, pre.model)
            model_cfg = dataclasses.replace(model_cfg, **{k: getattr(pre.model, k) for k in ARCH_KEYS})
        model = build_model(model_cfg, pre, interp=init.posemb_interp)  # headless: attach_zero_head adds it
        mean, std = pre.mean, pre.std
    else:  # from scratch
        model = create_vit(model_cfg)
    attach_zero_head(model, num_classes)
    if freeze:
        freeze_encoder(model)
    default_mean, default_std = norm_stats(model)
    mean, std = _chosen_stats(init, mean or default_mean, std or default_std)
    return model, mean, std, model_cfg


def _check_same_architecture(asked: ModelConfig, checkpoint: ModelConfig) -> None:
    """An architecture size set in the fine-tuning config must agree with the checkpoint's (it cannot change)."""
    given = {k: getattr(asked, k) for k in ARCH_KEYS if k != "name" and getattr(asked, k) is not None}
    if not given:
        return
    actual = architecture(checkpoint)
    differ = [f"model.{k}={v} (the checkpoint's is {actual[k]:g})" for k, v in given.items() if v != actual[k]]
    if differ:
        raise ConfigError(f"the checkpoint fixes the architecture, which cannot change in fine-tuning: "
                          f"{', '.join(differ)}; remove these keys or use another checkpoint")


def _chosen_stats(init: InitConfig, mean: tuple[float, ...], std: tuple[float, ...],
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`init.mean` / `init.std` when given, else the defaults passed in."""
    return (tuple(init.mean) if init.mean is not None else tuple(mean)), \
        (tuple(init.std) if init.std is not None else tuple(std))
