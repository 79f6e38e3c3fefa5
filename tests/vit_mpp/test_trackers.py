"""Trackers that group and compare (vit_mpp/run/metering/tracking.py), read back from TensorBoard's event files: a run
lands in its own folder named after `train.run_name`, its scalars are grouped (`train/`, `val/`, `knn/`), its
hyperparameters sit in the same run with its final metrics (not in a separate sub-run), and curves.png and the confusion
matrix arrive as images."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.models import SMALL_MODEL, write_encoder_export
from vit_mpp.models.vit import create_vit
from vit_mpp.run.metering.tracking import tensorboard_folder, tracker_key

pytest.importorskip("tensorboard")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def event_folders(logs: Path) -> set[Path]:
    return {p.parent for p in logs.rglob("events.out.tfevents.*")}


def read_run(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], dict, list[str]]:
    """(scalars tag -> [(step, value)], hparams plugin data by tag, image tags) of one TensorBoard run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    hparams = {}
    for tag, content in acc.PluginTagToContent("hparams").items():
        data = plugin_data_pb2.HParamsPluginData()
        data.ParseFromString(content)
        hparams[tag] = data
    return scalars, hparams, acc.Tags()["images"]


def test_the_naming_rule():
    assert [tracker_key(k) for k in ("loss", "lr", "acc", "epoch", "img_per_s", "frac_mask")] == [
        "train/loss", "train/lr", "train/acc", "train/epoch", "train/img_per_s", "train/frac_mask"]
    assert [tracker_key(k) for k in ("val_loss", "val_top1", "knn_top1_cls", "ema_val_top1")] == [
        "val/loss", "val/top1", "knn/top1_cls", "ema/val_top1"]
    assert tensorboard_folder("runs/demo/pretrain") == "runs_demo_pretrain"
    assert tensorboard_folder("lr=1e-3 bs=64") == "lr=1e-3_bs=64"


def test_a_pretraining_run_is_one_named_tensorboard_run_with_grouped_scalars_and_its_hparams(demo_shards, tmp_path):
    pretrain_main(["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}", f"train.run_dir={tmp_path}",
                   "data.num_workers=0", "train.steps=4", "train.eval_every=2", "train.log_every=1",
                   "train.trackers=[tensorboard]", "train.project=demo", "train.run_name=mask half"])
    run = tmp_path / "logs" / "demo" / "mask_half"
    assert event_folders(tmp_path / "logs") == {run}  # one run, no separate timestamped hparams sub-run
    scalars, hparams, images = read_run(run)
    logged = records(tmp_path)
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in logged if "loss" in r])
    for tag in ("train/lr", "train/acc", "train/frac_mask", "val/loss", "val/acc", "knn/top1_cls"):
        assert tag in scalars, sorted(scalars)
    assert not any(tag in scalars for tag in ("loss", "val_loss", "train/elapsed_s"))  # no flat names
    assert [s for s, _ in scalars["val/loss"]] == [2, 4]
    last_eval = [r for r in logged if "val_loss" in r][-1]
    assert scalars["final/val_loss"] == [(4, pytest.approx(last_eval["val_loss"]))]
    assert scalars["best/val_loss"][0][1] == pytest.approx(min(r["val_loss"] for r in logged if "val_loss" in r))
    # The hyperparameters, in this run, with the final metrics as the HPARAMS tab's metric columns.
    experiment = next(d.experiment for d in hparams.values() if d.HasField("experiment"))
    start = next(d.session_start_info for d in hparams.values() if d.HasField("session_start_info"))
    assert {"final/val_loss", "final/knn_top1_cls", "best/val_loss"} <= {m.name.tag for m in experiment.metric_infos}
    assert start.hparams["mpp.mask_ratio"].number_value == 0.5 and start.hparams["train.run_name"].string_value
    assert start.hparams["optim.name"].string_value == "adamw" and "optim.base_lr" in start.hparams
    assert "curves" in images


def test_a_fine_tuning_run_sends_its_top1_and_its_confusion_matrix(tmp_path):
    from tests.helpers.shards import write_shard_set

    shards = write_shard_set(tmp_path / "shards", {"train": [16], "val": [6]})
    cfg = SMALL_MODEL
    torch.manual_seed(0)
    write_encoder_export(tmp_path / "pre", create_vit(cfg), cfg)
    run_dir = tmp_path / "ft"
    finetune_main(["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}",
                   f"init.checkpoint={tmp_path / 'pre'}", "data.num_workers=0", "train.trackers=[tensorboard]"])
    # no train.run_name: the run directory's path names the run
    (run,) = event_folders(run_dir / "logs")
    assert run == run_dir / "logs" / "vit-mpp" / tensorboard_folder(str(run_dir))
    scalars, hparams, images = read_run(run)
    last_eval = [r for r in records(run_dir) if "val_top1" in r][-1]
    assert "train/epoch" in scalars and "val/top1" in scalars and "val/samples" in scalars
    assert scalars["final/val_top1"][0][1] == pytest.approx(last_eval["val_top1"])
    assert "best/val_top1" in scalars and hparams
    assert {"curves", "val/confusion_matrix"} <= set(images)


def test_a_resumed_run_shows_each_step_once(demo_shards, tmp_path):
    argv = ["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}", f"train.run_dir={tmp_path}",
            "data.num_workers=0", "train.steps=6", "train.ckpt_every=3", "train.log_every=1", "train.eval_every=0",
            "knn.train_images=0", "train.trackers=[tensorboard]", "train.run_name=r"]
    pretrain_main(argv)
    # A run killed after its step-3 checkpoint leaves this behind; re-running resumes at step 3 and logs 4-6 again.
    shutil.rmtree(tmp_path / "checkpoints" / "step_000006")
    pretrain_main(argv)
    scalars, _, _ = read_run(tmp_path / "logs" / "vit-mpp" / "r")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]  # the killed run's 4-6 purged
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in records(tmp_path) if "loss" in r])
