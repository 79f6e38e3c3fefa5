"""Checkpoint I/O: full training states (resumable) and the weights-only encoder export handed to fine-tuning.

Layout of a run directory:

    run_dir/config.yaml                      resolved config of the run
    run_dir/metrics.jsonl                    one JSON object per logged step / evaluation
    run_dir/checkpoints/step_000500/         accelerate state (model, optimizer, scaler, RNG) + trainer_state.json
    run_dir/export/encoder.safetensors       unwrapped timm encoder weights (timm key names, no head)
    run_dir/export/encoder.json              the ModelConfig to rebuild it, plus normalisation and provenance
    run_dir/export/model.safetensors/.json   (fine-tuning) the whole classifier, head included, and class names
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from common.errors import UserError

TRAINER_STATE = "trainer_state.json"  # written last: a checkpoint without it is incomplete and ignored


class CheckpointError(UserError):
    """A checkpoint or export is missing or does not fit; one-line message."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / TRAINER_STATE).is_file())
    return done[-1] if done else None


def save_checkpoint(accelerator: Accelerator, run_dir: str | Path, step: int, trainer_state: dict[str, Any],
                    keep_last: int) -> Path:
    """Save the full training state at `step` (all processes call this), then keep only the newest `keep_last`."""
    path = checkpoints_dir(run_dir) / f"step_{step:06d}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        tmp = path / (TRAINER_STATE + ".tmp")
        tmp.write_text(json.dumps({"step": step, **trainer_state}, indent=1))
        os.replace(tmp, path / TRAINER_STATE)
        complete = sorted(p for p in checkpoints_dir(run_dir).glob("step_*") if (p / TRAINER_STATE).is_file())
        for old in complete[: max(0, len(complete) - keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict[str, Any]:
    """Restore the full training state from `path`; returns its trainer state (with `step`)."""
    accelerator.load_state(str(path))
    return json.loads((path / TRAINER_STATE).read_text())


def export_encoder(state: dict[str, torch.Tensor], model_config: dict[str, Any], out_dir: str | Path,
                   extra: dict[str, Any] | None = None, name: str = "encoder", keep_head: bool = False,
                   prefix: str = "") -> Path:
    """Write `<name>.safetensors` and `<name>.json` (the config needed to rebuild the model).

    `state` is a full state dict (from `accelerator.get_state_dict`, which also gathers FSDP shards); only keys under
    `prefix` are kept, with the prefix removed, so the file has timm's key names. The classifier head is kept only
    with `keep_head`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k[len(prefix):]: v.detach().cpu().contiguous() for k, v in state.items() if k.startswith(prefix)}
    weights = {k: v for k, v in weights.items() if keep_head or not k.startswith("head.")}
    if not weights:  # never hand the next stage an empty file
        raise CheckpointError(f"no weights under '{prefix}' to export (the state dict has e.g. {list(state)[:3]})")
    path = out_dir / f"{name}.safetensors"
    save_file(weights, str(path))
    (out_dir / f"{name}.json").write_text(json.dumps({"model": model_config, **(extra or {})}, indent=1))
    return path
