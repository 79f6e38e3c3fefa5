"""The hand-off between stages: an export folder holds a model's weights (`model.safetensors`, timm's key names) and
timm's Hugging Face `config.json` with this tool's record under "vit_mpp", so that
`timm.create_model("local-dir:PATH", pretrained=True)` rebuilds the model exactly. `write_export` writes one,
crash-safely; `read_export` reads it (older formats too). See docs/exports.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from vit_mpp import __version__
from vit_mpp.config.engine import ConfigError, from_dict, to_dict
from vit_mpp.config.sections import ModelConfig, img_hw
from vit_mpp.durable import fsync, replace, write_failed
from vit_mpp.errors import UserError
from vit_mpp.models.export_folder import CONFIG, WEIGHTS, export_files
from vit_mpp.models.vit import create_vit

RECORD = "vit_mpp"  # our key in config.json
# Preprocessing recorded for users of the export: evaluation resizes with antialiased bilinear, then centre-crops.
INTERPOLATION = "bilinear"


class ExportError(UserError):
    """An export that cannot be written or read (missing, damaged, not fitting its model); one line."""


@dataclasses.dataclass
class Export:
    """An export: the weights, the model they fit exactly, and how to feed it (what `write_export` writes and
    `read_export` reads back)."""

    path: Path
    state: dict[str, torch.Tensor]  # timm key names; the head only for a classifier
    model: ModelConfig
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int = 0
    crop_pct: float = 0.875
    class_names: list[str] | None = None
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # the vit_mpp record: kind, provenance, metrics
    # ({} for a plain timm folder)

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid its position embeddings were trained at."""
        p = int(self.state["patch_embed.proj.weight"].shape[-1])
        h, w = img_hw(self.model.img_size)
        return h // p, w // p


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state` under `prefix`, with the prefix removed (e.g. the MPP module's `encoder.`)."""
    out = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not out:  # never hand the next stage an empty file
        raise ExportError(f"no weights under '{prefix}' to export (the state dict has e.g. {list(state)[:3]})")
    return out


def write_export(export: Export, kind: str) -> Path:
    """Write `export` to its path as an export of `kind` (encoder, classifier), crash-safely; its record is kept
    beside the kind, the export id and the tool's version.

    The weights must fit the model with `num_classes` exactly (every key, every shape): a ExportError otherwise.
    Returns the export's folder.
    """
    out_dir, state, model_cfg, num_classes = Path(export.path), export.state, export.model, export.num_classes
    with torch.device("meta"):  # the architecture only: its keys, shapes and recorded constructor arguments
        model = create_vit(dataclasses.replace(model_cfg, drop_path_rate=0.0, grad_checkpointing=False),
                               num_classes)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        shapes = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        raise ExportError(f"the weights do not fit the model to export: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}, other shapes {shapes[:5]}")
    weights_new, config_new = out_dir / (WEIGHTS + ".new"), out_dir / (CONFIG + ".new")
    try:
        return _write_files(export, model, kind)
    except OSError as e:  # a full disk: nothing half-written stays, the export there before is left as it was
        for new in (weights_new, config_new):
            new.unlink(missing_ok=True)
        raise write_failed(out_dir, e, sum(v.numel() * v.element_size() for v in state.values())) from None


def _write_files(export: Export, model: torch.nn.Module, kind: str) -> Path:
    """The writing of `write_export`: the weights and config under `.new` names, synced, then renamed into place."""
    out_dir, state, model_cfg = Path(export.path), export.state, export.model
    mean, std, crop_pct, class_names, record = (export.mean, export.std, export.crop_pct, export.class_names,
                                                export.record)
    from timm.models._hub import save_config_for_hf  # timm's writer of the Hugging Face config

    out_dir.mkdir(parents=True, exist_ok=True)
    export_id = uuid.uuid4().hex
    weights_new, config_new = out_dir / (WEIGHTS + ".new"), out_dir / (CONFIG + ".new")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    # Serialised in memory and written by us: safetensors' save_file goes through a temporary file of its own
    # (left behind forever by a kill) created with mode 0600 (unreadable to the users config.json serves).
    with open(weights_new, "wb") as f:
        f.write(save(tensors, metadata={"format": "pt", "export_id": export_id}))
    ours = {"kind": kind, "export_id": export_id, "tool_version": __version__, "model": to_dict(model_cfg),
            **(record or {})}
    model_config: dict[str, Any] = {RECORD: ours, "pretrained_cfg": {"tag": "vit-mpp"}}
    if class_names:
        model_config["label_names"] = list(class_names)
    data_config = {"mean": tuple(mean), "std": tuple(std), "crop_pct": crop_pct, "crop_mode": "center",
                   "interpolation": INTERPOLATION}
    if "data_config" in inspect.signature(save_config_for_hf).parameters:
        save_config_for_hf(model, str(config_new), model_config=model_config, data_config=data_config)
        config = json.loads(config_new.read_text())
    else:  # timm before 1.0.30 (GPU images ship it): the same keys, set in pretrained_cfg here
        save_config_for_hf(model, config_new, model_config=model_config)  # a Path: those versions call .open()
        config = json.loads(config_new.read_text())
        config["pretrained_cfg"].update({k: list(v) if isinstance(v, tuple) else v for k, v in data_config.items()})
    config["pretrained_cfg"].pop("license", None)  # the named model's licence, not the licence of these weights
    config_new.write_text(json.dumps(config, indent=2) + "\n")
    for path in (weights_new, config_new):
        fsync(path)
    os.replace(config_new, out_dir / CONFIG)  # config first: a reader finishes the swap from model.safetensors.new
    replace(weights_new, out_dir / WEIGHTS)
    for legacy in ("encoder.safetensors", "encoder.json", "model.json"):  # an older export here would confuse readers
        (out_dir / legacy).unlink(missing_ok=True)
    return out_dir


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} is not readable JSON: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path} is not an export config (a JSON object)")
    return data


def _weights_file(path: Path, export_id: str | None, finish: bool) -> Path:
    """The weights file that config.json (`export_id`) belongs to: `path`, or after a kill between the two renames
    of write_export its `.new` (renamed into place when `finish` and the folder is writable)."""
    new = path.with_name(path.name + ".new")
    if export_id is not None and _export_id(path) != export_id and _export_id(new) == export_id:
        if not finish:
            return new
        try:  # a kill between the two renames of write_export: finish it
            os.replace(new, path)
        except OSError:  # a read-only export: read the new weights where they are
            return new
    return path


def check_export_weights(path: str | Path) -> None:
    """Whether the weights of the export at `path` can be read, from their header (safetensors checks it against the
    file's size, so a truncated file fails here), without reading the tensors: a check before a run writes
    anything."""
    files = export_files(Path(path))
    if files is None:
        return  # not an export: _read says so
    weights_path, meta_path = files
    ours = _json(meta_path).get(RECORD) if meta_path.name == CONFIG else None
    weights_path = _weights_file(weights_path, ours.get("export_id") if isinstance(ours, dict) else None, False)
    problem = safetensors_problem(weights_path)
    if problem:
        raise ExportError(problem)


def safetensors_problem(path: Path) -> str | None:
    """Why `path` cannot be read as safetensors, from its header alone (checked against the file's size, so a
    truncated file has a problem); None when it can."""
    try:
        with safe_open(str(path), "pt"):
            return None
    except (SafetensorError, OSError, ValueError) as e:  # truncated, empty or not a safetensors file
        return f"cannot read {path} as safetensors: {' '.join(str(e).split())}"


def _weights(path: Path, export_id: str | None) -> dict[str, torch.Tensor]:
    """The tensors of `path`; with `export_id`, those of the write that config.json belongs to."""
    path = _weights_file(path, export_id, True)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:  # truncated, empty or not a safetensors file
        raise ExportError(f"cannot read {path} as safetensors: {' '.join(str(e).split())}") from None
    if export_id is not None and _export_id(path) != export_id:
        raise ExportError(f"{path} does not belong to the {CONFIG} beside it (an export interrupted and "
                              "not recoverable): export again")
    return state


def _export_id(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("export_id")
    except (SafetensorError, OSError, ValueError):
        return None


def _model_config(data: Any, where: Path) -> ModelConfig:
    try:
        if not isinstance(data, dict):
            raise ConfigError(f"expects a mapping, got {data!r}")
        return from_dict(ModelConfig, data)
    except ConfigError as e:
        raise ExportError(f"{where} does not describe a model this tool can build: {e}") from None


# timm constructor arguments that a ModelConfig holds, and those it does not need to (they keep timm's default)
_TIMM_ARGS = {"img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "global_pool"}
_HARMLESS_ARGS = {"num_classes", "in_chans", "fc_norm", "drop_path_rate"}


def _from_timm_config(config: dict[str, Any], where: Path) -> ModelConfig:
    """The ModelConfig of a plain timm Hugging Face config (an export of timm itself or of another tool)."""
    args = dict(config.get("model_args") or {})
    odd = sorted(set(args) - _TIMM_ARGS - _HARMLESS_ARGS)
    if odd:
        raise ExportError(f"{where}: timm arguments {odd} cannot be rebuilt by this tool")
    if args.get("fc_norm"):
        raise ExportError(f"{where}: a ViT with fc_norm (a norm after pooling) is not supported")
    cfg = {k: v for k, v in args.items() if k in _TIMM_ARGS}
    if "img_size" not in cfg:
        cfg["img_size"] = list(config.get("pretrained_cfg", {}).get("input_size", [3, 224, 224])[1:])
    return _model_config({"name": config.get("architecture"), **cfg}, where)


def read_export(path: str | Path) -> Export:
    """Read the export at `path` (its folder or weights file): this tool's, either format, or a plain timm
    Hugging Face folder (config.json + model.safetensors). Raises ExportError with one line when it cannot."""
    return _read(Path(path), weights=True)


def read_export_config(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(the model, the vit_mpp record) of the export at `path`, from its config alone: the weights are not read (a
    check before a run starts, a model card's provenance)."""
    ex = _read(Path(path), weights=False)
    return ex.model, ex.record


def read_export_head(path: str | Path) -> tuple[int, list[str] | None, ModelConfig]:
    """(the classes of its head, 0 for an encoder; their names, when it has them; its model) of the export at `path`,
    from its config alone."""
    ex = _read(Path(path), weights=False)
    return ex.num_classes, ex.class_names, ex.model


def _read(path: Path, weights: bool) -> Export:
    """The export at `path`; its `state` is {} unless `weights`."""
    files = export_files(path)
    if files is None:
        old = path.with_name(path.name + ".old")
        raise ExportError(f"not an export (config.json + model.safetensors, or an older .safetensors + .json): "
                              f"{path}{' (an older export is at ' + str(old) + ')' if old.exists() else ''}")
    weights_path, meta_path = files
    meta = _json(meta_path)
    if meta_path.name == CONFIG:
        ours = meta.get(RECORD) or {}
        if not isinstance(ours, dict):
            raise ExportError(f"{meta_path}: '{RECORD}' is not a JSON object")
        model = _model_config(ours["model"], meta_path) if "model" in ours else _from_timm_config(meta, meta_path)
        state = _weights(weights_path, ours.get("export_id")) if weights else {}
        data = meta.get("pretrained_cfg") or {}
        mean, std = data.get("mean", (0.5,) * 3), data.get("std", (0.5,) * 3)
        crop_pct, names = data.get("crop_pct", 0.875), meta.get("label_names")
        num_classes = int(meta.get("num_classes", 0))
    else:  # the format before config.json
        if "model" not in meta:
            raise ExportError(f"{meta_path} has no 'model' section: not an export of this tool")
        model = _model_config(meta["model"], meta_path)
        state = _weights(weights_path, None) if weights else {}
        ours = {k: v for k, v in meta.items() if k not in ("model", "mean", "std", "class_names")}
        ours["kind"] = "classifier" if "num_classes" in meta else "encoder"
        mean, std = meta.get("mean", (0.5,) * 3), meta.get("std", (0.5,) * 3)
        crop_pct, names = meta.get("eval_crop_pct", 0.875), meta.get("class_names")
        num_classes = int(meta.get("num_classes", 0))
    if weights and "patch_embed.proj.weight" not in state:
        raise ExportError(f"{weights_path} holds no ViT patch embedding (patch_embed.proj.weight)")
    if len(mean) != 3 or len(std) != 3:
        raise ExportError(f"{meta_path}: mean and std must hold three numbers each")
    return Export(path=weights_path.parent, state=state, model=model, num_classes=num_classes, mean=tuple(mean),
                  std=tuple(std), crop_pct=float(crop_pct), class_names=names, record=ours)
