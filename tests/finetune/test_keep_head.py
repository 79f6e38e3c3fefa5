"""`init.keep_head`: a second fine-tuning goes on from a fine-tuned export with its classifier (Semi-ViT's second
stage starts from its first), and every checkpoint that cannot give it this run's classifier is one line before
anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from finetune.__main__ import main as finetune_main
from finetune.config import InitConfig
from finetune.init_model import build_classifier
from tests.helpers.processes import in_process
from tests.helpers.runs import read_metrics, run_tiny_finetune
from tests.helpers.shards import write_shard_set
from vit_mpp.config.sections import ModelConfig


def test_the_kept_head_is_the_exports_and_the_run_goes_on_from_its_accuracy(shards, probe_run, tmp_path):
    export = probe_run / "export"
    saved = load_file(export / "model.safetensors")
    model, *_ = build_classifier(InitConfig(checkpoint=str(export), keep_head=True), ModelConfig(img_size=16), 3)
    assert torch.equal(model.head.weight, saved["head.weight"]) and torch.equal(model.head.bias, saved["head.bias"])
    zero, *_ = build_classifier(InitConfig(checkpoint=str(export)), ModelConfig(img_size=16), 3)
    assert torch.count_nonzero(zero.head.weight) == 0  # without it, the paper's zero head

    # A run that trains next to nothing (lr 1e-12) scores what the export scored: it starts from its classifier
    before = [r for r in read_metrics(probe_run) if "val_top1" in r][-1]["val_top1"]
    run_tiny_finetune(shards, tmp_path / "again", export, "init.keep_head=true", "train.mode=linear_probe",
                      "optim.lr=1e-12", "train.epochs=1")
    after = [r for r in read_metrics(tmp_path / "again") if "val_top1" in r][-1]["val_top1"]
    assert after == before


@pytest.mark.parametrize("case, says", [
    ("no checkpoint", "error: config key 'init.keep_head' keeps the classifier of the export fine-tuning starts from, "
                      "and init.checkpoint is empty (from scratch): give a finetune run's export, or leave "
                      "init.keep_head out"),
    ("an encoder", "has no classifier head (an encoder export): leave init.keep_head out, and the classifier starts "
                   "from a zero head"),
    ("other classes", "has 3 classes (a, b, c), this run's data 4 (a, b, c, d): a kept head must name the same "
                      "classes; leave init.keep_head out for a zero head"),
    ("other pooling", "reads model.global_pool=token, this run's is avg: set model.global_pool=token"),
])
def test_a_checkpoint_that_cannot_give_this_runs_classifier_is_one_line(shards, probe_run, pretrained, tmp_path,
                                                                        capsys, case, says):
    data, init, extra = shards, probe_run / "export", []
    if case == "no checkpoint":
        init = ""
    elif case == "an encoder":
        init = pretrained
    elif case == "other classes":
        data = write_shard_set(tmp_path / "four", {"train": [8], "val": [4]}, labels={"train": [0, 1, 2, 3] * 2,
                                                                                      "val": [0, 1, 2, 3]})
        manifest = json.loads((data / "_info.json").read_text())
        manifest.update(num_classes=4, class_names=["a", "b", "c", "d"])
        (data / "_info.json").write_text(json.dumps(manifest))
    elif case == "other pooling":
        extra = ["model.global_pool=avg"]
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={data}",
                                              f"init.checkpoint={init}", "init.keep_head=true",
                                              f"train.run_dir={tmp_path / 'run'}", *extra], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert err.startswith("error: ") and not (tmp_path / "run").exists()
