"""The checks of `--device` and `--out` that predict, evaluate and analysis share (vit_mpp/tool_args.py): made
before any work, one ConfigError each."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import SMALL_MODEL, write_encoder_export
from vit_mpp.config import ConfigError
from vit_mpp.models import create_vit
from vit_mpp.tool_args import check_device, check_out_file, check_out_folder


def test_devices():
    assert check_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="--device banana: not a device"):
        check_device("banana")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda:1: this machine has 0 CUDA device"):
            check_device("cuda:1")
    else:
        with pytest.raises(ConfigError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}")


def test_out_files(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a folder: give a file name"):
        check_out_file(str(tmp_path))
    with pytest.raises(ConfigError, match=f"{tmp_path / 'f'} is a file, not a folder"):
        check_out_file(str(tmp_path / "f" / "a" / "b.csv"))
    assert check_out_file(str(tmp_path / "new" / "b.csv")) == tmp_path / "new" / "b.csv"
    assert not (tmp_path / "new").exists()  # created when the file is written, not by the check


def test_out_folders(tmp_path):
    (tmp_path / "f").write_text("x")
    export = write_encoder_export(tmp_path / "export", create_vit(SMALL_MODEL), SMALL_MODEL)
    with pytest.raises(ConfigError, match="is a file: give a folder"):
        check_out_folder(tmp_path / "f")
    with pytest.raises(ConfigError, match="is an export: give a folder"):
        check_out_folder(export)
    # evaluate wrote evaluation.json and its confusion matrix among a data set's shards
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "_info.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a shard set \(_info.json\): give a folder"):
        check_out_folder(tmp_path / "shards")
    assert check_out_folder(tmp_path / "results") == tmp_path / "results"
