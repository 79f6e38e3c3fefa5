"""The small ViT the unit tests share, exports of it as pretraining writes them, and a Hub cache to hold one."""

from __future__ import annotations

from pathlib import Path

from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.export import Export, write_export

SMALL = dict(patch_size=4, embed_dim=32, depth=1, num_heads=2)  # ModelConfig(img_size=..., **SMALL)
SMALL_MODEL = ModelConfig(img_size=16, **SMALL)  # a 4 x 4 grid of patches


def write_encoder_export(out_dir: Path, encoder, cfg: ModelConfig, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> Path:
    """A pretraining export of `encoder` (a timm ViT without head, built from `cfg`), as pretrain writes it."""
    return write_export(Export(out_dir, encoder.state_dict(), cfg, mean=mean, std=std), kind="encoder")


def hub_cache(root: Path, repo: str) -> Path:
    """A Hugging Face Hub cache holding `repo` at one revision, laid out as huggingface_hub lays it out."""
    folder = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    return folder / "snapshots" / commit
