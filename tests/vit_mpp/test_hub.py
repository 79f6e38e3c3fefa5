"""Models that load the way people load models, offline (the Hub is not reachable here): the model card, the
upload of the export folder (with the Hub API replaced by a recorder), access checked before training (offline,
no token: one line), and init.checkpoint from a Hub cache made locally (cached works offline, uncached is one line).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

from finetune.config import InitConfig
from finetune.init_model import build_classifier
from tests.helpers.models import SMALL_MODEL, hub_cache, write_encoder_export
from tests.helpers.processes import REPO, subprocess_env
from tests.helpers.runs import run_tiny_pretrain
from vit_mpp.config.sections import ExportConfig, ModelConfig
from vit_mpp.models.hub import push
from vit_mpp.models.vit import create_vit
from vit_mpp.models.weight_files import CheckpointError


def test_the_final_export_has_a_model_card_from_its_record(demo_shards, tmp_path):
    run_tiny_pretrain(demo_shards, tmp_path, "export.license=apache-2.0")
    card = (tmp_path / "export" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: timm\n") and "- vit-mpp\n" in card and "license: apache-2.0" in card
    assert f'timm.create_model("local-dir:{tmp_path / "export"}", pretrained=True)' in card and "hf-hub:" not in card
    for fact in ("| target | mean_color |", "| steps | 6 |", "| train images |", "## Results", "| val_loss |",
                 "![curves](curves.png)"):
        assert fact in card, fact
    assert (tmp_path / "export" / "curves.png").is_file()


class RecordingApi:
    """Stands in for huggingface_hub.HfApi: records what would be uploaded."""

    calls: list[tuple] = []

    def create_repo(self, repo_id, private, exist_ok):
        self.calls.append(("create_repo", repo_id, private))
        return type("Repo", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, commit_message, ignore_patterns):
        files = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file())
        self.calls.append(("upload_folder", repo_id, files))


def test_push_uploads_the_folder_and_a_failure_keeps_the_export(tmp_path, monkeypatch):
    import huggingface_hub

    torch.manual_seed(0)
    write_encoder_export(tmp_path, create_vit(SMALL_MODEL), SMALL_MODEL)
    (tmp_path / "README.md").write_text("card")
    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    url = push(tmp_path, ExportConfig(push_to_hub="me/tiny-mpp"))
    assert url == "https://huggingface.co/me/tiny-mpp"
    assert RecordingApi.calls == [("create_repo", "me/tiny-mpp", True),
                                  ("upload_folder", "me/tiny-mpp", ["README.md", "config.json", "model.safetensors"])]

    def refuse(*args, **kwargs):
        raise ConnectionError("Hub unreachable")

    monkeypatch.setattr(RecordingApi, "upload_folder", refuse)
    with pytest.raises(Exception, match=r"the export is written to .*, but uploading it to me/tiny-mpp failed "
                                        r"\(ConnectionError: Hub unreachable\); upload it later with `hf upload"):
        push(tmp_path, ExportConfig(push_to_hub="me/tiny-mpp"))


@pytest.mark.parametrize("env, message", [
    ({"HF_HUB_OFFLINE": "1"}, "needs the Hugging Face Hub, but HF_HUB_OFFLINE is set"),
    ({"HF_TOKEN": ""}, "needs a Hugging Face token"),
], ids=["offline", "no_token"])
def test_push_to_hub_without_access_is_one_line_before_training(demo_shards, tmp_path, env, message):
    full_env = {**subprocess_env(), "HF_HOME": str(tmp_path / "hf"), **env}
    full_env.pop("HF_TOKEN", None) if env.get("HF_TOKEN") == "" else None
    result = subprocess.run([sys.executable, "-m", "pretrain", "--config", "configs/pretrain/tiny.yaml",
                             f"data.shards={demo_shards}", f"train.run_dir={tmp_path / 'run'}",
                             "export.push_to_hub=me/tiny-mpp"], capture_output=True, text=True, timeout=300,
                            env=full_env, cwd=REPO)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_init_from_a_cached_hub_model_works_offline_and_an_uncached_one_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    torch.manual_seed(0)
    encoder = create_vit(SMALL_MODEL)
    write_encoder_export(hub_cache(tmp_path, "someone/tiny-mpp"), encoder, SMALL_MODEL, mean=(0.1, 0.2, 0.3))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    init = InitConfig(checkpoint="hf-hub:someone/tiny-mpp")
    model, mean, _, cfg = build_classifier(init, ModelConfig(img_size=24), 3)
    assert cfg.embed_dim == 32 and mean == (0.1, 0.2, 0.3) and model.patch_embed.grid_size == (6, 6)
    torch.testing.assert_close(model.blocks[0].mlp.fc1.weight, encoder.blocks[0].mlp.fc1.weight)
    loaded = timm.create_model("hf-hub:someone/tiny-mpp", pretrained=True)  # timm reads the same cache
    torch.testing.assert_close(loaded.pos_embed, encoder.pos_embed)
    for missing in ("hf-hub:someone/not-cached", "vit_tiny_patch16_224.augreg_in21k"):
        with pytest.raises(CheckpointError, match="not in the local cache and the Hugging Face Hub not reachable") as e:
            build_classifier(InitConfig(checkpoint=missing), ModelConfig(img_size=24), 3)
        assert "\n" not in str(e.value)
