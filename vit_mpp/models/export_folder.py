"""Which files make an export (vit_mpp/models/export.py writes and reads them): the names, and telling an export folder
from other folders without loading anything. Kept apart from export.py so that tools which only need to recognise
an export (build-shards refusing to write into one, `--out` checks) do not import torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from vit_mpp.config.engine import ConfigError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
LEGACY = (("encoder.safetensors", "encoder.json"), ("model.safetensors", "model.json"))  # before config.json


def is_export(path: str | Path) -> bool:
    """Whether `path` is an export folder (or the weights file of one), in the current or the older format."""
    return export_files(Path(path)) is not None


def export_files(path: Path) -> tuple[Path, Path] | None:
    """(weights, config) of the export at `path`: its folder, or its weights file."""
    if path.is_dir():
        if (path / CONFIG).is_file() and ((path / WEIGHTS).is_file() or (path / (WEIGHTS + ".new")).is_file()):
            return path / WEIGHTS, path / CONFIG
        for weights, meta in LEGACY:
            if (path / weights).is_file() and (path / meta).is_file():
                return path / weights, path / meta
        return None
    if path.suffix == ".safetensors" and path.is_file():
        for meta in (path.with_name(CONFIG), path.with_suffix(".json")):
            if meta.is_file() and (meta.name != CONFIG or path.name == WEIGHTS):
                return path, meta
    return None


WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".npz")  # the weight files a checkpoint may be


def check_checkpoint_path(checkpoint: str) -> None:
    """A checkpoint given as a local path (`local-dir:PATH`, a path with a folder in it, a weights file's name)
    must exist: a ConfigError, one line, otherwise. `hf-hub:` names, URLs and bare names (a timm pretrained name
    such as `vit_base_patch16_224.augreg_in21k`) are not checked here: resolving them needs timm, and torch."""
    if not checkpoint or checkpoint.startswith("hf-hub:") or "://" in checkpoint:
        return
    path = checkpoint.removeprefix("local-dir:")
    looks_local = (path != checkpoint or "/" in path or os.sep in path or path.startswith((".", "~"))
                   or path.endswith(WEIGHT_SUFFIXES))
    if looks_local and not os.path.exists(path):
        raise ConfigError(f"checkpoint not found: {path} (init.checkpoint: an export folder, a weights file, "
                          "hf-hub:OWNER/NAME or a timm pretrained name)")
