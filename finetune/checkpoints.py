"""Reading the encoder fine-tuning starts from, in any of the formats users bring.

* `export`: our pretrain (or fine-tune) export, `encoder|model.safetensors` + the `.json` that names its
  architecture and input size.
* `timm`: a state dict with timm's key names, as `.safetensors` or a weights-only `.pth`/`.pt`/`.bin`
  (read with `torch.load(weights_only=True)`: arbitrary pickled objects are refused, never executed); a dict
  that wraps it under "model" or "state_dict" (as training scripts save) is unwrapped.
* `npz`: the original ViT (JAX/Flax) checkpoints, read by timm's own converter at the checkpoint's grid.

For `timm` and `npz` the architecture comes from `model.*` of the config and the checkpoint's patch grid from its
position embeddings (assumed square) or `init.grid`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer, _load_weights

from common.checkpoint import CheckpointError
from common.config import ModelConfig
from common.models import create_encoder, img_hw, patch_size

EXPORT_NAMES = ("encoder", "model")  # pretrain export, fine-tune export
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
NPZ_PREFIXES = ("", "opt/target/", "params/")  # where the original checkpoints keep their parameters
NPZ_POSEMB = "Transformer/posembed_input/pos_embedding"


def export_files(path: str | Path) -> tuple[Path, Path] | None:
    """(weights, json) of an export at `path` (its folder or its .safetensors), or None if it is not one."""
    path = Path(path)
    candidates = [path / f"{n}.safetensors" for n in EXPORT_NAMES] if path.is_dir() else [path]
    for weights in candidates:
        meta = weights.with_suffix(".json")
        if weights.suffix == ".safetensors" and weights.is_file() and meta.is_file():
            return weights, meta
    return None


def checkpoint_kind(path: str | Path) -> str:
    """`export`, `npz` or `timm`, from the path alone (what `init.kind=auto` resolves to)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if export_files(path) is not None:
        return "export"
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder without encoder.safetensors or model.safetensors + .json")
    return "npz" if path.suffix == ".npz" else "timm"


def read_export(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and metadata (`model`: the ModelConfig it was trained with, mean/std, ...) of an export."""
    files = export_files(path)
    if files is None:
        raise CheckpointError(f"not an export (a .safetensors with its .json beside it): {path}")
    meta = json.loads(files[1].read_text())
    if "model" not in meta:
        raise CheckpointError(f"{files[1]} has no 'model' section: not an export of this tool")
    return load_file(str(files[0])), meta


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A timm-format state dict from .safetensors or a weights-only torch file, unwrapped and checked."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_file(str(path))
    if path.suffix not in TORCH_SUFFIXES:
        raise CheckpointError(f"unknown checkpoint format {path.suffix!r} for {path} "
                              f"(.safetensors, {', '.join(TORCH_SUFFIXES)}, .npz or an export folder)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} holds more than weights and was refused (only tensors and plain containers "
                              f"are read, nothing is unpickled): {reason}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read {path} as a torch checkpoint: {str(e).splitlines()[0]}") from None
    for key in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path} holds no state dict (a mapping of names to tensors)")
    odd = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if odd:
        raise CheckpointError(f"{path}: not a state dict, these entries are not tensors: {odd[:8]}")
    # Saved from a DistributedDataParallel or torch.compile wrapper: strip the wrapper's prefix.
    for wrapper in ("module.", "_orig_mod."):
        if all(k.startswith(wrapper) for k in obj):
            obj = {k[len(wrapper):]: v for k, v in obj.items()}
    return obj


def infer_grid(num_positions: int, given: list[int] | None) -> tuple[int, int]:
    """The patch grid of `num_positions` position embeddings (prefix rows excluded): `given`, or the square."""
    if given is not None:
        if len(given) != 2 or given[0] * given[1] != num_positions:
            raise CheckpointError(f"init.grid={list(given)} does not hold the checkpoint's {num_positions} positions")
        return int(given[0]), int(given[1])
    side = math.isqrt(num_positions)
    if side * side != num_positions:
        raise CheckpointError(f"the checkpoint's {num_positions} positions are not a square grid: "
                              f"set init.grid=[rows,cols]")
    return side, side


def state_dict_grid(state: dict[str, torch.Tensor], model: VisionTransformer,
                    given: list[int] | None) -> tuple[int, int]:
    """The patch grid of a timm state dict, for a model of the same architecture."""
    if "pos_embed" not in state:
        raise CheckpointError("the checkpoint has no 'pos_embed': not a ViT with learned position embeddings")
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    return infer_grid(int(state["pos_embed"].shape[1]) - prefix, given)


def read_npz(path: str | Path, model_cfg: ModelConfig, given: list[int] | None,
             ) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """An original ViT .npz as a timm state dict at the checkpoint's own grid, and that grid.

    timm's converter (`_load_weights`) does the key mapping; the model it fills is built at the checkpoint's grid
    so that it resizes nothing itself: the resize to the fine-tuning size is ours (init.posemb_interp).
    """
    try:
        npz = np.load(path, allow_pickle=False)  # allow_pickle=False: arrays only, nothing is unpickled
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} as an .npz archive: {str(e).splitlines()[0]}") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise CheckpointError(f"{path} holds a single array, not an .npz archive of named arrays")
    with npz:
        files = set(npz.files)
        prefix = next((p for p in NPZ_PREFIXES if f"{p}embedding/kernel" in files), None)
        if prefix is None or f"{prefix}{NPZ_POSEMB}" not in files:
            raise CheckpointError(f"{path} is not an original ViT checkpoint (no embedding/kernel and {NPZ_POSEMB})")
        kernel_hw = tuple(npz[f"{prefix}embedding/kernel"].shape[:2])  # HWIO
        num_tokens = int(npz[f"{prefix}{NPZ_POSEMB}"].shape[1])
    probe = create_encoder(model_cfg)
    p = patch_size(probe)
    if kernel_hw != (p, p):
        raise CheckpointError(f"checkpoint patch size {kernel_hw} differs from the model's {(p, p)}; "
                              f"patch size cannot change in fine-tuning")
    grid = infer_grid(num_tokens - probe.num_prefix_tokens, given)
    src_cfg = dataclasses.replace(model_cfg, img_size=[grid[0] * p, grid[1] * p], drop_path_rate=0.0)
    src = create_encoder(src_cfg)
    try:
        _load_weights(src, str(path))
    except KeyError as e:
        raise CheckpointError(f"{path} does not fit model {model_cfg.name}: missing array {e}") from None
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path} does not fit model {model_cfg.name}: {str(e).splitlines()[0]}") from None
    return {k: v.detach().clone() for k, v in src.state_dict().items() if not k.startswith("head.")}, grid


def export_grid(meta: dict[str, Any], state: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The patch grid an export was trained at (from its recorded input size and patch size)."""
    p = int(state["patch_embed.proj.weight"].shape[-1])
    h, w = img_hw(meta["model"]["img_size"])
    return h // p, w // p
