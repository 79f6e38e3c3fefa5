"""predict with images it cannot read: some unreadable are skipped with a warning and the others labelled; none
readable is one line `error: ...`, exit 2, and no CSV (not a CSV holding only its header, with exit 0)."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import REPO, subprocess_env
from vit_mpp.config import ModelConfig
from vit_mpp.export import write_export
from vit_mpp.models import create_vit


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    torch.manual_seed(0)
    cfg = ModelConfig(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)
    return write_export(tmp_path_factory.mktemp("export"), create_vit(cfg, 3).state_dict(), cfg, kind="classifier",
                        num_classes=3, mean=(0.5,) * 3, std=(0.5,) * 3, class_names=["a", "b", "c"])


def predict(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune.predict", *args], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(), cwd=REPO)


def test_one_corrupt_image_is_one_error_line_and_no_csv(export, tmp_path):
    bad = tmp_path / "photo.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    out = tmp_path / "preds.csv"
    result = predict("--checkpoint", str(export), "--images", str(bad), "--out", str(out))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: none of the 1 image(s) could be read, so nothing was labelled ({bad}: ")
    assert not out.exists() and result.stdout == ""
    to_stdout = predict("--checkpoint", str(export), "--images", str(bad))
    assert to_stdout.returncode == 2 and to_stdout.stdout == ""  # not even the header


def test_the_readable_ones_are_written_and_the_others_reported(export, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "a_bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # first in order: held, then reported
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(images / "b_good.png")
    (images / "c_bad.jpg").write_bytes(b"garbage")
    out = tmp_path / "preds.csv"
    result = predict("--checkpoint", str(export), "--images", str(images), "--out", str(out), "--batch-size", "1")
    assert result.returncode == 0, result.stderr
    assert [r["path"] for r in csv.DictReader(out.open())] == [str(images / "b_good.png")]
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("warning: skipped")]
    assert [w.split(":")[1].strip().split(" ")[-1] for w in warnings] == [str(images / "a_bad.png"),
                                                                          str(images / "c_bad.jpg")]
    assert result.stderr.strip().splitlines()[-1] == f"labelled 1 of 3 images -> {out}"
