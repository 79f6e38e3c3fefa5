"""Masked patch prediction (ViT paper, appendix B.1.2): corruption of patch embeddings, prediction head, loss.

The module owns everything the objective adds to the encoder: the learnable [mask] embedding, the corruption
rule, the targets, the optional light decoder and the head. Its forward takes the uint8 batch, so targets come from
raw pixels. Options beyond the paper (block masks, decoder, norm_pix, the hog target): docs/pretrain.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models._manipulate import checkpoint_seq
from timm.models.vision_transformer import Block, VisionTransformer, init_weights_vit_timm
from torch import nn

from pretrain import targets as tg
from pretrain.config import MPPConfig
from vit_mpp.config.engine import ConfigError
from vit_mpp.models.vit import patch_size

MASK, RANDOM, KEEP = 0, 1, 2
# BEiT's blockwise masking: a block covers at least this many patches (BEiT uses 16 on its 14 x 14 grid; ours must
# also suit 4 x 4 grids), or what remains to be covered if less; its aspect ratio is log-uniform in [0.3, 1 / 0.3];
# like BEiT, a block is drawn up to 10 times until it would cover a new patch (else the image gains none this round).
BLOCK_MIN_AREA = 4
BLOCK_ASPECT = 0.3
BLOCK_ATTEMPTS = 10
# Images still short of K after this many rounds take the rest at random among their uncovered patches. It bounds the
# loop; in practice every image of a 4096 batch is done well before (tests/pretrain/test_recipe_options.py).
BLOCK_MAX_ROUNDS = 64


@dataclass(frozen=True)
class Corruption:
    """Which patches are corrupted and how: all (B, K) int64."""

    positions: torch.Tensor  # patch index of each corrupted slot
    kind: torch.Tensor  # MASK, RANDOM or KEEP
    donor: torch.Tensor  # for RANDOM: the other patch whose embedding is copied (never the patch itself)


def num_corrupted(num_patches: int, ratio: float) -> int:
    return int(round(ratio * num_patches))


def _place_rectangles(cover: torch.Tensor, left_to_cover: torch.Tensor, generator: torch.Generator | None,
                      ) -> tuple[torch.Tensor, ...]:
    """One rectangle per image of `cover` (B, gh, gw): (top, height, left, width), each (B, 1, 1) int64, the first of
    BLOCK_ATTEMPTS uniform placements that covers a new patch (the first attempt if none does)."""
    b, gh, gw = cover.shape
    u = torch.rand(4, b, BLOCK_ATTEMPTS, device=cover.device, generator=generator)
    lo = left_to_cover.clamp(max=BLOCK_MIN_AREA).unsqueeze(1)  # (B, 1)
    area = lo + u[0] * (left_to_cover.unsqueeze(1) - lo)
    aspect = torch.exp(math.log(BLOCK_ASPECT) * (1 - 2 * u[1]))
    h = torch.round(torch.sqrt(area * aspect)).clamp(1, gh).long()  # (B, A)
    w = torch.round(torch.sqrt(area / aspect)).clamp(1, gw).long()
    top = torch.minimum((u[2] * (gh - h + 1)).long(), gh - h)
    left = torch.minimum((u[3] * (gw - w + 1)).long(), gw - w)
    # Uncovered patches inside each attempt, from the integral image of the uncovered cells: O(B * A), not O(B*A*N).
    free = (~cover).int().cumsum(1, dtype=torch.int32).cumsum(2, dtype=torch.int32)
    free = F.pad(free, (1, 0, 1, 0)).flatten(1)  # (B, (gh + 1) * (gw + 1))

    def at(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return free.gather(1, r * (gw + 1) + c)

    gain = at(top + h, left + w) - at(top, left + w) - at(top + h, left) + at(top, left)  # (B, A)
    first = (gain > 0).int().argmax(dim=1, keepdim=True)  # argmax returns the first of equal maxima
    return tuple(t.gather(1, first).view(-1, 1, 1) for t in (top, h, left, w))


@torch.compiler.disable  # a loop of data-dependent length and shapes: eager, not one recompilation per round
def block_mask(batch: int, grid: tuple[int, int], k: int, device: torch.device | str = "cpu",
               generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, gh * gw) bool with exactly `k` True per row: BEiT's blockwise masking. Rectangles (area drawn in
    [min(4, remaining), remaining], log-uniform aspect ratio in [0.3, 1 / 0.3], rounded to whole patches and clamped
    to the grid, placed uniformly) are added until at least k patches are covered; the excess is dropped at random
    from the last rectangle's new patches. Each round draws one rectangle for every unfinished image, all at once."""
    gh, gw = grid
    if k >= gh * gw:
        return torch.ones(batch, gh * gw, dtype=torch.bool, device=device)
    rows = torch.arange(gh, device=device).view(1, gh, 1)
    cols = torch.arange(gw, device=device).view(1, 1, gw)
    # Per image: what was covered before its last rectangle, and that rectangle's new cells.
    before = torch.zeros(batch, gh, gw, dtype=torch.bool, device=device)
    last = torch.zeros_like(before)
    # The unfinished images only (finished ones leave the batch, so late rounds are cheap).
    index = torch.arange(batch, device=device)
    cover = torch.zeros_like(before)
    count = torch.zeros(batch, dtype=torch.long, device=device)
    for _ in range(BLOCK_MAX_ROUNDS):
        top, h, left, w = _place_rectangles(cover, (k - count).float(), generator)
        new = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w) & ~cover
        count = count + new.sum(dim=(1, 2))
        finished = count >= k
        out, stay = finished.nonzero().squeeze(1), (~finished).nonzero().squeeze(1)  # a sync per round
        before[index[out]], last[index[out]] = cover[out], new[out]
        index, cover, count = index[stay], (cover | new)[stay], count[stay]
        if not index.numel():
            break
    else:
        before[index], last[index] = cover, ~cover
    before, last = before.flatten(1), last.flatten(1)
    # Keep `need` of the last rectangle's new cells, chosen at random: those of the highest random scores.
    need = k - before.sum(dim=1, keepdim=True)
    score = torch.rand(last.shape, device=device, generator=generator).masked_fill_(~last, -1.0)
    order = score.sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(last.shape[1], device=device).expand_as(order))
    return before | (last & (rank < need))


