"""Every name a doc or a docstring gives exists: files and folders of the repository, dotted modules and their
attributes, a module's definitions named beside its path (`vit_mpp/run/start/run.py` `start_run`), and config keys
(`data.num_workers`). A moved or renamed thing fails here until its references are mended.

Read: README.md, docs/*.md, and the docstrings (module, class, function) of the product, benchmarks, experiments
and tests. CHANGELOG.md is history: it names what was, on purpose.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vit_mpp", "data_tools", "pretrain", "finetune", "analysis", "experiments")
FOLDERS = (*PACKAGES, "benchmarks", "tests", "configs", "scripts", "docs")
SUFFIXES = ("py", "md", "yaml", "json", "jsonl", "png", "tar", "csv", "txt", "safetensors", "pt", "sh", "lock")

PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(FOLDERS) + r")/[\w/.-]*[\w/])")
DOTTED = re.compile(r"(?<![\w./-])((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)")
PATH_AND_NAME = re.compile(r"((?:" + "|".join(PACKAGES) + r")/[\w/]+\.py)(?:'s)? `(\w+(?:\.\w+)?)")


def texts() -> dict[str, str]:
    """Where -> text, for every doc page and docstring read."""
    found = {str(p.relative_to(REPO)): p.read_text()
             for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    for folder in (*PACKAGES, "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        found[f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 1)}"] = doc
    return found


TEXTS = texts()


def resolves(dotted: str) -> bool:
    """Whether `a.b.c.name` is a module, or an attribute chain of one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@cache
def definitions(path: Path) -> set[str]:
    """`name` and `Class.member` for what a module defines at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(f"{node.name}.{member.name}")
                    elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                        names.add(f"{node.name}.{member.target.id}")
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def config_keys() -> set[str]:
    keys: set[str] = set()
    for cls in (PretrainConfig, FinetuneConfig):
        cfg = cls()
        for field in dataclasses.fields(cfg):
            section = getattr(cfg, field.name)
            if dataclasses.is_dataclass(section):
                keys |= {f"{field.name}.{f.name}" for f in dataclasses.fields(section)}
            else:
                keys.add(field.name)
    return keys


KEYS = config_keys()
# Not a key: `semi.finetune:KEY=VALUE`, a compare target (an arm named like a section, then its stage)
KEY = re.compile(r"(?<![\w./-])(" + "|".join(sorted({k.split(".")[0] for k in KEYS if "." in k}))
                 + r")\.(\w+)(?![\w/(-]|:\w)")


def missing_paths(texts: dict[str, str]) -> list[tuple[str, str]]:
    return sorted({(where, m.group(1).rstrip(".")) for where, text in texts.items() for m in PATH.finditer(text)
                   if "*" not in m.group(1) and not (REPO / m.group(1).rstrip(".")).exists()})


def broken_dotted(texts: dict[str, str]) -> list[tuple[str, str]]:
    return sorted({(where, m.group(1)) for where, text in texts.items() for m in DOTTED.finditer(text)
                   if not m.group(1).endswith(tuple(f".{s}" for s in SUFFIXES)) and not resolves(m.group(1))})


def undefined_names(texts: dict[str, str]) -> list[tuple[str, str, str]]:
    return sorted({(where, path, name) for where, text in texts.items() for path, name in PATH_AND_NAME.findall(text)
                   if (REPO / path).is_file() and name not in definitions(REPO / path)})


def unknown_keys(texts: dict[str, str]) -> list[tuple[str, str]]:
    return sorted({(where, f"{m.group(1)}.{m.group(2)}") for where, text in texts.items() for m in KEY.finditer(text)
                   if m.group(2) not in SUFFIXES and f"{m.group(1)}.{m.group(2)}" not in KEYS})


def module_basenames() -> dict[str, str]:
    """A module's own name -> its dotted name, for the names that one module alone bears and that no config section
    or common word shares (`stream_plan.Layout` in a docstring means vit_mpp.data.stream_plan.Layout)."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            dotted = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found.setdefault(path.stem, []).append(dotted)
    common = {k.split(".")[0] for k in KEYS} | {"__init__", "__main__", "config", "train", "cli", "errors", "evaluate",
                                                 "predict", "scoring", "build", "merge", "stream", "store", "vit",
                                                 "accelerator", "registry"}  # also an object's or a host's name
    return {name: dotted[0] for name, dotted in found.items() if len(dotted) == 1 and name not in common}


BASENAMES = module_basenames()
SHORT = re.compile(r"(?<![\w./-])(" + "|".join(sorted(BASENAMES)) + r")\.(\w+)(?![\w(-]|\.\w)")
# Module names retired by the restructure into wings (CHANGELOG.md lists where each went): a doc naming one is stale.
RETIRED = ("data_stream", "run_setup", "tool_args", "figure_files", "training_curves", "run_metrics", "export_layout",
           "shard_index", "index_shards", "shard_list", "tar_count")


def short_dotted(texts: dict[str, str]) -> list[tuple[str, str]]:
    """`module.name` by a module's own name (see `module_basenames`) that does not resolve, and retired names."""
    broken = {(where, f"{m.group(1)}.{m.group(2)}") for where, text in texts.items() for m in SHORT.finditer(text)
              if m.group(2) not in SUFFIXES and not resolves(f"{BASENAMES[m.group(1)]}.{m.group(2)}")}
    retired = re.compile(r"(?<![\w.-])(" + "|".join(RETIRED) + r")\b(?!\.md)")  # docs/data_stream.md is a page
    return sorted(broken | {(where, m.group(1)) for where, text in texts.items() for m in retired.finditer(text)})


CHECKS = {"path": missing_paths, "dotted": broken_dotted, "name": undefined_names, "key": unknown_keys,
          "short": short_dotted}


def test_the_reader_finds_the_docs_and_docstrings():
    assert "README.md" in TEXTS and "docs/architecture.md" in TEXTS
    assert any(where.startswith("vit_mpp/run/start/run.py:") for where in TEXTS)
    assert {"data.num_workers", "train.steps", "train.epochs", "mpp.target", "init.checkpoint"} <= KEYS


@pytest.mark.parametrize("check", list(CHECKS))
def test_every_name_a_doc_gives_exists(check):
    assert not CHECKS[check](TEXTS)


@pytest.mark.parametrize("check, text", [
    ("path", "see vit_mpp/nowhere.py"), ("dotted", "vit_mpp.data.stream.NoSuchThing"),
    ("name", "vit_mpp/run/start/run.py `no_such_function`"), ("key", "set `data.no_such_key=1`"),
    ("short", "stream_plan.NoSuchThing"), ("short", "data_stream.read_segment"),
])
def test_a_stale_reference_is_caught_and_a_good_one_is_not(check, text):
    good = {"path": "vit_mpp/run/start/run.py", "dotted": "vit_mpp.data.stream.TrainStream",
            "name": "vit_mpp/run/start/run.py `start_run`", "key": "`data.num_workers=2`",
            "short": "stream_plan.Layout and shard_reader.read_segment"}[check]
    assert CHECKS[check]({"doc": text}) and not CHECKS[check]({"doc": good})
