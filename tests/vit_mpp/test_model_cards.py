"""Model cards written with huggingface_hub's ModelCard (vit_mpp/models/hub.py): they parse with `ModelCard.load` and
carry their metadata (library, tags, the Hub dataset, the Hub model a fine-tuning started from, metrics as a
model-index), a real title, a snippet that loads the folder itself (the Hub line only when it is uploaded), and a
fine-tuned model's pretraining recipe, carried on from the export it started from; a mixture set by set (weight,
realised share, images) with the set that validated and fed the k-NN monitor, in its card and in the pretraining
section of a card fine-tuned from it. All offline: the Hub model is in a Hugging Face cache built locally."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard

from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.models import SMALL_MODEL, hub_cache
from tests.helpers.shards import write_shard_set
from vit_mpp.config.sections import ExportConfig, ModelConfig
from vit_mpp.data.manifest import data_record
from vit_mpp.models.export import Export, write_export
from vit_mpp.models.hub import architecture_label, model_card
from vit_mpp.models.vit import create_vit

PRETRAIN = {"steps": 1000, "batch_size": 4096, "target": "mean_color", "mask_ratio": 0.5, "optimizer": "adamw",
            "lr": 2e-4}


def hub_manifest() -> dict:
    """A manifest of shards that build-shards made from a dataset on the Hub."""
    return {"name": "textures", "source": {"kind": "hf", "path": "someone/textures", "loader": "hub"},
            "splits": {"train": {"num_samples": 100}, "val": {"num_samples": 20}}}


def test_a_pretraining_card_parses_with_its_metadata_and_loads_this_folder(tmp_path):
    torch.manual_seed(0)
    record = {"pretrain": PRETRAIN, "metrics": {"val_loss": 3.2, "knn_top1_cls": 0.61},
              "data": data_record("/data/textures", hub_manifest())}
    export = write_export(Export(tmp_path / "export", create_vit(SMALL_MODEL).state_dict(), SMALL_MODEL,
                                 mean=(0.5,) * 3, std=(0.5,) * 3, record=record), kind="encoder")
    card = model_card(export, ExportConfig(license="apache-2.0"))
    card.save(export / "README.md")
    loaded = ModelCard.load(export / "README.md")
    assert loaded.data.library_name == "timm" and loaded.data.license == "apache-2.0"
    assert {"vit-mpp", "masked-patch-prediction"} <= set(loaded.data.tags)
    assert loaded.data.datasets == ["someone/textures"] and loaded.data.pipeline_tag == "image-feature-extraction"
    (result,) = loaded.data.eval_results
    assert (result.metric_value, result.metric_name, result.dataset_type) == (
        0.61, "k-NN top-1 ([class] token)", "someone/textures")
    title = "ViT/4 (width 32, 1 block, 2 heads) pretrained by masked patch prediction on someone/textures"
    assert f"\n# {title}\n" in loaded.text and loaded.data.model_name == title
    assert f'timm.create_model("local-dir:{export}", pretrained=True)' in loaded.text
    assert "hf-hub:" not in loaded.text  # not uploaded: no Hub line, and no placeholder
    pushed = model_card(export, ExportConfig(push_to_hub="me/tiny-mpp")).text
    assert 'timm.create_model("hf-hub:me/tiny-mpp", pretrained=True)' in pushed and "local-dir:" in pushed


def test_a_named_size_is_titled_by_its_name():
    assert architecture_label(ModelConfig(name="vit_tiny_patch16_224"), 16) == "ViT-Tiny/16"
    assert architecture_label(ModelConfig(name="vit_base_patch16_224", img_size=384), 16) == "ViT-Base/16"
    assert architecture_label(ModelConfig(name="vit_small_patch16_224", patch_size=8), 8) == "ViT-Small/8"


def test_a_fine_tuning_from_a_hub_model_names_its_base_model_and_carries_the_pretraining(tmp_path, monkeypatch):
    from huggingface_hub import constants

    torch.manual_seed(0)
    record = {"pretrain": PRETRAIN, "data": data_record("/data/textures", hub_manifest())}
    write_export(Export(hub_cache(tmp_path / "hub", "someone/tiny-mpp"), create_vit(SMALL_MODEL).state_dict(),
                        SMALL_MODEL, mean=(0.5,) * 3, std=(0.5,) * 3, record=record), kind="encoder")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    shards = write_shard_set(tmp_path / "shards", {"train": [16], "val": [6]})
    run = tmp_path / "ft"
    finetune_main(["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run}",
                   "init.checkpoint=hf-hub:someone/tiny-mpp", "data.num_workers=0"])
    record = json.loads((run / "export" / "best" / "config.json").read_text())["vit_mpp"]
    assert record["pretrain"] == {**PRETRAIN, "data": "textures", "hf_dataset": "someone/textures"}
    assert record["finetune"]["base_model"] == "someone/tiny-mpp"
    loaded = ModelCard.load(run / "export" / "best" / "README.md")
    assert loaded.data.base_model == "someone/tiny-mpp" and loaded.data.pipeline_tag == "image-classification"
    assert loaded.data.datasets == ["someone/textures"]  # the pretraining's; the fine-tuning shards are local
    top1 = next(r for r in loaded.data.eval_results if r.metric_name == "top-1 accuracy")
    assert top1.metric_value == pytest.approx(record["metrics"]["val_top1"], abs=1e-4)
    assert top1.dataset_name == "test" and top1.dataset_split == "val"
    assert "\n# ViT/4 (width 32, 1 block, 2 heads) fine-tuned on test (3 classes)\n" in loaded.text
    assert "Pretraining (masked patch prediction)" in loaded.text and "| target | mean_color |" in loaded.text
    assert f'"local-dir:{run / "export" / "best"}"' in loaded.text and 'create_model("hf-hub:' not in loaded.text


def named_set(root, name: str, lengths: dict, seed: int):
    shards = write_shard_set(root / name, lengths, seed=seed)
    info = json.loads((shards / "_info.json").read_text())
    (shards / "_info.json").write_text(json.dumps({**info, "name": name}))
    return shards


def card_rows(text: str) -> dict[str, list[str]]:
    """The rows of a card's markdown tables, by their first cell."""
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_the_cards_of_a_two_set_mixture_give_every_set_and_what_validated_and_fed_the_knn_monitor(tmp_path):
    # `theirs` has no val split: evaluation and the k-NN monitor read `ours`, the first set that has one
    theirs = named_set(tmp_path, "theirs", {"train": [24]}, seed=1)
    ours = named_set(tmp_path, "ours", {"train": [16, 16], "val": [8]}, seed=2)
    pre = tmp_path / "pre"
    pretrain_main(["--config", "configs/pretrain/tiny.yaml", f"data.shards=[{theirs},{ours}]", "data.weights=[1,3]",
                   f"train.run_dir={pre}", "data.num_workers=0", "knn.train_images=16"])
    card = (pre / "export" / "README.md").read_text()
    assert "Data: a mixture of 2 sets" in card
    rows = card_rows(card)
    for name, shards, weight, images in (("theirs", theirs, "0.250", "24"), ("ours", ours, "0.750", "32")):
        assert rows[name][:2] == [str(shards), weight] and rows[name][3] == images
        assert float(rows[name][2]) == pytest.approx(float(weight), abs=0.15)  # the realised share, as logged
    assert rows["validated on"] == ["split 'val' of ours (8 images)"]
    assert rows["k-NN monitor references"] == ["the first 16 images of split 'train' of ours"]

    # fine-tuned from it: the card's pretraining section says the same
    ft = tmp_path / "ft"
    finetune_main(["--config", "configs/finetune/tiny.yaml", f"data.shards={ours}", f"train.run_dir={ft}",
                   f"init.checkpoint={pre / 'export'}", "data.num_workers=0", "train.epochs=1"])
    card = (ft / "export" / "README.md").read_text()
    assert "Pretraining data: a mixture of 2 sets" in card and "Pretraining data: validation and k-NN monitor" in card
    rows = card_rows(card)
    assert rows["theirs"][:2] == [str(theirs), "0.250"] and rows["ours"][:2] == [str(ours), "0.750"]
    assert rows["k-NN monitor references"] == ["the first 16 images of split 'train' of ours"]
    pretrained = json.loads((ft / "export" / "config.json").read_text())["vit_mpp"]["pretrain"]
    assert [m["name"] for m in pretrained["mixture"]] == ["theirs", "ours"] and pretrained["val"]["set"] == "ours"