# Eager under torch.compile: the draws take the run's torch.Generator, which dynamo cannot put in a graph; one break
# around the whole draw instead of one at each of its random calls (tests/pretrain/test_mpp.py).
@torch.compiler.disable
def draw_corruption(batch: int, num_patches: int, cfg: MPPConfig, device: torch.device | str = "cpu",
                    generator: torch.Generator | None = None, grid: tuple[int, int] | None = None) -> Corruption:
    """Draw exactly round(ratio * N) distinct positions per image and a mask/random/keep kind for each. The
    positions are uniform (`mpp.mask_shape=random`) or BEiT's blocks on the patch grid `grid` (`block`)."""
    k = num_corrupted(num_patches, cfg.mask_ratio)
    if cfg.mask_shape == "block":
        if grid is None or grid[0] * grid[1] != num_patches:
            raise ValueError(f"block masks need the patch grid of the {num_patches} patches, got {grid}")
        mask = block_mask(batch, grid, k, device, generator)  # (B, N), k True per row
        positions = mask.nonzero()[:, 1].view(batch, k)  # ascending per image
    else:
        noise = torch.rand(batch, num_patches, device=device, generator=generator)
        positions = noise.topk(k, dim=1).indices  # (B, K), distinct per row
    u = torch.rand(batch, k, device=device, generator=generator)
    # masked_fill_, not `kind[mask] = ...`: boolean indexing may find the mask's True positions first, which on CUDA
    # waits for the device (the step must not, tests/pretrain/test_step_sync.py)
    kind = torch.full_like(positions, KEEP)
    kind.masked_fill_(u < cfg.mask_prob + cfg.random_prob, RANDOM)
    kind.masked_fill_(u < cfg.mask_prob, MASK)
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


def sincos_2d(grid: tuple[int, int], dim: int) -> torch.Tensor:
    """(gh * gw, dim) fixed 2-D sin-cos position embeddings, MAE's: a quarter of the channels each for the sine and
    cosine of the row and of the column, at frequencies 1 / 10000^(i / (dim / 4)); channels past a multiple of 4 are
    zero."""
    gh, gw = grid
    q = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(q, dtype=torch.float64) / max(q, 1))
    r, c = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64), indexing="ij")
    angles = [pos.flatten()[:, None] * omega[None] for pos in (r, c)]
    emb = torch.cat([f(a) for a in angles for f in (torch.sin, torch.cos)], dim=1)  # (N, 4q)
    return F.pad(emb, (0, dim - 4 * q)).float()


