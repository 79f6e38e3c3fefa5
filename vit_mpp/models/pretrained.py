"""From any checkpoint a user brings to a timm ViT at any input size: the one route fine-tuning, predict and
analysis all take (`read_pretrained`, then `build_model`; `load_classifier` for a fine-tuned export). The formats
(`kind`: `export`, `hub`, `timm`, `npz`, or `auto` from the name), how each is read, and the resize of the position
embeddings: docs/finetune.md#what-it-starts-from-init.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer, _load_weights

from vit_mpp.config.sections import ModelConfig
from vit_mpp.errors import UserError
from vit_mpp.models.export import (
    ExportError,
    check_export_weights,
    read_export,
    read_export_config,
    safetensors_problem,
)
from vit_mpp.models.export_folder import is_export
from vit_mpp.models.vit import create_vit, norm_stats, patch_size

TORCH_SUFFIXES = (".pth", ".pt", ".bin")
NPZ_PREFIXES = ("", "opt/target/", "params/")  # where the original checkpoints keep their parameters
NPZ_POSEMB = "Transformer/posembed_input/pos_embedding"
# a classifier's (its attention pool too) or pretraining's own: not encoder weights
HEAD_PREFIXES = ("head.", "fc_norm.", "attn_pool.", "mask_token")
HUB, LOCAL_DIR = "hf-hub:", "local-dir:"


class CheckpointError(UserError):
    """A checkpoint is missing, unreadable or does not fit: a run's saved state (vit_mpp/run/durability/checkpoint.py),
    or the weights a user brings (init.checkpoint, --checkpoint); one-line message. Exports have their own ExportError
    (vit_mpp/models/export.py)."""


@dataclasses.dataclass
class Pretrained:
    """Weights read from a checkpoint, and what the checkpoint says about the model they belong to."""

    state: dict[str, torch.Tensor]  # timm key names; heads included when the checkpoint has them
    grid: tuple[int, int]  # the patch grid of its position embeddings
    model: ModelConfig | None  # the architecture it names (exports, hub); None: the caller's config names it
    mean: tuple[float, ...] | None  # the normalisation it was trained with, when it says
    std: tuple[float, ...] | None
    crop_pct: float | None = None
    class_names: list[str] | None = None
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # an export's provenance

    @property
    def num_classes(self) -> int:
        """Classes of the head in the weights (0: none)."""
        head = self.state.get("head.weight")
        return int(head.shape[0]) if head is not None and head.dim() == 2 else 0


def checkpoint_kind(checkpoint: str) -> str:
    """`export`, `hub`, `npz` or `timm`, from the name alone (what `kind=auto` resolves to)."""
    if checkpoint.startswith(HUB):
        return "hub"
    if checkpoint.startswith(LOCAL_DIR):
        return "export"
    path = Path(checkpoint)
    if path.exists():
        if is_export(path):
            return "export"
        if path.is_dir():
            raise CheckpointError(f"{path} is a folder without an export (config.json + model.safetensors, or "
                                  "encoder/model.safetensors + .json)")
        return "npz" if path.suffix == ".npz" else "timm"
    if _is_timm_pretrained(checkpoint):
        return "hub"
    raise CheckpointError(f"checkpoint not found: {checkpoint}")


def _is_timm_pretrained(name: str) -> bool:
    import timm

    return "/" not in name and os.sep not in name and bool(timm.list_pretrained(name))


def read_pretrained(checkpoint: str, model_cfg: ModelConfig, kind: str = "auto",
                    grid: list[int] | None = None) -> Pretrained:
    """Read `checkpoint` (see the module doc). `model_cfg` names the architecture of `timm`/`npz` checkpoints."""
    detected = checkpoint_kind(checkpoint)  # also fails clearly when the checkpoint does not exist
    kind = detected if kind == "auto" else kind
    if kind == "export":
        path = checkpoint[len(LOCAL_DIR):] if checkpoint.startswith(LOCAL_DIR) else checkpoint
        return _from_export(path)
    if kind == "hub":
        return _read_hub(checkpoint)
    if kind == "npz":
        state, npz_grid = read_npz(checkpoint, model_cfg, grid)
        return Pretrained(state, npz_grid, None, None, None)
    if kind == "timm":
        state = read_state_dict(checkpoint)
        with torch.device("meta"):
            probe = create_vit(model_cfg)
        return Pretrained(state, state_dict_grid(state, probe, grid), None, None, None)
    raise CheckpointError(f"unknown checkpoint kind {kind!r} (auto, export, hub, timm or npz)")


def describe_checkpoint(checkpoint: str, kind: str = "auto") -> tuple[ModelConfig | None, dict[str, Any]]:
    """(the architecture `checkpoint` names, its provenance record) without reading its weights: for checks before a
    run writes anything, and for the records an export carries on. An export gives its config and its record; a
    Hub repo its config.json (from the cache, or downloaded); a timm pretrained name its architecture and
    {"source": name}; a timm state dict or an .npz names nothing: (None, {})."""
    kind = checkpoint_kind(checkpoint) if kind == "auto" else kind
    try:
        if kind == "export":
            return read_export_config(checkpoint.removeprefix(LOCAL_DIR))
        if kind == "hub" and checkpoint.startswith(HUB):
            from huggingface_hub import hf_hub_download

            repo, _, revision = checkpoint[len(HUB):].partition("@")
            return read_export_config(Path(hf_hub_download(repo, "config.json", revision=revision or None)).parent)
    except (CheckpointError, ExportError):
        raise
    except Exception as e:  # offline and not cached, no such repo, a network error: many types
        raise _unreachable(checkpoint, e) from None
    if kind == "hub":  # a timm pretrained name: architecture.tag
        return ModelConfig(name=checkpoint.split(".")[0]), {"source": checkpoint}
    return None, {}


def look_at_weights_file(checkpoint: str, kind: str = "auto") -> None:
    """A look at the weights of `checkpoint` before a run writes anything, so that a wrong or damaged file is one line
    then, without reading the tensors where the format allows it: the header of an export's or a safetensors file
    (checked against the file's size), the two arrays of an .npz that give its layout, a format this reads. A torch
    file is loaded with its tensors mapped, not read (a legacy, non-zip one is read whole, once more later), which
    also refuses a pickled object now."""
    kind = checkpoint_kind(checkpoint) if kind == "auto" else kind
    if kind == "export":
        check_export_weights(checkpoint.removeprefix(LOCAL_DIR))
    if kind not in ("timm", "npz"):
        return
    path = Path(checkpoint)
    if path.suffix == ".npz":
        _npz_layout(path)
    elif path.suffix == ".safetensors":
        problem = safetensors_problem(path)
        if problem:
            raise CheckpointError(problem)
    else:
        read_state_dict(path)


def _unknown_format(path: Path) -> CheckpointError:
    return CheckpointError(f"unknown checkpoint format {path.suffix!r} for {path} "
                           f"(.safetensors, {', '.join(TORCH_SUFFIXES)}, .npz or an export folder)")


def results_folder(checkpoint: str, suffix: str) -> Path:
    """Where a tool writes what it finds out about `checkpoint` (evaluation, analysis figures) unless told: never into
    an export, whose folder is the model as trained and uploaded.

    `PATH-<suffix>` beside the export folder PATH (or the folder of its weights file), outside any export that holds
    it (`run/export/best` -> `run/export-best-<suffix>`); `FILE-<suffix>` beside a weights file that is no export
    (`vit.npz` -> `vit-<suffix>`); for a Hub or timm name, `NAME-<suffix>` in the current directory."""
    path = Path(checkpoint.removeprefix(LOCAL_DIR))
    if not path.exists():
        return Path(re.sub(r"[^\w.-]+", "_", checkpoint) + f"-{suffix}")
    if path.is_dir() or is_export(path):
        export = path if path.is_dir() else path.parent
        folder, name = export.absolute().parent, export.absolute().name
    else:
        folder, name = path.absolute().parent, path.stem
    while folder.parent != folder and is_export(folder):
        folder, name = folder.parent, f"{folder.name}-{name}"
    return folder / f"{name}-{suffix}"


def hub_model_id(checkpoint: str) -> str | None:
    """The Hugging Face Hub repo a checkpoint comes from (`hf-hub:OWNER/NAME` -> OWNER/NAME; a timm pretrained name
    -> timm's repo for it), for a model card's `base_model`; None for a local checkpoint."""
    if checkpoint.startswith(HUB):
        return checkpoint[len(HUB):].partition("@")[0]
    if Path(checkpoint).exists() or checkpoint.startswith(LOCAL_DIR) or not _is_timm_pretrained(checkpoint):
        return None
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(checkpoint)
    return getattr(cfg, "hf_hub_id", None) or None


def _from_export(path: str | Path) -> Pretrained:
    ex = read_export(path)
    return Pretrained(ex.state, ex.grid, ex.model, ex.mean, ex.std, ex.crop_pct, ex.class_names, ex.record)


def _read_hub(name: str) -> Pretrained:
    """A Hub repo (`hf-hub:OWNER/NAME[@REV]`) or a timm pretrained name, from the cache or the network."""
    try:
        if name.startswith(HUB):
            from huggingface_hub import hf_hub_download

            repo, _, revision = name[len(HUB):].partition("@")
            config = hf_hub_download(repo, "config.json", revision=revision or None)
            hf_hub_download(repo, "model.safetensors", revision=revision or None)
            return _from_export(Path(config).parent)
        import timm

        model = timm.create_model(name, pretrained=True)
    except (CheckpointError, ExportError):
        raise
    except Exception as e:  # offline and not cached, no such repo, a network error: many types
        raise _unreachable(name, e) from None
    if not isinstance(model, VisionTransformer):
        raise CheckpointError(f"{name} is a {type(model).__name__}, not a timm VisionTransformer")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    size = list(model.patch_embed.img_size)
    cfg = ModelConfig(name=model.pretrained_cfg.get("architecture", name.split(".")[0]), img_size=size)
    mean, std = norm_stats(model)
    return Pretrained(state, tuple(model.patch_embed.grid_size), cfg, mean, std,
                      model.pretrained_cfg.get("crop_pct"), None, {"source": name})


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


def _npz_layout(path: str | Path) -> tuple[tuple[int, int], int]:
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
    kernel_hw, num_tokens = _npz_layout(path)
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


def resize_pos_embed(posemb: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int],
                     num_prefix_tokens: int = 1, mode: Literal["bilinear", "bicubic"] = "bilinear") -> torch.Tensor:
    """Resize (1, prefix + gh*gw, D) position embeddings to a new grid, keeping the prefix ([class]) rows as they are.

    `bilinear` matches the original ViT code (align_corners=True, i.e. scipy.ndimage.zoom(order=1));
    `bicubic` matches timm and MAE (align_corners=False, antialiased).
    """
    if tuple(old_grid) == tuple(new_grid):
        return posemb
    if mode == "bilinear":
        return resample_abs_pos_embed(posemb, list(new_grid), list(old_grid), num_prefix_tokens=num_prefix_tokens,
                                      interpolation="bilinear", antialias=False, align_corners=True)
    if mode == "bicubic":
        return resample_abs_pos_embed(posemb, list(new_grid), list(old_grid), num_prefix_tokens=num_prefix_tokens,
                                      interpolation="bicubic", antialias=True)
    raise ValueError(f"unknown position-embedding interpolation {mode!r} (bilinear or bicubic)")


def load_weights(model: VisionTransformer, state: dict[str, torch.Tensor], old_grid: tuple[int, int],
                 mode: Literal["bilinear", "bicubic"] = "bilinear", keep_head: bool = False) -> None:
    """Load `state` into `model` (any input size): position embeddings resized from `old_grid`; the head (and
    pretraining's [mask]) dropped, or with `keep_head` loaded too. Raises CheckpointError when it does not fit."""
    skip = ("mask_token", "fc_norm.") if keep_head else HEAD_PREFIXES
    state = {k: v for k, v in state.items() if not k.startswith(skip)}
    if "patch_embed.proj.weight" in state:
        ckpt_patch = tuple(state["patch_embed.proj.weight"].shape[-2:])
        if ckpt_patch != tuple(model.patch_embed.patch_size):
            raise CheckpointError(f"checkpoint patch size {ckpt_patch} differs from the model's "
                                  f"{tuple(model.patch_embed.patch_size)}; patch size cannot change in fine-tuning")
    if "pos_embed" in state:
        prefix = 0 if model.no_embed_class else model.num_prefix_tokens
        state["pos_embed"] = resize_pos_embed(state["pos_embed"], old_grid, tuple(model.patch_embed.grid_size),
                                              prefix, mode)
    own = model.state_dict()
    expected = {k for k in own if not k.startswith(skip)}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not fit the model: missing keys {missing[:8]}"
                              f"{'...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
                              f"{'...' if len(unexpected) > 8 else ''}")
    mismatched = [k for k, v in state.items() if v.shape != own[k].shape]
    if mismatched:
        raise CheckpointError(f"checkpoint shapes differ from the model's for: {', '.join(mismatched[:8])}")
    # Not strict: what was skipped (a new head, fc_norm) keeps its initialisation; every other key was checked above.
    model.load_state_dict(state, strict=False)


def build_model(cfg: ModelConfig, pre: Pretrained, num_classes: int = 0, keep_head: bool = False,
                interp: Literal["bilinear", "bicubic"] = "bilinear") -> VisionTransformer:
    """A timm ViT of `cfg` (its `img_size` may differ from the checkpoint's) holding the weights of `pre`.

    With `keep_head` the checkpoint's classifier is loaded too (`num_classes` must be its size); without, the head
    is the model's own new one.
    """
    model = create_vit(cfg, num_classes)
    load_weights(model, pre.state, pre.grid, interp, keep_head=keep_head)
    return model


def load_model(checkpoint: str, given: ModelConfig | None = None, img_size: int | list[int] | None = None,
               ) -> tuple[VisionTransformer, tuple[float, ...], tuple[float, ...], Pretrained]:
    """(the checkpoint's model in eval mode, a classifier head kept, its mean and std, what was read): the
    normalisation the checkpoint says it was trained with, else its architecture's. `given` names the architecture of
    a checkpoint that names none (a timm state dict, an .npz); `img_size` resizes the position embeddings with the
    fine-tuning rule."""
    given = given or ModelConfig()
    pre = read_pretrained(checkpoint, given)
    cfg = pre.model or given
    if img_size is not None:
        cfg = dataclasses.replace(cfg, img_size=img_size)
    model = build_model(cfg, pre, pre.num_classes, keep_head=bool(pre.num_classes)).eval()
    default_mean, default_std = norm_stats(model)
    return model, tuple(pre.mean or default_mean), tuple(pre.std or default_std), pre


def load_classifier(checkpoint: str | Path) -> tuple[torch.nn.Module, Pretrained]:
    """The fine-tuned classifier of an export (folder, weights file, local-dir: or hf-hub:) in eval mode, and what
    the export says about it (normalisation, crop, class names, provenance)."""
    pre = read_pretrained(str(checkpoint), ModelConfig())
    if pre.model is None or not pre.num_classes:
        raise CheckpointError(f"{checkpoint} is not a fine-tuned classifier export (it has no classifier head or "
                              "names no architecture): use a finetune export")
    return build_model(pre.model, pre, pre.num_classes, keep_head=True).eval(), pre


def _unreachable(what: str, e: Exception) -> CheckpointError:
    """The one line for a Hub checkpoint that could not be fetched, with the library's reason, whitespace folded."""
    reason = " ".join(str(e).split())[:300] or type(e).__name__
    return CheckpointError(f"cannot get {what} (not in the local cache and the Hugging Face Hub not reachable, "
                           f"or no such model): {type(e).__name__}: {reason}")
