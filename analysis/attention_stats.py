"""The numbers behind the ViT paper's analysis figures (section 4.5, figures 6 and 7), computed from a timm ViT:
`attention_probs`, `attention_rollout`, `mean_attention_distance`, `position_similarity`, `patch_embedding_pcs`,
and `param_table`. See docs/analysis.md#how-each-figure-is-computed.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer


def num_pos_prefix(model: VisionTransformer) -> int:
    """Rows of `pos_embed` that belong to prefix tokens ([class], registers) rather than to patches."""
    return 0 if model.no_embed_class else model.num_prefix_tokens


@torch.no_grad()
def attention_probs(model: VisionTransformer, images: torch.Tensor) -> list[torch.Tensor]:
    """Attention probabilities of every block for normalised `images` (B, 3, H, W): L tensors (B, heads, T, T),
    T = prefix tokens + patches; row q is the distribution over keys that query token q attends to."""
    probs: list[torch.Tensor] = []

    def hook(attn: torch.nn.Module, args: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
        x = args[0]  # (B, T, D), the block's norm1 output
        b, t, _ = x.shape
        qkv = attn.qkv(x).reshape(b, t, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])  # (B, heads, T, head_dim)
        probs.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1).float())  # (B, heads, T, T)

    handles = [blk.attn.register_forward_hook(hook) for blk in model.blocks]
    try:
        model.forward_features(images)
    finally:
        for h in handles:
            h.remove()
    return probs


def attention_rollout(probs: list[torch.Tensor]) -> torch.Tensor:
    """Attention rollout: average the heads, add the identity for the residual path, renormalise the rows and
    multiply through the layers. Returns (B, T, T): row q says how much output token q draws on each input token."""
    rollout = None
    for p in probs:
        a = p.mean(dim=1)  # (B, T, T)
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout  # later layers act on what earlier layers produced
    return rollout


def class_token_maps(probs: list[torch.Tensor], prefix: int, grid: tuple[int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rollout map (B, gh, gw), per-layer maps (B, L, gh, gw)): what the [class] token (token 0) draws from each
    patch, through all layers by rollout, and in each layer by its head-averaged attention."""
    b = probs[0].shape[0]
    rollout = attention_rollout(probs)[:, 0, prefix:].reshape(b, *grid)  # (B, gh, gw)
    layers = torch.stack([p.mean(dim=1)[:, 0, prefix:] for p in probs], dim=1)  # (B, L, N)
    return rollout, layers.reshape(b, len(probs), *grid)


def patch_distances(grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """(N, N) Euclidean distance in pixels between the centres of every pair of patches (row-major order)."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1).float() * patch_size  # (N, 2)
    return torch.cdist(centres, centres)


def mean_attention_distance(probs: list[torch.Tensor], prefix: int, grid: tuple[int, int],
                            patch_size: int) -> torch.Tensor:
    """(L, heads) mean attention distance in pixels. For each patch query, the attention weights over the patch keys
    (the prefix tokens have no position: their weight is dropped and the rest renormalised) times the distance
    between patch centres, summed over keys; then averaged over queries and images."""
    dist = patch_distances(grid, patch_size).to(probs[0].device)  # (N, N)
    out = []
    for p in probs:
        w = p[:, :, prefix:, prefix:]  # (B, heads, N, N), patch queries -> patch keys
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        out.append((w * dist).sum(dim=-1).mean(dim=(0, 2)))  # (heads,)
    return torch.stack(out)  # (L, heads)


def position_similarity(pos_embed: torch.Tensor, prefix: int) -> torch.Tensor:
    """(N, N) cosine similarity between the position embeddings of every pair of patches; `pos_embed` is
    (1, prefix + N, D) as stored in timm."""
    e = torch.nn.functional.normalize(pos_embed[0, prefix:].float(), dim=-1)  # (N, D)
    return e @ e.T


def patch_embedding_pcs(weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal components of the D patch-embedding filters `weight` (D, C, P, P), each seen as one C*P*P vector.
    Returns (components (k', C, P, P), explained variance ratio (k',)), k' = min(k, D, C*P*P)."""
    d = weight.shape[0]
    flat = weight.reshape(d, -1).float()  # (D, C*P*P)
    flat = flat - flat.mean(dim=0, keepdim=True)
    _, s, vh = torch.linalg.svd(flat, full_matrices=False)  # vh: (min(D, CPP), C*P*P)
    k = min(k, vh.shape[0])
    var = s**2
    return vh[:k].reshape(k, *weight.shape[1:]), var[:k] / var.sum()


def _group(name: str) -> str:
    """The table row a parameter belongs to: `blocks.3.attn.qkv.weight` -> `blocks.3`, `patch_embed.proj.weight`
    -> `patch_embed`, `cls_token` -> `cls_token`."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else parts[0]


def param_table(model: torch.nn.Module) -> list[dict[str, Any]]:
    """One row per top-level module (each block its own row), in model order, then a `total` row: parameter count
    and weight memory in fp32 and bf16. `train_fp32_adam_bytes` adds the gradient and Adam's two moments
    (16 bytes per parameter); activations are not counted."""
    rows: dict[str, int] = {}
    for name, p in model.named_parameters():
        rows[_group(name)] = rows.get(_group(name), 0) + p.numel()
    total = sum(rows.values())

    def row(module: str, n: int) -> dict[str, Any]:
        return {"module": module, "params": n, "share": n / total if total else 0.0, "fp32_bytes": 4 * n,
                "bf16_bytes": 2 * n, "train_fp32_adam_bytes": 16 * n}

    return [row(m, n) for m, n in rows.items()] + [row("total", total)]
