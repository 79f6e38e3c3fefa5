"""Fixtures every test folder uses: a small generated image folder, its shards, a small encoder export.

Plain helpers (shard factories, child processes, servers, metrics) are in tests/helpers/; a folder's own fixtures in
its conftest.py (tests/finetune/conftest.py). Session-scoped fixtures are shared by many tests: never write into them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from data_tools.cli import main as build_shards_main
from data_tools.demo_images import generate
from tests.helpers.models import SMALL_MODEL, write_encoder_export
from tests.helpers.processes import REPO, run_module, subprocess_env
from tests.helpers.servers import FaultyHandler, serve_directory, serve_faulty
from tests.helpers.shards import png_bytes, write_shard_set

# Kept importable from here (`from tests.conftest import ...`) for the scripts and branches that do so.
__all__ = ["REPO", "FaultyHandler", "png_bytes", "run_module", "serve_directory", "serve_faulty", "subprocess_env",
           "write_encoder_export", "write_shard_set"]


def pytest_configure(config) -> None:
    """One torch thread in the test process, as in the child processes (tests/helpers/processes.py): the machines
    that run the suite have 2 cores, often busy with other work, and a parallel region whose second thread waits for
    a core stalls the whole step (the small models here gain nothing from a second thread)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_folder(tmp_path_factory) -> Path:
    """A class-folder tree of 6 x 16 small generated images."""
    return generate(tmp_path_factory.mktemp("images"), per_class=16, size=24, seed=0)


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory, demo_folder) -> Path:
    """build-shards output for `demo_folder` (train 80, val 16), in shards of 16."""
    out = tmp_path_factory.mktemp("shards")
    build_shards_main([str(demo_folder), str(out), "--shard-size", "16", "--val-fraction", "0.1667", "--min-side", "4"])
    return out


@pytest.fixture(scope="session")
def encoder_export(tmp_path_factory) -> Path:
    """A pretraining export of a random SMALL_MODEL encoder (16 px, torch seed 0): where fine-tuning starts."""
    import torch

    from vit_mpp.models.vit import create_vit

    torch.manual_seed(0)
    return write_encoder_export(tmp_path_factory.mktemp("encoder"), create_vit(SMALL_MODEL), SMALL_MODEL)
