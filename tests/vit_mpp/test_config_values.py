"""Config values as users write them (vit_mpp/config/engine.py): YAML 1.1 reads `no`, `off`, `yes`, `on` as booleans,
yet `train.mixed_precision=no` means the choice "no". Every choice of every string-choice field of both stages is
accepted unquoted, in a YAML file and as key=value; and the loader records which keys the user set."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal, get_args, get_origin

import pytest

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig
from vit_mpp.config.engine import ConfigError, given_keys, load_config, save_config

STAGES = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}


def fields_of(cls: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, type) of every leaf field of a config class, sections walked."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue  # a ClassVar
        if dataclasses.is_dataclass(tp):
            out += fields_of(tp, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", tp))
    return out


def choices() -> list[tuple[str, str, str]]:
    """(stage, key, choice) for every choice of every Literal field, discovered from the dataclasses."""
    rows = []
    for stage, cls in STAGES.items():
        for key, tp in fields_of(cls):
            if get_origin(tp) is Literal:
                rows += [(stage, key, choice) for choice in get_args(tp)]
    return rows


CHOICES = choices()


def test_the_choices_are_discovered_and_include_the_yaml_boolean_words():
    keys = {(stage, key) for stage, key, _ in CHOICES}
    assert ("pretrain", "train.mixed_precision") in keys and ("finetune", "augment.remode") in keys
    assert ("pretrain", "mpp.target") in keys and ("finetune", "init.kind") in keys
    assert ("pretrain", "train.mixed_precision", "no") in CHOICES  # the word YAML 1.1 reads as False


def yaml_of(key: str, text: str) -> str:
    """`a.b.c: text` as nested YAML, the value unquoted as a user writes it."""
    parts = key.split(".")
    sections = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parts[:-1]))
    return sections + f"{'  ' * (len(parts) - 1)}{parts[-1]}: {text}\n"


def value_of(cfg: object, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("stage, key, choice", CHOICES, ids=[f"{s}:{k}={c}" for s, k, c in CHOICES])
def test_every_choice_is_accepted_unquoted_in_yaml_and_as_key_value(stage, key, choice, tmp_path):
    cls = STAGES[stage]
    path = tmp_path / "c.yaml"
    path.write_text(yaml_of(key, choice))
    from_file = load_config(cls, path)
    from_override = load_config(cls, None, [f"{key}={choice}"])
    assert value_of(from_file, key) == choice and type(value_of(from_file, key)) is str
    assert value_of(from_override, key) == choice and type(value_of(from_override, key)) is str
    save_config(from_override, tmp_path / "resolved.yaml")  # and the written config reads back the same
    assert value_of(load_config(cls, tmp_path / "resolved.yaml"), key) == choice


@pytest.mark.parametrize("word", ["no", "No", "NO", "off", "yes", "on", "true", "false"])
def test_a_yaml_boolean_word_is_a_word_for_strings_and_a_boolean_for_bools(word, tmp_path):
    cfg = load_config(PretrainConfig, None, [f"data.val_split={word}", f"data.hflip={word}"])
    assert cfg.data.val_split == word and type(cfg.data.val_split) is str  # a str field: the word written
    assert cfg.data.hflip is (word.lower() in ("yes", "on", "true"))  # a bool field: YAML's boolean
    path = tmp_path / "c.yaml"
    path.write_text(f"train:\n  run_name: {word}\n  compile: {word}\n")
    cfg = load_config(PretrainConfig, path)
    assert cfg.train.run_name == word and cfg.train.compile is (word.lower() in ("yes", "on", "true"))


def test_a_null_is_none_where_allowed_and_empty_in_a_string_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: ~\ntrain:\n  run_name:\ninit:\n  checkpoint: null\n")
    cfg = load_config(FinetuneConfig, path)
    assert cfg.optim.lr is None and cfg.train.run_name == "" and cfg.init.checkpoint == ""
    for override, message in (("train.mixed_precision=~", "expects one of 'no' | 'bf16' | 'fp16', got null"),
                              ("train.steps=no", "expects int, got 'no'"),
                              ("train.mixed_precision=maybe", "got 'maybe'")):
        with pytest.raises(ConfigError, match=message):
            load_config(PretrainConfig, None, [override])


def test_the_loader_records_the_keys_the_user_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: vit_tiny_patch16_224\n  img_size: 32\ntrain:\n  steps: 3\n")
    cfg = load_config(PretrainConfig, path, ["model.depth=2", "optim.lr=0.1"])
    assert given_keys(cfg.model) == {"name", "img_size", "depth"}  # the name is the default, but it was written
    assert given_keys(cfg.optim) == {"lr"} and given_keys(cfg.train) == {"steps"}
    assert given_keys(cfg.mpp) == frozenset() and given_keys(load_config(PretrainConfig).model) == frozenset()
    assert "_given_keys" not in str(cfg) and [f.name for f in dataclasses.fields(cfg.model)][0] == "name"
