"""The hand-off format (vit_mpp/models/export.py) and the one route from a checkpoint to a model
(vit_mpp/models/pretrained.py):
exports load in timm exactly, predict and analysis rebuild the trained classifier exactly (token and avg pooling),
older exports still load, and an interrupted export is never half-visible."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

from analysis.analyze import load_model
from finetune import predict
from finetune.__main__ import main as finetune_main
from finetune.config import InitConfig
from finetune.init_model import build_classifier
from tests.helpers.models import SMALL_MODEL
from tests.helpers.shards import write_shard_set
from vit_mpp.config.engine import to_dict
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.export import Export, ExportError, read_export, write_export
from vit_mpp.models.pretrained import read_pretrained
from vit_mpp.models.vit import create_vit


def classifier(pool: str, seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(SMALL_MODEL, img_size=[16, 24], global_pool=pool)
    model = create_vit(cfg, num_classes=3).eval()
    torch.nn.init.normal_(model.head.weight)  # a trained-looking head: zero would hide differences
    return model, cfg


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_a_classifier_export_is_a_timm_local_dir_model(tmp_path, pool):
    model, cfg = classifier(pool)
    write_export(Export(tmp_path, model.state_dict(), cfg, num_classes=3, mean=(0.2, 0.3, 0.4), std=(0.5, 0.6, 0.7),
                        crop_pct=0.9, class_names=["ant", "bee", "cat"]), kind="classifier")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == "vit_tiny_patch16_224" and config["num_classes"] == 3
    assert config["label_names"] == ["ant", "bee", "cat"] and config["global_pool"] == pool
    assert config["pretrained_cfg"]["input_size"] == [3, 16, 24] and config["pretrained_cfg"]["crop_pct"] == 0.9
    assert config["pretrained_cfg"]["mean"] == [0.2, 0.3, 0.4] and "license" not in config["pretrained_cfg"]
    loaded = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    x = torch.randn(2, 3, 16, 24)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_with_a_timm_whose_config_writer_takes_no_data_config_the_export_records_the_same(tmp_path, monkeypatch):
    """timm before 1.0.30 (the GPU machines' image had 1.0.29): the preprocessing is set in pretrained_cfg by us."""
    import timm.models._hub as hub

    model, cfg = classifier("token")
    export = Export(tmp_path / "new", model.state_dict(), cfg, num_classes=3, mean=(0.2, 0.3, 0.4),
                    std=(0.5, 0.6, 0.7), crop_pct=0.9)
    write_export(export, kind="classifier")
    writer = hub.save_config_for_hf
    def old_writer(model, config_path: Path, model_config=None):  # timm 1.0.29's signature; it calls .open()
        assert isinstance(config_path, Path)
        writer(model, config_path, model_config=model_config)

    monkeypatch.setattr(hub, "save_config_for_hf", old_writer)
    write_export(dataclasses.replace(export, path=tmp_path / "old"), kind="classifier")
    new, old = (json.loads((tmp_path / d / "config.json").read_text())["pretrained_cfg"] for d in ("new", "old"))
    assert {k: old[k] for k in ("mean", "std", "crop_pct", "crop_mode", "interpolation")} == {
        k: new[k] for k in ("mean", "std", "crop_pct", "crop_mode", "interpolation")}
    assert old["mean"] == [0.2, 0.3, 0.4] and old["crop_pct"] == 0.9
    loaded = timm.create_model(f"local-dir:{tmp_path / 'old'}", pretrained=True).eval()
    x = torch.randn(2, 3, 16, 24)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, encoder_export):
    """Two tiny fine-tuning runs from the same pretraining export, with token and with avg pooling."""
    root = tmp_path_factory.mktemp("trained")
    shards = write_shard_set(root / "shards", {"train": [16], "val": [5]})
    runs = {}
    for pool in ("token", "avg"):
        runs[pool] = root / pool
        finetune_main(["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}", f"train.run_dir={runs[pool]}",
                       f"init.checkpoint={encoder_export}", "data.num_workers=0", "train.epochs=1",
                       f"model.global_pool={pool}", "optim.lr=0.5"])
    return runs


