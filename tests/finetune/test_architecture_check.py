"""A fine-tuning checkpoint that names its architecture fixes it: a `model.*` architecture key the user set (in the
YAML file or as key=value, `model.name` included) that differs from it is one line, exit 2, before anything is
written; one that agrees, or one left to its default, is fine."""

from __future__ import annotations

import pytest
import torch
import yaml

from finetune.__main__ import main as finetune_main
from finetune.config import FinetuneConfig
from finetune.init_model import resolve_architecture
from tests.helpers.models import write_encoder_export
from tests.helpers.runs import run_tiny_finetune
from tests.helpers.shards import write_shard_set
from vit_mpp.config.engine import ConfigError, load_config
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.vit import create_vit
from vit_mpp.processes.exits import run_main

TINY = ModelConfig(name="vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    torch.manual_seed(0)
    return write_encoder_export(tmp_path_factory.mktemp("export"), create_vit(TINY), TINY)


@pytest.mark.parametrize("overrides, message", [
    (["model.name=vit_base_patch16_224"],
     "model.name=vit_base_patch16_224 (the checkpoint's is vit_tiny_patch16_224)"),
    (["model.embed_dim=64", "model.num_heads=2"], "model.embed_dim=64 (the checkpoint's is 32)"),
], ids=["name", "size"])
def test_a_user_set_architecture_key_that_differs_is_one_line_before_anything_is_written(
        export, demo_shards, overrides, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_main(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"init.checkpoint={export}",
                                 f"data.shards={demo_shards}", f"train.run_dir={run_dir}", *overrides])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: the checkpoint fixes the architecture") and message in err[0]
    assert not run_dir.exists()  # no config.yaml naming a model that was never trained


def test_timm_weights_with_a_size_the_models_patch_does_not_divide_is_one_line_before_anything_is_written(
        tmp_path, capsys):
    # A .pth names no architecture: model.name's patch (16) meets model.img_size (24) only when timm builds it,
    # which was after config.yaml had been written.
    torch.save(create_vit(TINY).state_dict(), tmp_path / "w.pth")
    shards = write_shard_set(tmp_path / "s", {"train": [8], "val": [4]})
    with pytest.raises(SystemExit) as e:
        run_main(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"init.checkpoint={tmp_path / 'w.pth'}",
                                 f"data.shards={shards}", f"train.run_dir={tmp_path / 'run'}"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and err == ["error: model.img_size 24x24 is not divisible by the patch size 16x16"]
    assert not (tmp_path / "run").exists()


def test_a_name_written_in_yaml_counts_and_one_that_agrees_or_is_left_out_is_fine(export, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"init:\n  checkpoint: {export}\nmodel:\n  name: vit_small_patch16_224\n  img_size: 24\n")
    with pytest.raises(ConfigError, match="model.name=vit_small_patch16_224"):
        cfg = load_config(FinetuneConfig, path)
        resolve_architecture(cfg.init, cfg.model)
    path.write_text(f"init:\n  checkpoint: {export}\nmodel:\n  name: vit_tiny_patch16_224\n  patch_size: 4\n")
    cfg = load_config(FinetuneConfig, path)
    resolve_architecture(cfg.init, cfg.model)  # the same as the export's: fine
    cfg = load_config(FinetuneConfig, None, [f"init.checkpoint={export}"])
    assert cfg.model.name == "vit_tiny_patch16_224"  # the default, not written: the export's name is used
    resolve_architecture(cfg.init, load_config(FinetuneConfig, None, [f"init.checkpoint={export}"]).model)
    # a default that differs from the export's is not the user's choice either
    small = ModelConfig(name="vit_small_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)
    other = write_encoder_export(tmp_path / "small", create_vit(small), small)
    resolve_architecture(load_config(FinetuneConfig, None, [f"init.checkpoint={other}"]).init,
                       load_config(FinetuneConfig).model)


def test_the_run_config_records_the_checkpoints_architecture_not_model_names_default(tmp_path):
    # An export of another architecture than model.name's default (vit_tiny_patch16_224), which the config does not
    # set: config.yaml (what evaluate, a resume and a reader of the run go by) names the model that was trained.
    small = ModelConfig(name="vit_small_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)
    torch.manual_seed(0)
    export = write_encoder_export(tmp_path / "small", create_vit(small), small)
    shards = write_shard_set(tmp_path / "s", {"train": [16], "val": [8]})
    run_tiny_finetune(shards, tmp_path / "run", export, "train.epochs=1")
    model = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert {k: model[k] for k in ("name", "patch_size", "embed_dim", "depth", "num_heads", "img_size")} == {
        "name": "vit_small_patch16_224", "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": 24}
    run_tiny_finetune(shards, tmp_path / "run", export, "train.epochs=2", "train.extend=true")  # resumes: same keys
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["name"] == "vit_small_patch16_224"
