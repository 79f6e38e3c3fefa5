"""predict reads every image format build-shards reads: one list of extensions (vit_mpp/image_formats.py)."""

from __future__ import annotations

import csv

import numpy as np
import torch
from PIL import Image

from finetune import predict
from vit_mpp.config import ModelConfig
from vit_mpp.export import write_export
from vit_mpp.image_formats import IMAGE_SUFFIXES
from vit_mpp.models import create_vit

SMALL = ModelConfig(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)


def test_predict_labels_a_bmp_and_a_tiff_as_build_shards_reads_them(tmp_path):
    # predict once kept its own list (jpg, jpeg, png, webp) and skipped .bmp/.tif files that build-shards accepts.
    torch.manual_seed(0)
    model = create_vit(SMALL, num_classes=3)
    export = write_export(tmp_path / "export", model.state_dict(), SMALL, kind="classifier", num_classes=3,
                          mean=(0.5,) * 3, std=(0.5,) * 3, class_names=["a", "b", "c"])
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name in ("photo.bmp", "scan.TIF", "shot.png"):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(images / name)
    (images / "notes.txt").write_text("not an image")
    assert {".bmp", ".tif", ".png"} <= IMAGE_SUFFIXES
    out = tmp_path / "preds.csv"
    predict.main(["--checkpoint", str(export), "--images", str(images), "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert sorted(r["path"] for r in rows) == sorted(str(images / n) for n in ("photo.bmp", "scan.TIF", "shot.png"))
    assert all(r["class_name"] in ("a", "b", "c") for r in rows)
