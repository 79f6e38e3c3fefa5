"""Drawing the analysis figures (PNG files); the numbers come from attention_stats.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vit_mpp.tools.figures import pyplot, save_figure


def _upsample(grid_map: torch.Tensor, hw: tuple[int, int]) -> np.ndarray:
    """A (gh, gw) patch map stretched to the image size (nearest: each patch keeps one value), scaled to [0, 1]."""
    m = F.interpolate(grid_map[None, None].float(), size=hw, mode="nearest")[0, 0]  # (H, W)
    m = m - m.min()
    return (m / m.max().clamp_min(1e-12)).cpu().numpy()


def plot_attention(image: np.ndarray, rollout: torch.Tensor, layers: torch.Tensor, title: str, path: Path) -> Path:
    """The image, the attention rollout of the [class] token over it, then the [class] token's head-averaged
    attention in each layer. `image` (H, W, 3) uint8; `rollout` (gh, gw); `layers` (L, gh, gw)."""
    n_layers = layers.shape[0]
    cols = min(6, max(3, n_layers))
    rows = 1 + math.ceil(n_layers / cols)
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(2.0 * cols, 2.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    hw = image.shape[:2]
    mask = _upsample(rollout, hw)
    axes[0, 0].imshow(image)
    axes[0, 0].set_title("input", fontsize=9)
    axes[0, 1].imshow(image)
    axes[0, 1].imshow(mask, cmap="inferno", alpha=0.6, vmin=0, vmax=1)
    axes[0, 1].set_title("rollout overlay", fontsize=9)
    # The paper's figure 6 style: the image darkened where the [class] token does not look.
    axes[0, 2].imshow((image * mask[..., None]).astype(np.uint8))
    axes[0, 2].set_title("image x rollout", fontsize=9)
    for i in range(n_layers):
        ax = axes[1 + i // cols, i % cols]
        ax.imshow(layers[i].cpu().numpy(), cmap="inferno", interpolation="nearest")
        ax.set_title(f"layer {i + 1}", fontsize=9)
    fig.suptitle(f"{title}\n[class] token attention to patches: rollout (top), per layer, heads averaged (below)",
                 fontsize=10)
    return save_figure(fig, path)


def plot_position_similarity(sim: torch.Tensor, grid: tuple[int, int], path: Path) -> Path:
    """The paper's figure 7 (center): tile (r, c) shows the cosine similarity between the position embedding of
    patch (r, c) and those of all patches. `sim` (N, N), N = gh * gw."""
    gh, gw = grid
    pad = 1
    mosaic = np.full((gh * (gh + pad) - pad, gw * (gw + pad) - pad), np.nan)
    s = sim.reshape(gh, gw, gh, gw).cpu().numpy()  # (row, col) of the patch -> its (gh, gw) similarity map
    for r in range(gh):
        for c in range(gw):
            mosaic[r * (gh + pad): r * (gh + pad) + gh, c * (gw + pad): c * (gw + pad) + gw] = s[r, c]
    side = min(9.0, max(4.0, 0.45 * max(gh, gw)))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(side * gw / max(gh, gw) + 1.2, side * gh / max(gh, gw)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # NaN marks the gaps between tiles
    im = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xticks([c * (gw + pad) + (gw - 1) / 2 for c in range(gw)], [str(c + 1) for c in range(gw)], fontsize=7)
    ax.set_yticks([r * (gh + pad) + (gh - 1) / 2 for r in range(gh)], [str(r + 1) for r in range(gh)], fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    ax.set_title("Position embedding similarity", fontsize=11)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="cosine similarity")
    return save_figure(fig, path)


def plot_filters(pcs: torch.Tensor, explained: torch.Tensor, path: Path) -> Path:
    """The paper's figure 7 (left): principal components of the patch-embedding filters, each drawn as an RGB patch
    (min-max scaled on its own, since a component's sign and scale are arbitrary). `pcs` (k, 3, P, P)."""
    k = pcs.shape[0]
    cols = min(7, k)
    rows = math.ceil(k / cols)
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.45 * rows + 0.5), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(k):
        x = pcs[i].permute(1, 2, 0).cpu().numpy()  # (P, P, C)
        x = (x - x.min()) / max(float(x.max() - x.min()), 1e-12)
        ax = axes[i // cols, i % cols]
        ax.imshow(x if x.shape[-1] == 3 else x.mean(-1), cmap=None if x.shape[-1] == 3 else "gray",
                  interpolation="nearest")
        ax.set_title(f"{i + 1}: {100 * float(explained[i]):.1f}%", fontsize=7)
    fig.suptitle(f"RGB embedding filters: first {k} principal components (% of variance)", fontsize=10)
    return save_figure(fig, path)


def plot_attention_distance(dist: torch.Tensor, uniform: float, img_hw: tuple[int, int], num_images: int,
                            path: Path) -> Path:
    """The paper's figure 7 (right): mean attention distance of every head against the layer. `dist` (L, heads);
    `uniform` is the distance of a head that attends to all patches equally, drawn as a reference line."""
    n_layers, heads = dist.shape
    d = dist.cpu().numpy()
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    cmap = plt.get_cmap("tab20" if heads > 10 else "tab10")
    for h in range(heads):
        ax.scatter(np.arange(1, n_layers + 1), d[:, h], s=14, color=cmap(h % cmap.N), label=f"head {h + 1}")
    ax.axhline(uniform, color="gray", linestyle="--", linewidth=1, label="uniform attention")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(range(1, n_layers + 1) if n_layers <= 16 else range(1, n_layers + 1, max(1, n_layers // 12)))
    ax.set_xlim(0.5, n_layers + 0.5)
    ax.set_ylim(0, max(float(d.max()), uniform) * 1.1 + 1e-6)
    ax.grid(alpha=0.3)
    ax.set_title(f"Mean attention distance ({img_hw[0]}x{img_hw[1]} input, {num_images} images)", fontsize=10)
    if heads <= 16:  # beyond that a legend is a wall of colours; the points still show the spread
        ax.legend(fontsize=6, ncol=2 if heads > 8 else 1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)
