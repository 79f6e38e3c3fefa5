"""Fine-tuning runs in-process on tiny shards: linear probe, evaluation outputs, best/last exports, predict,
and the AdamW recipe with layer decay, mixup/cutmix and colour jitter."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from data_tools.cli import main as build_main
from finetune import predict
from finetune.augment import build_mixup, color_jitter
from finetune.config import AugmentConfig, FinetuneOptimConfig
from tests.helpers.build import samples as shard_samples
from tests.helpers.runs import read_metrics, run_tiny_finetune
from tests.helpers.shards import png_bytes
from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import ModelConfig
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import load_split
from vit_mpp.models.export import read_export
from vit_mpp.models.pretrained import resize_pos_embed
from vit_mpp.models.vit import create_vit
from vit_mpp.run.loop import set_lr
from vit_mpp.run.optimizer import build_optimizer


def test_linear_probe_leaves_the_encoder_unchanged(probe_run, pretrained):
    weights = load_file(probe_run / "export" / "model.safetensors")
    for k, v in load_file(pretrained / "model.safetensors").items():
        expected = resize_pos_embed(v, (4, 4), (6, 6), 1, "bilinear") if k == "pos_embed" else v
        torch.testing.assert_close(weights[k], expected, rtol=0, atol=0, msg=k)
    assert torch.count_nonzero(weights["head.weight"]) > 0  # the head did train


def test_evaluation_counts_each_sample_once_and_writes_the_confusion_matrix(probe_run, shards):
    info = json.loads((shards / "_info.json").read_text())
    n_val, k = info["splits"]["val"]["num_samples"], len(info["class_names"])
    evals = [m for m in read_metrics(probe_run) if "val_top1" in m]
    assert len(evals) == 2  # each of the 2 epochs
    for m in evals:
        assert m["val_samples"] == n_val == sum(m["val_per_class_count"])
        assert len(m["val_per_class_acc"]) == k
    saved = json.loads((probe_run / "confusion_matrix.json").read_text())
    assert saved["class_names"] == info["class_names"]
    assert sum(map(sum, saved["confusion"])) == n_val
    assert sum(saved["confusion"][i][i] for i in range(k)) == round(evals[-1]["val_top1"] * n_val)
    assert (probe_run / "confusion_matrix.png").stat().st_size > 1000


def test_best_and_last_exports(probe_run):
    evals = read_metrics(probe_run)
    best = max(m["val_top1"] for m in evals if "val_top1" in m)
    best_meta, last_meta = read_export(probe_run / "export" / "best"), read_export(probe_run / "export")
    assert best_meta.record["metrics"]["val_top1"] == best and last_meta.record["metrics"]["val_top1"] == \
        evals[-1]["val_top1"]
    assert last_meta.record["finetune"]["mode"] == "linear_probe" and last_meta.model.img_size == 24
    assert load_file(probe_run / "export" / "best" / "model.safetensors").keys() == \
        load_file(probe_run / "export" / "model.safetensors").keys()


def test_predict_labels_a_folder(probe_run, tmp_path):
    rng = np.random.default_rng(0)
    demo_folder = tmp_path / "images"
    for i, size in enumerate((16, 30, 40)):
        (demo_folder / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
        (demo_folder / f"sub{i % 2}" / f"{i}.png").write_bytes(png_bytes(rng, size))
    (demo_folder / "notes.txt").write_text("not an image")
    out = tmp_path / "preds.csv"
    predict.main(["--checkpoint", str(probe_run / "export"), "--images", str(demo_folder), "--out", str(out),
                  "--top-k", "2"])
    rows = list(csv.DictReader(out.open()))
    images = sorted(demo_folder.rglob("*.png"))
    meta = read_export(probe_run / "export")
    assert len(rows) == len(images) and {r["path"] for r in rows} == {str(p) for p in images}
    for r in rows:
        assert meta.class_names[int(r["class_index"])] == r["class_name"]
        assert float(r["prob"]) >= float(r["prob_2"])
    # Against what the model does on the same preprocessing: predictions agree with a direct forward.
    model, pre = predict.load_classifier(probe_run / "export" / "best")
    (path, top, _), = predict.predict(model, pre, [images[0]])
    assert path == images[0] and 0 <= top[0][0] < pre.num_classes


def test_adamw_recipe_with_layer_decay_mixup_and_jitter(shards, pretrained, tmp_path):
    run_tiny_finetune(shards, tmp_path, pretrained, "train.epochs=1", "data.val_split=", "optim.name=adamw",
                      "optim.base_lr=1e-3", "optim.weight_decay=0.05", "optim.layer_decay=0.75", "augment.mixup=0.8",
                      "augment.cutmix=1.0", "augment.color_jitter=0.4", "train.label_smoothing=0.1")
    weights = load_file(tmp_path / "export" / "model.safetensors")
    before = load_file(pretrained / "model.safetensors")
    assert not torch.equal(weights["blocks.0.attn.qkv.weight"], before["blocks.0.attn.qkv.weight"])
    assert not (tmp_path / "export" / "best").exists()  # no validation split, no best model


def test_layer_decay_scales_the_lr_by_depth():
    model = create_vit(ModelConfig(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2), num_classes=3)
    opt = build_optimizer(model, FinetuneOptimConfig(name="adamw", weight_decay=0.05, impl="single"), 1.0, 0.5)
    set_lr(opt, 1.0)
    by_param = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert by_param[id(model.head.weight)] == 1.0
    assert by_param[id(model.blocks[1].mlp.fc1.weight)] == 0.5
    assert by_param[id(model.blocks[0].mlp.fc1.weight)] == 0.25
    assert by_param[id(model.patch_embed.proj.weight)] == 0.125


def test_color_jitter():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    assert torch.allclose(color_jitter(images, 0.0), images.float())
    out = color_jitter(images, 0.4, generator=g)
    assert out.dtype == torch.float32 and out.min() >= 0 and out.max() <= 255
    assert not torch.allclose(out, images.float())


def test_mixup_needs_an_even_batch():
    assert build_mixup(AugmentConfig(), 10, 0.1, 7) is None
    with pytest.raises(ConfigError, match="must be even"):
        build_mixup(AugmentConfig(mixup=0.8), 10, 0.1, 7)


def test_predict_prepares_images_exactly_as_the_shards_hold_them(probe_run, tmp_path):
    # predict once skipped EXIF rotation and turned 16-bit greyscale white, so its inputs differed from the shards.
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rotated = Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    exif = rotated.getexif()
    exif[0x0112] = 6  # shown rotated by 90 degrees
    rotated.save(src / "rotated.jpg", exif=exif)
    Image.fromarray(rng.integers(0, 65536, (24, 24), dtype=np.uint16)).save(src / "grey16.png")
    build_main([str(tmp_path / "src"), str(tmp_path / "shards"), "--val-fraction", "0", "--workers", "1"])
    _, info = load_split(tmp_path / "shards", "train")
    model, pre = predict.load_classifier(probe_run / "export")
    pre.record["data"] = {"encoder": info["encoder"]}  # the settings these shards were built with
    decoder = ImageDecoder(pre.model.img_size, train=False, eval_crop_pct=pre.crop_pct)
    for sample in shard_samples(tmp_path / "shards", "train"):  # with their .json, which the stream does not read
        source = json.loads(sample["json"])["source"]
        from_shard = decoder(sample["jpg"])
        by_predict = predict.prepared_image(src.parent / source, decoder, pre)
        assert torch.equal(by_predict, from_shard), source
