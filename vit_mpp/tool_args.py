"""Checks of the command-line values the tools share (predict, evaluate, analysis): `--device` and `--out`, made
before any model is loaded or image read, so that a mistake is one line at the start, not a traceback at the end
of the work."""

from __future__ import annotations

import os
from pathlib import Path

from vit_mpp.config import ConfigError
from vit_mpp.export import is_export
from vit_mpp.manifest import MANIFEST_NAME


def check_device(name: str) -> str:
    """`name` when torch knows it and this machine has it (`cpu`, `cuda`, `cuda:N`, `mps`); a ConfigError otherwise."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {name}: not a device (cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ConfigError(f"--device {name}: this machine has {have} CUDA device(s); use --device cpu"
                          + (f" or cuda:0..cuda:{have - 1}" if have else ""))
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name}: MPS is not available here; use --device cpu")
    return name


def check_out_file(path: str) -> Path:
    """An output file written when the work is done: not a folder, and its folder, or the nearest one of its parents
    that exists (the rest is created when the file is written), a writable folder."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--out {path} is a folder: give a file name")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {path}: {parent} is not writable")
    return out


def check_out_folder(out: Path) -> Path:
    """A folder for a tool's results: new, or an existing folder that is neither an export nor a shard set (results
    never go into the model's own folder, nor among a data set's shards)."""
    if out.exists() and (not out.is_dir() or is_export(out) or (out / MANIFEST_NAME).exists()):
        what = "a file" if not out.is_dir() else "an export" if is_export(out) else f"a shard set ({MANIFEST_NAME})"
        raise ConfigError(f"--out {out} is {what}: give a folder for the results")
    return out
