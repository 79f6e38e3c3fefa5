"""Fixtures of the fine-tuning tests: one small labelled shard set, the encoder export fine-tuning starts from, and
one linear probe trained on them that several tests read (its evaluation, exports, predict, `finetune.evaluate`).
They are shared by every test of the folder: never write into them (beside the probe's export is fine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runs import run_tiny_finetune
from tests.helpers.shards import write_shard_set


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> Path:
    """3 classes (a, b, c); 40 training images, 13 validation images in uneven shards (the last eval batches are
    padded)."""
    return write_shard_set(tmp_path_factory.mktemp("finetune_shards"), {"train": [24, 16], "val": [7, 6]})


@pytest.fixture(scope="session")
def pretrained(encoder_export) -> Path:
    """The pretraining export fine-tuning starts from: a random small encoder (tests/conftest.py)."""
    return encoder_export


@pytest.fixture(scope="session")
def probe_run(shards, pretrained, tmp_path_factory) -> Path:
    """A linear probe of the random encoder, 2 epochs with an evaluation each (a large LR, so that its predictions
    differ from class to class)."""
    run_dir = tmp_path_factory.mktemp("probe")
    run_tiny_finetune(shards, run_dir, pretrained, "train.mode=linear_probe", "optim.lr=0.5")
    return run_dir