@pytest.mark.parametrize("pool", ["token", "avg"])
def test_predict_and_analysis_rebuild_the_trained_classifier_exactly(trained, pool):
    run = trained[pool]
    # The model as training built it: its resolved config, with the exported weights loaded strictly.
    ft = read_export(run / "export")
    assert ft.model.global_pool == pool and ft.record["kind"] == "classifier"
    reference = create_vit(ft.model, num_classes=ft.num_classes).eval()
    reference.load_state_dict(ft.state)
    assert torch.count_nonzero(reference.head.weight) > 0
    x = torch.randn(4, 3, 24, 24)  # the training resolution of configs/finetune/tiny.yaml
    expected = reference(x)
    by_predict, pre = predict.load_classifier(run / "export")
    by_analysis, mean, std, _ = load_model(str(run / "export"), None, None)
    torch.testing.assert_close(by_predict(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(by_analysis(x), expected, rtol=0, atol=0)
    assert (mean, std) == (pre.mean, pre.std)
    other = "avg" if pool == "token" else "token"  # the test can tell the two apart
    wrong = create_vit(dataclasses.replace(ft.model, global_pool=other), num_classes=ft.num_classes).eval()
    wrong.load_state_dict(ft.state)
    assert not torch.allclose(wrong(x), expected)


def test_older_exports_still_load(tmp_path):
    torch.manual_seed(0)
    encoder = create_vit(SMALL_MODEL)
    save_file(encoder.state_dict(), str(tmp_path / "encoder.safetensors"))
    (tmp_path / "encoder.json").write_text(json.dumps({"model": to_dict(SMALL_MODEL), "mean": [0.1, 0.2, 0.3],
                                                       "std": [0.4, 0.5, 0.6], "pretrain": {"steps": 3}}))
    pre = read_pretrained(str(tmp_path), ModelConfig())
    assert pre.model == SMALL_MODEL and pre.mean == (0.1, 0.2, 0.3) and pre.record["pretrain"] == {"steps": 3}
    model, mean, _, cfg = build_classifier(InitConfig(checkpoint=str(tmp_path)), ModelConfig(img_size=24), 3)
    assert cfg.embed_dim == 32 and mean == (0.1, 0.2, 0.3)
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight, encoder.blocks[0].attn.qkv.weight)


def test_an_export_killed_between_its_renames_is_completed_on_read(tmp_path, monkeypatch):
    first, cfg = classifier("token", seed=0)
    second, _ = classifier("token", seed=1)
    kwargs = dict(num_classes=3, mean=(0.5,) * 3, std=(0.5,) * 3)
    write_export(Export(tmp_path, first.state_dict(), cfg, **kwargs), kind="classifier")
    real_replace = os.replace
    calls = []

    def replace_then_die(src, dst):  # the second rename (the weights) never happens: killed
        calls.append(Path(dst).name)
        if Path(dst).name == "model.safetensors":
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        write_export(Export(tmp_path, second.state_dict(), cfg, **kwargs), kind="classifier")
    monkeypatch.setattr(os, "replace", real_replace)
    assert calls == ["config.json", "model.safetensors"]
    ex = read_export(tmp_path)  # config.json is the second export's: its weights are taken from the .new file
    torch.testing.assert_close(ex.state["head.weight"], second.state_dict()["head.weight"])
    assert not (tmp_path / "model.safetensors.new").exists()
    x = torch.randn(1, 3, 16, 24)
    torch.testing.assert_close(timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()(x), second(x))


def test_an_export_killed_before_its_renames_keeps_the_previous_one(tmp_path):
    first, cfg = classifier("token", seed=0)
    second, _ = classifier("token", seed=1)
    kwargs = dict(num_classes=3, mean=(0.5,) * 3, std=(0.5,) * 3)
    write_export(Export(tmp_path, first.state_dict(), cfg, **kwargs), kind="classifier")
    (tmp_path / "model.safetensors.new").write_bytes(b"half a file")  # a kill while the new weights were written
    torch.testing.assert_close(read_export(tmp_path).state["head.weight"], first.state_dict()["head.weight"])


def test_weights_that_do_not_fit_are_not_exported(tmp_path):
    model, cfg = classifier("token")
    state = {k: v for k, v in model.state_dict().items() if k != "norm.bias"}
    with pytest.raises(ExportError, match=r"missing \['norm.bias'\]"):
        write_export(Export(tmp_path, state, cfg, num_classes=3, mean=(0.5,) * 3, std=(0.5,) * 3), kind="classifier")
    assert not (tmp_path / "config.json").exists()
