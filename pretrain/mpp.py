"""Masked patch prediction (ViT paper, appendix B.1.2): corruption of patch embeddings, prediction head, loss.

The module owns everything the objective adds to the encoder: the learnable [mask] embedding, the corruption
rule, the targets and the head. Its forward takes the uint8 batch, so targets come from raw pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models._manipulate import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from pretrain import targets as tg
from pretrain.config import MPPConfig
from vit_mpp.config.engine import ConfigError
from vit_mpp.models.vit import patch_size

MASK, RANDOM, KEEP = 0, 1, 2


@dataclass(frozen=True)
class Corruption:
    """Which patches are corrupted and how: all (B, K) int64."""

    positions: torch.Tensor  # patch index of each corrupted slot
    kind: torch.Tensor  # MASK, RANDOM or KEEP
    donor: torch.Tensor  # for RANDOM: the other patch whose embedding is copied (never the patch itself)


def num_corrupted(num_patches: int, ratio: float) -> int:
    return int(round(ratio * num_patches))


def draw_corruption(batch: int, num_patches: int, cfg: MPPConfig, device: torch.device | str = "cpu",
                    generator: torch.Generator | None = None) -> Corruption:
    """Draw exactly round(ratio * N) distinct positions per image and a mask/random/keep kind for each."""
    k = num_corrupted(num_patches, cfg.mask_ratio)
    noise = torch.rand(batch, num_patches, device=device, generator=generator)
    positions = noise.topk(k, dim=1).indices  # (B, K), distinct per row
    u = torch.rand(batch, k, device=device, generator=generator)
    kind = torch.full_like(positions, KEEP)
    kind[u < cfg.mask_prob + cfg.random_prob] = RANDOM
    kind[u < cfg.mask_prob] = MASK
    # Uniform over the N - 1 other patches: draw from N - 1 values and step over the patch itself.
    donor = torch.randint(0, num_patches - 1, (batch, k), device=device, generator=generator)
    donor = donor + (donor >= positions).long()
    return Corruption(positions, kind, donor)


def apply_corruption(tokens: torch.Tensor, c: Corruption, mask_token: torch.Tensor) -> torch.Tensor:
    """Replace the corrupted patch embeddings: (B, N, D) -> (B, N, D). Donors are taken from the clean tokens."""
    d = tokens.shape[-1]
    idx = c.positions.unsqueeze(-1).expand(-1, -1, d)  # (B, K, D)
    current = tokens.gather(1, idx)
    donors = tokens.gather(1, c.donor.unsqueeze(-1).expand(-1, -1, d))
    kind = c.kind.unsqueeze(-1)
    new = torch.where(kind == MASK, mask_token.to(tokens.dtype).expand_as(current),
                      torch.where(kind == RANDOM, donors, current))
    return tokens.scatter(1, idx, new)


def encode(encoder: VisionTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """The rest of timm's `forward_features` after `patch_embed`: (B, N, D) patch tokens -> (B, T, D)."""
    x = encoder._pos_embed(tokens)  # prepends [class], adds position embeddings
    x = encoder.patch_drop(x)
    x = encoder.norm_pre(x)
    if encoder.grad_checkpointing and torch.is_grad_enabled():
        x = checkpoint_seq(encoder.blocks, x)
    else:
        x = encoder.blocks(x)
    return encoder.norm(x)


def entropy_bits(classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Entropy (bits) of the histogram of `classes`; low values flag collapsed targets."""
    counts = torch.bincount(classes.flatten(), minlength=num_classes).float()
    p = counts / counts.sum().clamp(min=1)
    return -(p * torch.log2(p.clamp(min=1e-12))).sum()


class MaskedPatchPrediction(nn.Module):
    """A timm ViT encoder plus the MPP objective; forward(uint8 images) -> dict with "loss" and metrics."""

    def __init__(self, encoder: VisionTransformer, cfg: MPPConfig, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.encoder, self.cfg = encoder, cfg
        self.patch = patch_size(encoder)
        if cfg.target == "pixels_4x4" and self.patch % 4:
            raise ConfigError(f"mpp.target=pixels_4x4 needs a patch size divisible by 4, got {self.patch}")
        if num_corrupted(encoder.patch_embed.num_patches, cfg.mask_ratio) < 1:
            raise ConfigError(f"mpp.mask_ratio={cfg.mask_ratio} corrupts no patch of {encoder.patch_embed.num_patches}")
        dim = encoder.embed_dim
        self.num_classes = 2 ** (3 * cfg.bits)
        self.mask_token = nn.Parameter(torch.zeros(dim))
        nn.init.normal_(self.mask_token, std=0.02)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, tg.target_dim(cfg.target, self.patch, cfg.bits)))
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"mask_token"}

    def forward(self, images: torch.Tensor, valid: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> dict[str, Any]:
        """images: (B, 3, H, W) uint8; valid: optional (B,) bool, padded samples excluded from the loss."""
        b = images.shape[0]
        x = (images.float() / 255.0 - self.mean) / self.std  # (B, 3, H, W)
        tokens = self.encoder.patch_embed(x)  # (B, N, D)
        n = tokens.shape[1]
        c = draw_corruption(b, n, self.cfg, tokens.device, generator)
        out = encode(self.encoder, apply_corruption(tokens, c, self.mask_token))  # (B, T, D)
        out = out[:, self.encoder.num_prefix_tokens:]  # (B, N, D)
        picked = out.gather(1, c.positions.unsqueeze(-1).expand(-1, -1, out.shape[-1]))  # (B, K, D)
        pred = self.head(picked).float()  # (B, K, out)

        weight = torch.ones(c.positions.shape, device=images.device)  # (B, K)
        if valid is not None:
            weight = weight * valid.float().unsqueeze(1)
        denom = weight.sum().clamp(min=1)
        metrics: dict[str, torch.Tensor] = {}
        if self.cfg.target == "l2":
            target = tg.l2_target(x, self.patch)  # (B, N, P*P*3)
            target = target.gather(1, c.positions.unsqueeze(-1).expand(-1, -1, target.shape[-1]))
            per_slot = F.mse_loss(pred, target, reduction="none").mean(-1)  # (B, K)
            classes = None
        else:
            if self.cfg.target == "mean_color":
                classes = tg.mean_color_target(images, self.patch, self.cfg.bits).gather(1, c.positions)  # (B, K)
                logits = pred  # (B, K, C)
            else:
                full = tg.pixels_4x4_target(images, self.patch, self.cfg.bits)  # (B, N, 16)
                classes = full.gather(1, c.positions.unsqueeze(-1).expand(-1, -1, 16))  # (B, K, 16)
                logits = pred.view(b, -1, 16, self.num_classes)  # (B, K, 16, C)
            ce = F.cross_entropy(logits.flatten(0, -2), classes.flatten(), reduction="none").view(classes.shape)
            correct = (logits.argmax(-1) == classes).float()
            if classes.dim() == 3:  # average the 16 sub-predictions of a patch
                ce, correct = ce.mean(-1), correct.mean(-1)
            per_slot = ce
            metrics["acc"] = ((correct * weight).sum() / denom).detach()
            metrics["target_entropy"] = entropy_bits(classes, self.num_classes).detach()
        loss = (per_slot * weight).sum() / denom
        metrics.update({
            "frac_mask": (c.kind == MASK).float().mean(),
            "frac_random": (c.kind == RANDOM).float().mean(),
            "frac_keep": (c.kind == KEEP).float().mean(),
        })
        return {"loss": loss, "pred": pred, "target": classes, "corruption": c, "weight": denom.detach(),
                "metrics": metrics}
