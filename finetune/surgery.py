"""The fine-tuning rule of the ViT paper: resize the position embeddings to the new grid, attach a zero head."""

from __future__ import annotations

from typing import Literal

import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

from common.checkpoint import CheckpointError

PRETRAIN_ONLY_PREFIXES = ("head.", "mask_token", "fc_norm.")  # dropped: the classifier is new


def resize_pos_embed(posemb: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int],
                     num_prefix_tokens: int = 1, mode: Literal["bilinear", "bicubic"] = "bilinear") -> torch.Tensor:
    """Resize (1, prefix + gh*gw, D) position embeddings to a new grid, keeping the prefix ([class]) rows as they are.

    `bilinear` matches the original ViT code (align_corners=True, i.e. scipy.ndimage.zoom(order=1));
    `bicubic` matches timm and MAE (align_corners=False, antialiased).
    """
    if tuple(old_grid) == tuple(new_grid):
        return posemb
    if mode == "bilinear":
        return resample_abs_pos_embed(posemb, list(new_grid), list(old_grid), num_prefix_tokens=num_prefix_tokens,
                                      interpolation="bilinear", antialias=False, align_corners=True)
    if mode == "bicubic":
        return resample_abs_pos_embed(posemb, list(new_grid), list(old_grid), num_prefix_tokens=num_prefix_tokens,
                                      interpolation="bicubic", antialias=True)
    raise ValueError(f"unknown position-embedding interpolation {mode!r} (bilinear or bicubic)")


def load_encoder_weights(model: VisionTransformer, state: dict[str, torch.Tensor], old_grid: tuple[int, int],
                         mode: Literal["bilinear", "bicubic"] = "bilinear") -> None:
    """Load encoder weights into `model` (any input size): the position embeddings are resized, heads are dropped.

    Raises CheckpointError listing missing and unexpected keys when the checkpoint does not fit.
    """
    state = {k: v for k, v in state.items() if not k.startswith(PRETRAIN_ONLY_PREFIXES)}
    if "patch_embed.proj.weight" in state:
        ckpt_patch = tuple(state["patch_embed.proj.weight"].shape[-2:])
        if ckpt_patch != tuple(model.patch_embed.patch_size):
            raise CheckpointError(f"checkpoint patch size {ckpt_patch} differs from the model's "
                                  f"{tuple(model.patch_embed.patch_size)}; patch size cannot change in fine-tuning")
    if "pos_embed" in state:
        prefix = 0 if model.no_embed_class else model.num_prefix_tokens
        state["pos_embed"] = resize_pos_embed(state["pos_embed"], old_grid, tuple(model.patch_embed.grid_size),
                                              prefix, mode)
    expected = {k for k in model.state_dict() if not k.startswith(PRETRAIN_ONLY_PREFIXES)}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not fit the model: missing keys {missing[:8]}"
                              f"{'...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
                              f"{'...' if len(unexpected) > 8 else ''}")
    mismatched = [k for k, v in state.items() if v.shape != model.state_dict()[k].shape]
    if mismatched:
        raise CheckpointError(f"checkpoint shapes differ from the model's for: {', '.join(mismatched[:8])}")
    # Not strict: the model's own head and fc_norm (if any) are new; every other key was checked just above.
    model.load_state_dict(state, strict=False)


def attach_zero_head(model: VisionTransformer, num_classes: int) -> None:
    """Replace the classifier by a D x K linear layer with zero weight and bias (timm's reset does not zero it)."""
    model.reset_classifier(num_classes)
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)
