"""Typed, strict configuration: dataclasses filled from YAML, overridden by `section.key=value` arguments.

`parse_args` and `load_config` check every key and type against the stage's nested dataclasses (fields declared with
`opt`, their rules as `Check`) and raise `ConfigError`, one line naming the key. The YAML is read by yaml_words.py,
which keeps the word a user wrote beside what YAML 1.1 made of it (`Word`); the engine records which keys were set
(`given_keys`).
See docs/reliability.md#user-mistakes-are-one-line-exit-2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from vit_mpp.cli import ArgumentParser
from vit_mpp.config.yaml_words import Word, plain, read_yaml, yaml_error
from vit_mpp.durable import write_atomic
from vit_mpp.errors import UserError

T = TypeVar("T")
DRY_RUN = "_dry_run"  # the attribute of a parsed config that says --dry-run was given
GIVEN = "_given_keys"  # the instance attribute (not a field: the dataclasses keep their shape) that given_keys reads


class ConfigError(UserError):
    """A bad config file, key or value; the message is one line meant for the user."""


def given_keys(section: Any) -> frozenset[str]:
    """The names of the fields of a loaded config section that the user set (in the YAML file or as key=value),
    whatever their value; empty for a section built in code or left to its defaults."""
    return getattr(section, GIVEN, frozenset())


@dataclasses.dataclass(frozen=True)
class Check:
    """A rule a config value must follow (checked on load); `text` completes "must be ..." in errors and --help."""

    test: Callable[[Any], bool]
    text: str

    def __call__(self, value: Any) -> bool:
        if value is None:  # null means "the default" wherever a field allows it; the type check covers the rest
            return True
        try:
            return bool(self.test(value))
        except (TypeError, ValueError):
            return False


def at_least(n: float) -> Check:
    return Check(lambda v: v >= n, f">= {n:g}")


def above(n: float) -> Check:
    return Check(lambda v: v > n, f"> {n:g}")


def between(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Check:
    """lo <= v <= hi, either end open."""
    text = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    return Check(lambda v: (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi), text)


def items(check: Check, length: int) -> Check:
    """A list of exactly `length` values, each following `check`."""
    return Check(lambda v: len(v) == length and all(check(x) for x in v), f"{length} values, each {check.text}")


NOT_EMPTY = Check(lambda v: bool(str(v).strip()), "a non-empty string")


def opt(default: Any, help: str, check: Check | None = None) -> Any:  # noqa: A002 - mirrors argparse's vocabulary
    """A dataclass field with a default, a help string shown by `--help`, and the rule its value must follow."""
    metadata = {"help": help, "check": check}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


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


class NotFinite(ConfigError):
    """A float setting given as inf or nan."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` checked (and minimally converted) against type `tp`, or raise ConfigError naming `key`."""
    origin = get_origin(tp)
    if tp is Any:
        return plain(value)
    if origin in (Union, types.UnionType):
        if _is_null(value) and type(None) in get_args(tp):  # before `str` can take a null as ""
            return None
        errors = []
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        specific = [e for e in errors if isinstance(e, NotFinite)]  # a number after all: say what is wrong with it
        raise specific[0] if specific else ConfigError(f"config key '{key}' expects {_type_name(tp)}, got "
                                                       f"{_shown(value)}")
    if tp is type(None):
        if _is_null(value) or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        raise ConfigError(f"config key '{key}' expects null, got {_shown(value)}")
    if origin is Literal:
        if isinstance(value, Word) and value.value is not None:  # `no` meant the choice "no", not False
            value = str(value)
        if not isinstance(value, Word) and value in get_args(tp):
            return value
        raise ConfigError(f"config key '{key}' expects one of {_type_name(tp)}, got {_shown(value)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {_shown(value)}")
        args = get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, Word) and isinstance(value.value, bool):
            return value.value
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' expects bool, got {_shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' expects int, got {_shown(value)}")
    if tp is float:
        # PyYAML reads `2e-4` (no dot) as a string; accept any number-looking value for float fields.
        number = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int beyond the largest float
                number = math.inf
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"config key '{key}' expects float, got {_shown(value)}")
        if not math.isfinite(number):  # no setting means anything at inf or nan; deadlines at inf overflow
            raise NotFinite(f"config key '{key}' expects a finite number, got {_shown(value)}")
        return number
    if tp is str:
        if _is_null(value):  # no str field here allows null: the user meant "none", which is '' in every one
            return ""
        if isinstance(value, Word):  # a YAML boolean meant the word
            return str(value)
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. a path or name that YAML read as a number
        raise ConfigError(f"config key '{key}' expects str, got {_shown(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config section '{key}' expects a mapping, got {plain(value)!r}")
        return _fill(tp, value, prefix=f"{key}.")
    raise ConfigError(f"config key '{key}' has an unsupported type {tp!r}")  # a bug in a config class


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, Word) and value.value is None)


