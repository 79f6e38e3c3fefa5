"""Fixtures of the fine-tuning tests: one small labelled shard set and the encoder export fine-tuning starts from.
Both are shared by every test of the folder: never write into them."""

from __future__ import annotations

from pathlib import Path

import pytest

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
