"""Masked-patch-prediction targets, computed exactly in integers from the un-normalised uint8 pixels of a batch:
`mean_color_target` and `pixels_4x4_target` (colour classes at `bits` bits per channel), `l2_target` (normalised
pixels), `norm_pix_target` (each patch normalised by its own statistics), `hog_target` (MaskFeat's histograms of
oriented gradients). The quantisation: docs/method.md#masked-patch-prediction-pretraining; the shapes and the
options beyond the paper: docs/pretrain.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TARGETS = ("mean_color", "pixels_4x4", "l2", "hog")
CLASS_TARGETS = ("mean_color", "pixels_4x4")  # cross-entropy over colour classes; the others are regressed (MSE)
HOG_BINS = 9  # unsigned orientations over 180 degrees, 20 degrees a bin (Dalal & Triggs; MaskFeat)


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


def hog_target(images_u8: torch.Tensor, p: int, bins: int = HOG_BINS) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, N, 3 * bins * 4): MaskFeat's HOG target. Per colour channel, Sobel gradients (the
    image's border reflected); each pixel's gradient magnitude goes to the bin of its unsigned orientation; the
    histograms are summed over each of the patch's 2x2 cells (P/2 pixels square) and each cell's histogram of each
    channel is scaled to unit length (a flat cell stays 0). Laid out per patch as (channel, bin, cell row, cell
    column). The unit length makes it blind to a channel's contrast and offset, so a shape is the same target
    whatever its colours; MaskFeat's Gaussian weighting of each patch's pixels is left out. The gradients are sums of
    integers, exact in float32 in any order: a gradient along an axis has an exact 0 component, so it falls in its
    bin on every device rather than on either side of the boundary there."""
    if p % 2:
        raise ValueError(f"hog needs an even patch size (2x2 cells a patch), got {p}")
    # Sobel as slices of the padded image rather than a convolution: no kernel tensor to copy to the device each
    # step, and elementwise sums stay in float32 under autocast (a bf16 convolution would round them)
    x = F.pad(images_u8.float(), (1, 1, 1, 1), mode="reflect")  # (B, 3, H + 2, W + 2)
    across = x[..., :, :-2] - x[..., :, 2:]  # left minus right
    gx = across[..., :-2, :] + 2 * across[..., 1:-1, :] + across[..., 2:, :]  # (B, 3, H, W)
    down = x[..., :-2, :] - x[..., 2:, :]  # top minus bottom
    gy = down[..., :, :-2] + 2 * down[..., :, 1:-1] + down[..., :, 2:]
    magnitude = torch.hypot(gx, gy)
    # atan2 in (-pi, pi] over pi/bins: the floor mod bins folds opposite directions into one bin
    which = torch.floor(torch.atan2(gy, gx) * (bins / math.pi)).long().remainder_(bins)
    b, c, h, w = magnitude.shape
    cell = p // 2
    # bin by bin, each pooled into its cells at once: a (B, 3, bins, H, W) histogram of every pixel would be 9 times
    # the batch's pixels in float32 (1.4 GB at 256 images of 224 x 224)
    hist = torch.stack([torch.where(which == k, magnitude, 0.0).reshape(b, c, h // cell, cell, w // cell, cell)
                        .sum(dim=(3, 5)) for k in range(bins)], dim=2)  # (B, 3, bins, 2gh, 2gw)
    hist = F.normalize(hist, dim=2)
    gh, gw = h // p, w // p
    hist = hist.reshape(b, c, bins, gh, 2, gw, 2).permute(0, 3, 5, 1, 2, 4, 6)  # (B, gh, gw, 3, bins, 2, 2)
    return hist.reshape(b, gh * gw, c * bins * 4)


def target_dim(kind: str, p: int, bits: int = 3) -> int:
    """Output width of the prediction head for a target."""
    classes = 2 ** (3 * bits)
    return {"mean_color": classes, "pixels_4x4": 16 * classes, "l2": p * p * 3, "hog": 3 * HOG_BINS * 4}[kind]
