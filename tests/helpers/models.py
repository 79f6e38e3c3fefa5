"""The small ViT the unit tests share, and exports of it as pretraining writes them."""

from __future__ import annotations

from pathlib import Path

from vit_mpp.config import ModelConfig
from vit_mpp.export import write_export

SMALL = dict(patch_size=4, embed_dim=32, depth=1, num_heads=2)  # ModelConfig(img_size=..., **SMALL)
SMALL_MODEL = ModelConfig(img_size=16, **SMALL)  # a 4 x 4 grid of patches


def write_encoder_export(out_dir: Path, encoder, cfg: ModelConfig, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> Path:
    """A pretraining export of `encoder` (a timm ViT without head, built from `cfg`), as pretrain writes it."""
    return write_export(out_dir, encoder.state_dict(), cfg, kind="encoder", mean=mean, std=std)
