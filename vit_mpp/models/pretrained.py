"""From any checkpoint a user brings to a timm ViT at any input size: the one route fine-tuning, predict and
analysis all take (`read_pretrained`, then `build_model`; `load_classifier` for a fine-tuned export). The formats
(`kind`: `export`, `hub`, `timm`, `npz`, or `auto` from the name), how each is read, and the resize of the position
embeddings: docs/finetune.md#what-it-starts-from-init. Each format's file is read in weight_files.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Literal

import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.export import (
    ExportError,
    check_export_weights,
    read_export,
    read_export_config,
    safetensors_problem,
)
from vit_mpp.models.export_folder import is_export
from vit_mpp.models.vit import create_vit, norm_stats
from vit_mpp.models.weight_files import CheckpointError, npz_layout, read_npz, read_state_dict, state_dict_grid

# a classifier's (its attention pool too) or pretraining's own: not encoder weights
HEAD_PREFIXES = ("head.", "fc_norm.", "attn_pool.", "mask_token")
HUB, LOCAL_DIR = "hf-hub:", "local-dir:"


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
        npz_layout(path)
    elif path.suffix == ".safetensors":
        problem = safetensors_problem(path)
        if problem:
            raise CheckpointError(problem)
    else:
        read_state_dict(path)


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
