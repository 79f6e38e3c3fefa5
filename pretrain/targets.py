"""Masked-patch-prediction targets, computed exactly in integers from the un-normalised uint8 pixels of a batch:
`mean_color_target` and `pixels_4x4_target` (colour classes at `bits` bits per channel), `l2_target` (normalised
pixels), `norm_pix_target` (each patch normalised by its own statistics). The quantisation:
docs/method.md#masked-patch-prediction-pretraining; the shapes: docs/pretrain.md.
"""

from __future__ import annotations

import torch

TARGETS = ("mean_color", "pixels_4x4", "l2")


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C, P, P), patches in raster order (the order of timm's patch tokens)."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // p, p, w // p, p)  # (B, C, gh, P, gw, P)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c, p, p)


def colour_class(sums: torch.Tensor, count: int, bits: int = 3) -> torch.Tensor:
    """Class of colours given as integer channel sums over `count` pixels: (..., 3) int -> (...) int64."""
    levels = 2**bits
    level = (sums.long() * levels) // (256 * count)  # floor(mean * levels / 256), exactly
    level = level.clamp_(0, levels - 1)
    return (level[..., 0] * levels + level[..., 1]) * levels + level[..., 2]


def mean_color_target(images_u8: torch.Tensor, p: int, bits: int = 3) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, N) class of each patch's mean colour."""
    sums = patchify(images_u8.to(torch.int32), p).sum(dim=(-1, -2))  # (B, N, 3)
    return colour_class(sums, p * p, bits)


def pixels_4x4_target(images_u8: torch.Tensor, p: int, bits: int = 3) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, N, 16) class of each pixel of the patch average-pooled to 4x4."""
    if p % 4:
        raise ValueError(f"pixels_4x4 needs a patch size divisible by 4, got {p}")
    q = p // 4
    x = patchify(images_u8.to(torch.int32), p)  # (B, N, 3, P, P)
    b, n = x.shape[:2]
    sums = x.reshape(b, n, 3, 4, q, 4, q).sum(dim=(-1, -3))  # (B, N, 3, 4, 4)
    sums = sums.permute(0, 1, 3, 4, 2).reshape(b, n, 16, 3)  # (B, N, 16, 3)
    return colour_class(sums, q * q, bits)


def l2_target(images_normalized: torch.Tensor, p: int) -> torch.Tensor:
    """(B, 3, H, W) normalised float -> (B, N, P*P*3), each patch flattened as (row, column, channel)."""
    x = patchify(images_normalized, p)  # (B, N, 3, P, P)
    return x.permute(0, 1, 3, 4, 2).flatten(2)


def norm_pix_target(images01: torch.Tensor, p: int, eps: float = 1e-6) -> torch.Tensor:
    """(B, 3, H, W) pixels in [0, 1] -> (B, N, P*P*3): each patch (as `l2_target` lays it out) minus its mean, over
    sqrt(its variance + eps), over its P*P*3 values (MAE's norm_pix_loss). The variance is the unbiased one, as in
    MAE's code. Computed from the un-normalised pixels, so the dataset's mean/std do not change it."""
    x = l2_target(images01.float(), p)  # (B, N, P*P*3)
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True)
    return (x - mean) / (var + eps).sqrt()


def target_dim(kind: str, p: int, bits: int = 3) -> int:
    """Output width of the prediction head for a target."""
    classes = 2 ** (3 * bits)
    return {"mean_color": classes, "pixels_4x4": 16 * classes, "l2": p * p * 3}[kind]
