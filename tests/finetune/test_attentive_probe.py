"""The attentive probe (`train.mode=attentive_probe`, finetune/modes.py): a frozen encoder read through timm's
attention pool (one learned query, one cross-attention block) and the zero-initialised linear head; only the pool and
the head train, the export is a timm classifier with its pool, and settings that contradict the mode are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from finetune import evaluate
from finetune.__main__ import main as finetune_main
from tests.helpers.processes import in_process
from tests.helpers.runs import read_metrics, run_tiny_finetune
from vit_mpp.models.pretrained import load_classifier, resize_pos_embed


@pytest.fixture(scope="module")
def attentive_run(shards, pretrained, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("attentive")
    run_tiny_finetune(shards, run_dir, pretrained, "train.mode=attentive_probe", "optim.name=adamw",
                      "optim.lr=3e-3", "train.epochs=3")
    return run_dir


def test_only_the_pool_and_the_head_train(attentive_run, pretrained):
    weights = load_file(attentive_run / "export" / "model.safetensors")
    for k, v in load_file(pretrained / "model.safetensors").items():  # the encoder, to the bit
        expected = resize_pos_embed(v, (4, 4), (6, 6), 1, "bilinear") if k == "pos_embed" else v
        torch.testing.assert_close(weights[k], expected, rtol=0, atol=0, msg=k)
    pool = sorted(k for k in weights if k.startswith("attn_pool."))
    assert "attn_pool.latent" in pool and "attn_pool.q.weight" in pool and "attn_pool.kv.weight" in pool
    assert torch.count_nonzero(weights["head.weight"]) > 0  # the zero head trained
    config = yaml.safe_load((attentive_run / "config.yaml").read_text())
    assert config["model"]["global_pool"] == "map" and config["train"]["mode"] == "attentive_probe"
    losses = [m["loss"] for m in read_metrics(attentive_run) if "loss" in m]
    assert losses[-1] < losses[0]


def test_its_export_is_a_timm_classifier_that_scores_as_the_run_did(attentive_run, shards, tmp_path):
    import timm

    model, pre = load_classifier(attentive_run / "export")
    assert model.attn_pool is not None and pre.model.global_pool == "map"
    plain = timm.create_model(f"local-dir:{attentive_run / 'export'}", pretrained=True).eval()
    images = torch.rand(2, 3, 24, 24)
    torch.testing.assert_close(plain(images), model(images), rtol=0, atol=0)
    report = evaluate.main(["--checkpoint", str(attentive_run / "export"), "--shards", str(shards), "--workers", "0",
                            "--out", str(tmp_path / "eval")])
    last = [m for m in read_metrics(attentive_run) if "val_top1" in m][-1]
    assert report["metrics"]["val_top1"] == last["val_top1"]
    assert report["metrics"]["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    card = json.loads((attentive_run / "export" / "config.json").read_text())
    assert card["vit_mpp"]["finetune"]["mode"] == "attentive_probe"


@pytest.mark.parametrize("settings, says", [
    (["train.mode=attentive_probe", "model.global_pool=avg"],
     "error: config key 'train.mode' attentive_probe reads the tokens through an attention pool, and "
     "model.global_pool is avg: leave model.global_pool out (the mode sets map)"),
    (["train.mode=linear_probe", "model.global_pool=map"],
     "error: config key 'model.global_pool' map is an attention pool that trains, and a linear probe trains the "
     "head alone: use train.mode=attentive_probe"),
])
def test_a_pool_that_contradicts_the_mode_is_one_line_before_anything_is_written(shards, pretrained, tmp_path,
                                                                                  capsys, settings, says):
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}",
                                              f"init.checkpoint={pretrained}", f"train.run_dir={tmp_path / 'run'}",
                                              *settings], capsys)
    assert code == 2 and err.strip() == says
    assert not (tmp_path / "run").exists()
