"""`accelerate launch pretrain` runs `python pretrain/`, which puts the stage folder first on sys.path: a module there
named like a standard-library or dependency module would shadow it for every import in the process."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.processes import REPO

DEPENDENCIES = {"torch", "torchvision", "timm", "accelerate", "webdataset", "datasets", "rich", "safetensors", "yaml",
                "PIL", "numpy", "matplotlib", "fsspec", "scipy", "sklearn", "vit_mpp", "data_tools", "pretrain",
                "finetune", "tests"}


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_stage_modules_shadow_nothing(stage):
    names = {p.stem for p in (REPO / stage).glob("*.py")} - {"__init__", "__main__"}
    assert names, stage
    clashes = sorted(n for n in names if n in sys.stdlib_module_names or n in DEPENDENCIES)
    assert not clashes, f"{stage}/ modules shadow: {clashes}"
