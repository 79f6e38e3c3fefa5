"""Typed, strict configuration: dataclasses filled from YAML, overridden by `key.sub=value` arguments.

Every stage describes its config as nested dataclasses. `parse_args` reads `--config FILE` and any number of
`section.key=value` overrides (values parsed as YAML), checks every key and type, and returns the filled
dataclass. Unknown keys and wrong types raise `ConfigError` with a one-line message that names the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from common.errors import UserError

T = TypeVar("T")


class ConfigError(UserError):
    """A bad config file, key or value; the message is one line meant for the user."""


def opt(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse's vocabulary
    """A dataclass field with a default and a help string shown by `--help`."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def section(cls: type) -> Any:
    """A nested config section with its own defaults."""
    return dataclasses.field(default_factory=cls)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        inner = _type_name(args[0]) if args else "any"
        return f"list[{inner}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` checked (and minimally converted) against type `tp`, or raise ConfigError naming `key`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        raise ConfigError(f"config key '{key}' expects null, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"config key '{key}' expects one of {_type_name(tp)}, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")
        args = get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' expects bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' expects int, got {value!r}")
    if tp is float:
        # PyYAML reads `2e-4` (no dot) as a string; accept any number-looking value for float fields.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' expects float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. a path or name that YAML read as a number
        raise ConfigError(f"config key '{key}' expects str, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config section '{key}' expects a mapping, got {value!r}")
        return _fill(tp, value, prefix=f"{key}.")
    raise ConfigError(f"config key '{key}' has an unsupported type {tp!r}")  # a bug in a config class


def _fill(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"unknown config key '{prefix}{k}' (known in this section: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key '{dotted}': '{p}' is not a section")
    node[parts[-1]] = value


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Build `cls` from defaults, then the YAML file at `path`, then `key.sub=value` overrides (in that order)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(data, key.strip(), value)
    return _fill(cls, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (lists for tuples), ready for YAML or JSON."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable again with `load_config`)."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per config key: `name (type, default): help`, for `--help`."""
    lines = []
    hints = typing.get_type_hints(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{prefix}{f.name}:")
            lines.extend(describe(tp, prefix=f"{prefix}{f.name}."))
            continue
        default = getattr(instance, f.name)
        lines.append(f"  {prefix}{f.name} ({_type_name(tp)}, default {default!r}): {f.metadata.get('help', '')}")
    return lines


def parse_args(cls: type[T], argv: list[str] | None, prog: str, description: str) -> T:
    """Parse `--config FILE key=value ...` into `cls`; `--help` lists every key with its type and default."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (set in the YAML file or as key=value overrides):\n" + "\n".join(describe(cls)),
    )
    parser.add_argument("--config", help="YAML config file (see configs/); keys not given keep their defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. optim.lr=1e-3")
    args = parser.parse_args(argv)
    return load_config(cls, args.config, args.overrides)


# --- Sections shared by both stages -----------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    """Which timm VisionTransformer to build; `None` keeps the value of the timm model named."""

    name: str = opt("vit_tiny_patch16_224", "any timm VisionTransformer name (vit_tiny/small/base/large/huge_...)")
    img_size: int | list[int] = opt(224, "input size: an int or [height, width], divisible by the patch size")
    patch_size: int | None = opt(None, "patch size P (default: the named model's)")
    embed_dim: int | None = opt(None, "width D (custom sizes; default: the named model's)")
    depth: int | None = opt(None, "number of blocks L (default: the named model's)")
    num_heads: int | None = opt(None, "attention heads (default: the named model's)")
    mlp_ratio: float | None = opt(None, "MLP hidden size / D (default: the named model's, 4 for ViT)")
    global_pool: Literal["token", "avg"] = opt("token", "what the classifier head reads (fine-tuning): token (the "
                                               "[class] token, as in the paper) or avg (mean of the patch tokens)")
    drop_path_rate: float = opt(0.0, "stochastic depth rate")
    grad_checkpointing: bool = opt(False, "recompute block activations in the backward pass (saves memory)")


@dataclasses.dataclass
class DataConfig:
    """Where the shards are and how they are streamed (see common/data_stream.py)."""

    shards: str = opt("", "directory or URL holding the shards and their _info.json (from build-shards)")
    train_split: str = opt("train", "split used for training")
    val_split: str = opt("val", "split used for evaluation ('' for none)")
    num_workers: int = opt(2, "data-loader worker processes per training process")
    prefetch_factor: int = opt(2, "batches prefetched per worker")
    pin_memory: bool = opt(True, "pin host memory (CUDA only)")
    persistent_workers: bool = opt(True, "keep workers alive between epochs")
    shuffle_buffer: int = opt(1000, "per-worker shuffle buffer of encoded samples")
    crop_scale: list[float] = opt([0.35, 1.0], "RandomResizedCrop area range for training")
    hflip: bool = opt(True, "random horizontal flips for training")
    eval_crop_pct: float = opt(0.875, "evaluation: resize to size / crop_pct, then center-crop")
    max_bad_fraction: float = opt(0.01, "stop when more than this fraction of samples cannot be decoded")


@dataclasses.dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule; lr = base_lr * batch_size / base_batch_size (linear scaling)."""

    name: Literal["adamw", "adam", "sgd"] = opt("adamw", "optimizer")
    base_lr: float = opt(2e-4, "learning rate at base_batch_size")
    base_batch_size: int = opt(4096, "batch size at which base_lr applies")
    weight_decay: float = opt(0.0, "decoupled weight decay (not applied to biases, norms, embeddings, tokens)")
    betas: list[float] = opt([0.9, 0.999], "Adam betas")
    momentum: float = opt(0.9, "SGD momentum")
    warmup_steps: int = opt(10000, "linear warmup steps")
    warmup_max_fraction: float = opt(0.1, "warmup is capped at this fraction of the run, so short runs decay too")
    min_lr_ratio: float = opt(0.0, "cosine decays to base lr x this ratio")
    clip_grad_norm: float = opt(1.0, "clip gradients at this global norm (0 disables)")
    impl: Literal["auto", "fused", "foreach", "single"] = opt("auto", "optimizer kernel (auto: fused on CUDA)")


@dataclasses.dataclass
class TrainConfig:
    """Run-level settings common to both stages."""

    run_dir: str = opt("runs/run", "run directory (config, metrics, checkpoints); re-running it resumes")
    seed: int = opt(0, "random seed")
    batch_size: int = opt(4096, "global batch size (all processes, after accumulation)")
    micro_batch_size: int | None = opt(None, "per-device batch per forward (default: batch_size / processes)")
    mixed_precision: Literal["no", "bf16", "fp16"] = opt("no", "mixed precision")
    compile: bool = opt(False, "torch.compile the model")
    log_every: int = opt(10, "log every N optimizer steps")
    ckpt_every: int = opt(500, "save the full training state every N optimizer steps")
    keep_last: int = opt(2, "checkpoints to keep")
    trackers: list[str] = opt([], "extra Accelerate trackers: tensorboard, wandb, ...")