def _shown(value: Any) -> str:
    """`value` as an error message shows it: a null as null, whatever the user wrote for it."""
    return "null" if _is_null(value) else repr(value)


def _fill(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"unknown config key '{prefix}{k}' ({did_you_mean(str(k), names, prefix)}known in this "
                              f"section: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    obj = cls(**kwargs)
    object.__setattr__(obj, GIVEN, frozenset(data))  # beside the fields, not one of them (see given_keys)
    for f in dataclasses.fields(cls):  # defaults too: every field of a loaded config follows its rule
        check = _check_of(cls, f.name)
        value = getattr(obj, f.name)
        if check is not None and not check(value):
            raise ConfigError(f"config key '{prefix}{f.name}' must be {check.text}, got {_shown(value)}")
    for key, problem in getattr(obj, "problems", lambda: [])():  # rules that join several fields
        raise ConfigError(f"config key '{prefix}{key}' {problem}")
    return obj


def did_you_mean(key: str, names: set[str], prefix: str = "") -> str:
    """`did you mean 'train.steps'? ` for the known name closest to a mistyped `key` (difflib), or ''."""
    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
    return f"did you mean '{prefix}{close[0]}'? " if close else ""


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """`cls` filled from plain data (as `to_dict` writes it), every key and type checked (ConfigError)."""
    return _fill(cls, data)


def _check_of(cls: type, name: str) -> Check | None:
    """The rule of field `name`: its own, or that of the base class whose field it overrides (a stage's section
    changes a default, not the rule)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            for f in dataclasses.fields(klass):
                if f.name == name and f.metadata.get("check") is not None:
                    return f.metadata["check"]
    return None


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
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder: give the YAML file")
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}): give a YAML file") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        try:
            loaded = read_yaml(text)
        except yaml.YAMLError as e:
            raise ConfigError(yaml_error(path, e)) from None
        loaded = None if _is_null(loaded) else loaded  # a file holding only `~`: no keys
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = read_yaml(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            if raw.strip().startswith("[") and raw.strip().endswith("]"):  # meant as a list: never a path
                raise ConfigError(f"override '{item}': {raw} is not a valid YAML list ({str(e).splitlines()[0]}); "
                                  "lists are written [a, b]") from None
            value = raw  # a plain string YAML cannot read, such as a brace pattern '{00000..00099}.tar'
        _set_dotted(data, key.strip(), value)
    return _fill(cls, data)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as one mapping of dotted keys: {"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
    """Write the resolved config as YAML (loadable again with `load_config`), whole or not at all (a full disk is
    one line)."""
    write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


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
        check = _check_of(cls, f.name)
        rule = f"; must be {check.text}" if check is not None else ""
        lines.append(f"  {prefix}{f.name} ({_type_name(tp)}, default {default!r}): {f.metadata.get('help', '')}{rule}")
    return lines


def parse_args(cls: type[T], argv: list[str] | None, prog: str, description: str) -> T:
    """Parse `--config FILE key=value ...` into `cls`; `--help` lists every key with its type and default."""
    parser = ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (set in the YAML file or as key=value overrides):\n" + "\n".join(describe(cls)),
    )
    parser.add_argument("--config", help="YAML config file (see configs/); keys not given keep their defaults")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides, e.g. train.batch_size=256 optim.base_lr=1e-3")
    parser.add_argument("--dry-run", action="store_true",
                        help="check everything a run checks at start, print what it would do, write nothing")
    args = parser.parse_intermixed_args(argv)  # key=value on both sides of --dry-run, as a user types them
    cfg = load_config(cls, args.config, args.overrides)
    object.__setattr__(cfg, DRY_RUN, args.dry_run)  # beside the fields, not one of them: not saved with the config
    return cfg


def is_dry_run(cfg: Any) -> bool:
    """Whether the command line asked for a dry run (`--dry-run`)."""
    return getattr(cfg, DRY_RUN, False)


def replaced(cfg: Any, **changes: Any) -> Any:
    """`dataclasses.replace` for a loaded config or section: also keeps what the loader records beside the fields
    (`--dry-run`, the keys the user set), which `dataclasses.replace` alone would drop."""
    new = dataclasses.replace(cfg, **changes)
    for attr in (GIVEN, DRY_RUN):
        if hasattr(cfg, attr):
            object.__setattr__(new, attr, getattr(cfg, attr))
    return new
