"""Building the timm VisionTransformer that both stages train, from a `ModelConfig`."""

from __future__ import annotations

from typing import Any

import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import ModelConfig, img_hw


def create_vit(cfg: ModelConfig, num_classes: int = 0) -> VisionTransformer:
    """A randomly initialised timm ViT with a class token, the given input size and (optionally) custom sizes."""
    if cfg.name not in timm.list_models():
        raise ConfigError(f"model.name '{cfg.name}' is not a timm model (see timm.list_models('vit_*'))")
    h, w = img_hw(cfg.img_size)
    overrides = {k: getattr(cfg, k) for k in ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")}
    kwargs: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    try:
        # fc_norm=False: with avg pooling timm would otherwise move the final norm after the pooling (a new
        # fc_norm layer, an Identity `norm`), and a pretrained encoder's `norm` weights would no longer load.
        model = timm.create_model(cfg.name, pretrained=False, num_classes=num_classes, img_size=(h, w),
                                  drop_path_rate=cfg.drop_path_rate, global_pool=cfg.global_pool, fc_norm=False,
                                  **kwargs)
    except TypeError as e:
        raise ConfigError(f"model '{cfg.name}' does not take these settings: {e}") from None
    if not isinstance(model, VisionTransformer):
        raise ConfigError(f"model.name '{cfg.name}' is a {type(model).__name__}, not a timm VisionTransformer")
    if model.cls_token is None or model.pos_embed is None:
        raise ConfigError(f"model '{cfg.name}' has no class token or no learned position embedding; MPP needs both")
    ph, pw = model.patch_embed.patch_size
    if h % ph or w % pw:
        raise ConfigError(f"model.img_size {h}x{w} is not divisible by the patch size {ph}x{pw}")
    model.set_grad_checkpointing(cfg.grad_checkpointing)
    return model


def architecture(cfg: ModelConfig) -> dict[str, Any]:
    """The effective architecture sizes of `cfg` (the named model's values where `cfg` leaves them None)."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = create_vit(cfg)
    block = model.blocks[0]
    return {"name": cfg.name, "patch_size": patch_size(model), "embed_dim": model.embed_dim, "depth": len(model.blocks),
            "num_heads": block.attn.num_heads, "mlp_ratio": block.mlp.fc1.out_features / model.embed_dim}


def patch_size(model: VisionTransformer) -> int:
    """The (square) patch size P of a timm ViT."""
    ph, pw = model.patch_embed.patch_size
    if ph != pw:
        raise ConfigError(f"non-square patches {ph}x{pw} are not supported")
    return ph


def grid_size(model: VisionTransformer) -> tuple[int, int]:
    """The patch grid (rows, columns) of a timm ViT at its input size."""
    return tuple(model.patch_embed.grid_size)


def norm_stats(model: VisionTransformer) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Normalisation mean and std the model expects (from its timm pretrained config)."""
    cfg = model.pretrained_cfg or {}
    return tuple(cfg.get("mean", (0.5, 0.5, 0.5))), tuple(cfg.get("std", (0.5, 0.5, 0.5)))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
