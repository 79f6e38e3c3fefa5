"""Watching a run: experiment trackers (TensorBoard event files with the expected scalars and the flattened
config), curves.png for every run and `python -m analysis plot` overlaying runs, and the k-NN monitor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from analysis.plot_runs import main as plot_main
from pretrain.__main__ import main as pretrain_main
from pretrain.probes import probe_top1
from tests.helpers.disks import small_disk
from tests.helpers.processes import REPO, in_process, subprocess_env
from tests.helpers.runs import read_metrics, run_tiny_pretrain
from tests.helpers.shards import write_shard_set
from vit_mpp.durable import WriteFailed
from vit_mpp.models.knn import knn_top1
from vit_mpp.processes.exits import run_main
from vit_mpp.tools.figures import pyplot, save_figure


def tiny_pretrain(shards: Path, run_dir: Path, *overrides: str) -> None:
    run_tiny_pretrain(shards, run_dir, "train.steps=4", "train.eval_every=2", "train.log_every=1", *overrides)


@pytest.fixture(scope="module")
def watched(demo_shards, tmp_path_factory) -> Path:
    """One run on labelled shards watched every way (the tests below read it): TensorBoard (project demo), curves.png,
    and the k-NN monitor on 40 labelled training and 16 validation images, with its probes."""
    run_dir = tmp_path_factory.mktemp("watched")
    tiny_pretrain(demo_shards, run_dir, "train.trackers=[tensorboard]", "train.project=demo", "knn.train_images=40",
                  "knn.val_images=16", "knn.probe_epochs=3")
    return run_dir


def test_tensorboard_receives_the_scalars_and_the_flattened_config(watched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted((watched / "logs" / "demo").rglob("events.out.tfevents.*"))
    scalars = {}
    for path in events:
        acc = EventAccumulator(str(path))
        acc.Reload()
        scalars.update({tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]})
    for tag in ("train/loss", "train/acc", "train/lr", "train/img_per_s", "train/frac_mask", "val/loss", "val/acc",
                "knn/top1_cls"):  # grouped by vit_mpp/run/metering/tracking.py's rule (tests/test_trackers.py)
        assert tag in scalars, sorted(scalars)
    assert len(scalars["train/loss"]) == 4 and len(scalars["val/loss"]) == 2
    assert scalars["train/loss"] == pytest.approx([r["loss"] for r in read_metrics(watched) if "loss" in r])
    hparams = b"".join(p.read_bytes() for p in events)
    assert b"optim.base_lr" in hparams and b"mpp.mask_ratio" in hparams  # the config, flattened to dotted keys


def test_a_tracker_whose_package_is_missing_is_one_line_before_training(demo_shards, tmp_path, capsys):
    code, _, err = in_process(pretrain_main, ["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}",
                                              f"train.run_dir={tmp_path / 'run'}", "train.trackers=[aim]"], capsys)
    assert code == 2, err
    assert err.strip().splitlines() == [
        "error: train.trackers names aim, but its package aim is not installed: pip install aim, or remove it "
        "from train.trackers"]
    assert not (tmp_path / "run").exists()  # before anything was written


def test_curves_are_drawn_at_the_end_not_at_every_evaluation_of_a_short_run(demo_shards, tmp_path, monkeypatch):
    """A draw takes a second or two, which the other ranks wait: drawn at an evaluation only a minute or more after
    the last draw (the full-disk test of the figure replaced draws at every one: tests/vit_mpp)."""
    from vit_mpp.run.metering import step_meter

    drawn, real = [], step_meter.write_run_curves
    monkeypatch.setattr(step_meter, "write_run_curves", lambda run_dir: drawn.append(run_dir) or real(run_dir))
    tiny_pretrain(demo_shards, tmp_path / "run", "knn.train_images=0")
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "val_loss" in r] == [2, 4]
    assert len(drawn) == 1 and (tmp_path / "run" / "curves.png").is_file()


def test_every_run_draws_its_curves_and_plot_overlays_runs(watched, demo_shards, tmp_path, capsys):
    tiny_pretrain(demo_shards, tmp_path / "pixels", "mpp.target=l2", "knn.train_images=0")
    for run_dir in (watched, tmp_path / "pixels"):  # mean colour (the default target) and L2
        with Image.open(run_dir / "curves.png") as im:
            assert im.width > 800 and im.height > 300
    plot_main([str(watched), str(tmp_path / "pixels"), "--labels", "mean colour", "L2",
               "--out", str(tmp_path / "both.png")])
    with Image.open(tmp_path / "both.png") as im:
        assert im.width > 800
    for argv, message in (([str(watched), str(tmp_path / "pixels"), "--labels", "one"], "--labels gives"),
                          ([str(tmp_path / "nowhere")], "has no metrics.jsonl"),
                          # one curve silently replaced the other (a plot of 1 run)
                          ([str(watched), str(tmp_path / "pixels"), "--labels", "a", "a"], "--labels names 'a' twice"),
                          ([str(watched), str(watched) + "/"],
                           f"run directory {watched}/ is named twice (as {watched} and {watched}/)"),
                          # matplotlib wrote a PDF, or failed with a traceback, whatever the suffix said
                          ([str(watched), "--out", str(tmp_path / "curves.txt")], "a figure is written as"),
                          # matplotlib's traceback after the metrics were read
                          ([str(watched), "--out", "/proc/curves.png"], "/proc/curves.png cannot be written: ")):
        with pytest.raises(SystemExit) as e:
            run_main(plot_main, argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_figure_that_cannot_be_written_is_one_error_and_the_old_figure_is_kept_whole(tmp_path):
    """A real full disk (a small tmpfs): the figure is drawn in memory and written under a temporary name, so the
    failed write is one line and the figure from before is still there, whole."""
    with small_disk(tmp_path / "disk", 64) as disk:
        old = disk / "curves.png"
        plt = pyplot()
        fig = plt.figure()
        plt.plot([1, 2])
        save_figure(fig, old)
        before = old.read_bytes()
        (disk / "filler").write_bytes(b"x" * (64 * 1024 - len(before) - 8192))
        fig = plt.figure(figsize=(12, 12))
        plt.imshow(torch.rand(400, 400, 3).numpy())  # noise: a PNG far larger than the room left
        with pytest.raises(WriteFailed, match=f"^{old} cannot be written: no space left on device; .*MB free there; "
                                              "free some space, then run the same command to go on$"):
            save_figure(fig, old)
        assert old.read_bytes() == before and sorted(p.name for p in disk.iterdir()) == ["curves.png", "filler"]


def test_matplotlib_is_imported_at_the_first_figure_not_as_a_run_starts():
    """Half a second of every process's start-up (every rank, every evaluate and predict) went to importing
    matplotlib for the figure drawn at the end, if any."""
    code = ("import sys, pretrain.train, finetune.train, finetune.evaluate, finetune.predict, experiments.compare\n"
            "assert 'matplotlib' not in sys.modules, 'imported at start-up'\n"
            "from vit_mpp.tools.figures import pyplot\n"
            "assert pyplot().get_backend().lower() == 'agg' and 'matplotlib' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=subprocess_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]


def test_knn_top1_on_separable_and_on_random_features():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 5
    ref_y, query_y = torch.arange(200) % 4, torch.arange(100) % 4
    ref = centres[ref_y] + torch.randn(200, 16, generator=g)
    query = centres[query_y] + torch.randn(100, 16, generator=g)
    assert knn_top1(ref, ref_y, query, query_y, k=20, temperature=0.07) == 1.0
    noise = knn_top1(torch.randn(200, 16, generator=g), ref_y, torch.randn(100, 16, generator=g), query_y, 20, 0.07)
    assert noise < 0.5  # chance is 0.25


def test_the_probes_learn_what_the_tokens_carry_and_give_the_same_number_twice():
    g = torch.Generator().manual_seed(0)
    ref_y, query_y = torch.arange(120) % 3, torch.arange(60) % 3
    where = torch.randint(0, 5, (180,), generator=g)  # the class is in one patch token, a different one per image
    tokens = torch.randn(180, 6, 16, generator=g)
    tokens[torch.arange(180), 1 + where] += 8 * torch.eye(16)[torch.cat([ref_y, query_y])]
    ref, query = tokens[:120], tokens[120:]
    attentive = probe_top1(ref, ref_y, query, query_y, epochs=40, heads=2)
    assert attentive >= 0.9 and attentive == probe_top1(ref, ref_y, query, query_y, epochs=40, heads=2)
    assert probe_top1(ref, ref_y, query, query_y, epochs=40) < 0.6  # the [class] token (token 0) carries nothing
    tokens[:, 0] = 6 * torch.eye(16)[torch.cat([ref_y, query_y])] + torch.randn(180, 16, generator=g)
    assert probe_top1(tokens[:120], ref_y, tokens[120:], query_y, epochs=40) >= 0.9


def test_the_knn_monitor_reports_on_labelled_shards_and_stays_off_without_labels(watched, tmp_path, capsys):
    evals = [r for r in read_metrics(watched) if "val_loss" in r]
    assert len(evals) == 2 and all(0 <= r["knn_top1_cls"] <= 1 and 0 <= r["knn_top1_avg"] <= 1 for r in evals)
    assert all(0 <= r["knn_probe_linear"] <= 1 and 0 <= r["knn_probe_attentive"] <= 1 for r in evals)
    unlabelled = write_shard_set(tmp_path / "unlabelled", {"train": [24], "val": [24]},
                                 labels={"train": [None] * 24, "val": [None] * 24})
    capsys.readouterr()
    tiny_pretrain(unlabelled, tmp_path / "plain", "knn.train_images=16", "knn.val_images=8")
    assert "note: the k-NN monitor is off: the shards carry no labels" in capsys.readouterr().out
    assert not any("knn_top1_cls" in r for r in read_metrics(tmp_path / "plain"))