def decoder_heads(dim: int) -> int:
    """Heads of a decoder of width `dim`: about 32 channels each, lowered until they divide `dim`."""
    heads = max(1, dim // 32)
    while dim % heads:
        heads -= 1
    return heads


class Decoder(nn.Module):
    """The light decoder (MAE/SimMIM style, `mpp.decoder_depth` > 0): an optional Linear to `mpp.decoder_dim`, fixed
    sin-cos position embeddings, timm `Block`s over every token ([class] included) and a final LayerNorm.

    The position embeddings are fixed, as in MAE's decoder: no parameters, so nothing to decay or to resize, and
    they work on any grid; the encoder's output already carries its learned positions, the decoder only needs a
    stable anchor. Prefix tokens ([class]) get none."""

    def __init__(self, encoder: VisionTransformer, cfg: MPPConfig):
        super().__init__()
        width = cfg.decoder_dim or encoder.embed_dim
        heads = decoder_heads(width) if cfg.decoder_dim else encoder.blocks[0].attn.num_heads
        self.proj = nn.Linear(encoder.embed_dim, width) if cfg.decoder_dim else nn.Identity()
        grid = encoder.patch_embed.grid_size
        pos = torch.cat([torch.zeros(encoder.num_prefix_tokens, width), sincos_2d(grid, width)])  # (T, width)
        self.register_buffer("pos_embed", pos.unsqueeze(0), persistent=False)  # (1, T, width), rebuilt, never saved
        self.blocks = nn.Sequential(*(Block(width, heads, mlp_ratio=4.0, qkv_bias=True)
                                      for _ in range(cfg.decoder_depth)))
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.apply(init_weights_vit_timm)  # timm ViT's own init: truncated normal (0.02) Linear weights, zero biases

    def forward(self, x: torch.Tensor, checkpoint: bool = False) -> torch.Tensor:
        """(B, T, D) encoder output -> (B, T, width)."""
        x = self.proj(x) + self.pos_embed
        x = checkpoint_seq(self.blocks, x) if checkpoint else self.blocks(x)
        return self.norm(x)


def entropy_bits(classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Entropy (bits) of the histogram of `classes` (each in [0, num_classes)); low values flag collapsed targets."""
    flat = classes.flatten()
    # Not torch.bincount: on CUDA it reads the largest class back to the host to size its output, a synchronisation
    # in every step; a histogram of the known size is the same integer counts without one.
    counts = torch.zeros(num_classes, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts.float()
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
        if cfg.target == "hog" and self.patch % 2:
            raise ConfigError(f"mpp.target=hog needs an even patch size (2x2 cells a patch), got {self.patch}")
        if num_corrupted(encoder.patch_embed.num_patches, cfg.mask_ratio) < 1:
            raise ConfigError(f"mpp.mask_ratio={cfg.mask_ratio} corrupts no patch of {encoder.patch_embed.num_patches}")
        self.grid = tuple(encoder.patch_embed.grid_size)
        self.num_classes = 2 ** (3 * cfg.bits)
        self.mask_token = nn.Parameter(torch.zeros(encoder.embed_dim))
        nn.init.normal_(self.mask_token, std=0.02)
        self.decoder = Decoder(encoder, cfg) if cfg.decoder_depth else None
        dim = (cfg.decoder_dim or encoder.embed_dim) if self.decoder is not None else encoder.embed_dim  # head's input
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, tg.target_dim(cfg.target, self.patch, cfg.bits)))
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"mask_token"}

    def forward(self, images: torch.Tensor, valid: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> dict[str, Any]:
        """images: (B, 3, H, W) uint8; valid: optional (B,) bool, padded samples excluded from the loss."""
        b = images.shape[0]
        pixels = images.float() / 255.0  # (B, 3, H, W) in [0, 1]
        x = (pixels - self.mean) / self.std
        tokens = self.encoder.patch_embed(x)  # (B, N, D)
        n = tokens.shape[1]
        c = draw_corruption(b, n, self.cfg, tokens.device, generator, self.grid)
        out = encode(self.encoder, apply_corruption(tokens, c, self.mask_token))  # (B, T, D)
        if self.decoder is not None:  # over every token, so each corrupted position sees the whole image
            out = self.decoder(out, self.encoder.grad_checkpointing and torch.is_grad_enabled())  # (B, T, D')
        out = out[:, self.encoder.num_prefix_tokens:]  # (B, N, D')
        picked = out.gather(1, c.positions.unsqueeze(-1).expand(-1, -1, out.shape[-1]))  # (B, K, D)
        pred = self.head(picked).float()  # (B, K, out)

        weight = torch.ones(c.positions.shape, device=images.device)  # (B, K)
        if valid is not None:
            weight = weight * valid.float().unsqueeze(1)
        denom = weight.sum().clamp(min=1)
        metrics: dict[str, torch.Tensor] = {}
        if self.cfg.target not in tg.CLASS_TARGETS:
            if self.cfg.target == "hog":
                target = tg.hog_target(images, self.patch)
            elif self.cfg.norm_pix:
                target = tg.norm_pix_target(pixels, self.patch)
            else:
                target = tg.l2_target(x, self.patch)
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
