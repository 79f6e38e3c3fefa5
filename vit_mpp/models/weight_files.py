"""Reading a weights file of each format a user brings: a timm state dict (`.safetensors`, a weights-only torch
`.pth`/`.pt`/`.bin`, unwrapped and checked) and an original ViT `.npz` (big_vision's, converted by timm), and the
patch grid its position embeddings hold. Nothing is unpickled. `CheckpointError` is the one line for a checkpoint
that is missing, unreadable or does not fit (vit_mpp/models/pretrained.py routes every kind of checkpoint here)."""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer, _load_weights

from vit_mpp.config.sections import ModelConfig
from vit_mpp.errors import UserError
from vit_mpp.models.vit import create_vit, patch_size

TORCH_SUFFIXES = (".pth", ".pt", ".bin")
NPZ_PREFIXES = ("", "opt/target/", "params/")  # where the original checkpoints keep their parameters
NPZ_POSEMB = "Transformer/posembed_input/pos_embedding"


class CheckpointError(UserError):
    """A checkpoint is missing, unreadable or does not fit: a run's saved state (vit_mpp/run/durability/checkpoint.py),
    or the weights a user brings (init.checkpoint, --checkpoint); one-line message. Exports have their own ExportError
    (vit_mpp/models/export.py)."""


def _unknown_format(path: Path) -> CheckpointError:
    return CheckpointError(f"unknown checkpoint format {path.suffix!r} for {path} "
                           f"(.safetensors, {', '.join(TORCH_SUFFIXES)}, .npz or an export folder)")


def _torch_load(path: Path) -> Any:
    """A weights-only torch file, its tensors mapped from the file rather than read (the zip format of every
    `torch.save` since 1.6: the look before the run costs milliseconds, not a read of the whole file); a legacy
    file, or one where mapping fails, is read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError):  # a legacy file, a file system without mmap (some FUSE mounts), or damage,
        return torch.load(path, map_location="cpu", weights_only=True)  # which the plain read then reports


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A timm-format state dict from .safetensors or a weights-only torch file, unwrapped and checked."""
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path} as safetensors: {' '.join(str(e).split())}") from None
    if path.suffix not in TORCH_SUFFIXES:
        raise _unknown_format(path)
    try:
        obj = _torch_load(path)
    except pickle.UnpicklingError as e:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if refused:  # a pickled object: reading it would run code
            raise CheckpointError(f"{path} holds more than weights and was refused (only tensors and plain "
                                  f"containers are read, nothing is unpickled): it holds {refused.group(1)}") from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", str(e), re.S)
        raise CheckpointError(f"cannot read {path} as a torch checkpoint: "
                              f"{' '.join((detail.group(1) if detail else type(e).__name__).split())}") from None
    except Exception as e:  # torch raises many types for a file that is not a checkpoint (empty, truncated, text)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {path} as a torch checkpoint: {reason}") from None
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
    side = math.isqrt(max(0, num_positions))
    if side * side != num_positions or side == 0:
        raise CheckpointError(f"the checkpoint's {num_positions} positions are not a square grid: "
                              f"set init.grid=[rows,cols]")
    return side, side


def state_dict_grid(state: dict[str, torch.Tensor], model: VisionTransformer,
                    given: list[int] | None) -> tuple[int, int]:
    """The patch grid of a timm state dict, for a model of the same architecture."""
    posemb = state.get("pos_embed")
    if posemb is None or posemb.dim() != 3:
        raise CheckpointError("the checkpoint has no 'pos_embed' of shape (1, tokens, D): not a ViT with learned "
                              "position embeddings")
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    return infer_grid(int(posemb.shape[1]) - prefix, given)


def _open_npz(path: str | Path) -> np.lib.npyio.NpzFile:
    """An .npz archive of named arrays, opened (its zip directory read); CheckpointError for anything else."""
    try:
        npz = np.load(path, allow_pickle=False)  # allow_pickle=False: arrays only, nothing is unpickled
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise _unreadable_npz(path, e) from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise CheckpointError(f"{path} holds a single array, not an .npz archive of named arrays")
    return npz


def npz_layout(path: str | Path) -> tuple[tuple[int, int], int]:
    """(patch kernel height and width, number of position embeddings) of an original ViT .npz, read from its two
    arrays that say so; CheckpointError for an archive that is not one, or damaged, or holding Python objects."""
    npz = _open_npz(path)
    try:
        with npz:
            files = set(npz.files)
            prefix = next((p for p in NPZ_PREFIXES if f"{p}embedding/kernel" in files), None)
            if prefix is None or f"{prefix}{NPZ_POSEMB}" not in files:
                raise CheckpointError(f"{path} is not an original ViT checkpoint (no embedding/kernel and "
                                      f"{NPZ_POSEMB})")
            kernel_hw = tuple(npz[f"{prefix}embedding/kernel"].shape[:2])  # HWIO
            return kernel_hw, int(npz[f"{prefix}{NPZ_POSEMB}"].shape[1])
    except ValueError as e:  # an array of Python objects: refused, since reading it would unpickle
        raise CheckpointError(f"{path}: cannot read its arrays without unpickling objects (refused): "
                              f"{' '.join(str(e).split())}") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # an archive damaged inside
        raise _unreadable_npz(path, e) from None


def _unreadable_npz(path: str | Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"cannot read {path} as an .npz archive: {' '.join(str(e).split()) or type(e).__name__}")


def read_npz(path: str | Path, model_cfg: ModelConfig, given: list[int] | None,
             ) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """An original ViT .npz as a timm state dict at the checkpoint's own grid, and that grid.

    timm's converter (`_load_weights`) does the key mapping; the model it fills is built at the checkpoint's grid
    so that it resizes nothing itself: the resize to the size asked is ours (`build_model`).
    """
    kernel_hw, num_tokens = npz_layout(path)
    probe = create_vit(model_cfg)
    p = patch_size(probe)
    if kernel_hw != (p, p):
        raise CheckpointError(f"checkpoint patch size {kernel_hw} differs from the model's {(p, p)}; "
                              f"patch size cannot change in fine-tuning")
    grid = infer_grid(num_tokens - probe.num_prefix_tokens, given)
    src_cfg = dataclasses.replace(model_cfg, img_size=[grid[0] * p, grid[1] * p], drop_path_rate=0.0)
    src = create_vit(src_cfg)
    try:
        _load_weights(src, str(path))
    except KeyError as e:
        raise CheckpointError(f"{path} does not fit model {model_cfg.name}: missing array {e}") from None
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path} does not fit model {model_cfg.name}: {str(e).splitlines()[0]}") from None
    return {k: v.detach().clone() for k, v in src.state_dict().items() if not k.startswith("head.")}, grid
