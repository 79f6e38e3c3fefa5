"""Reading YAML as the config engine needs it (engine.py): a key written twice is refused, booleans and nulls
come back as `Word`s that keep the text the user wrote beside what YAML 1.1 made of it (`no` may be the choice
"no", not False: the field's type decides), and a parse error is one line naming where the file stops being YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class Word(str):
    """A YAML scalar that YAML 1.1 reads as a boolean or null, kept as the text written; `value` is what YAML made
    of it (True, False or None). A str, so a string field takes the word; a bool field takes `value`."""

    value: bool | None

    def __new__(cls, text: str, value: bool | None) -> Word:
        word = super().__new__(cls, text)
        word.value = value
        return word


class _WordLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that booleans and nulls come back as `Word`s (the type decides, not YAML)."""


def _unique_keys_mapping(loader: _WordLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    """A mapping, refusing a key written twice: YAML requires unique keys, and PyYAML would keep the last one,
    silently dropping the first setting (`lr: 0.1` ... `lr: 0.5` trained at 0.5)."""
    lines: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may override the base's keys, by design
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in lines:
                where = f"line {line}" if lines[key] == line else f"lines {lines[key]} and {line}"
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' is written twice ({where})")
            lines[key] = line
        except TypeError:  # an unhashable key: PyYAML's own check below names it
            continue
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_WordLoader.add_constructor("tag:yaml.org,2002:map", _unique_keys_mapping)
_WordLoader.add_constructor("tag:yaml.org,2002:bool",
                            lambda loader, node: Word(node.value, loader.construct_yaml_bool(node)))
_WordLoader.add_constructor("tag:yaml.org,2002:null", lambda loader, node: Word(node.value, None))


def read_yaml(text: str) -> Any:
    """`text` parsed as YAML, with booleans and nulls kept as `Word`s (see the module doc)."""
    return yaml.load(text, Loader=_WordLoader)  # a SafeLoader subclass: plain data only, never objects


def plain(value: Any) -> Any:
    """`value` with every `Word` replaced by what YAML made of it (for values no field type decides)."""
    if isinstance(value, Word):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def yaml_error(path: Path, error: yaml.YAMLError) -> str:
    """Where a YAML file stops being YAML, and why: `config file PATH is not valid YAML: line 7, column 3: mapping
    values are not allowed here`."""
    mark, start = getattr(error, "problem_mark", None), getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(error, "context", None)
    opened = (f" ({context} opened at line {start.line + 1})" if context and start is not None and mark is not None
              and start.line != mark.line else "")
    return f"config file {path} is not valid YAML: {where}{' '.join(str(problem).split())}{opened}"
