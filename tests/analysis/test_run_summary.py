"""`python -m analysis summary RUN_DIR ...`: one row per run (settings from config.yaml, final and best metrics and
wall time from metrics.jsonl) as markdown, and as CSV on request; a folder that is no run directory is one line."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from analysis.run_table import columns, run_row, terminal_table
from analysis.run_table import main as summary_main
from finetune.config import FinetuneConfig
from pretrain.__main__ import main as pretrain_main
from pretrain.config import PretrainConfig
from tests.helpers.processes import run_module
from vit_mpp.config.engine import load_config, save_config
from vit_mpp.processes.exits import run_main
from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.run.metering.summary import wall_time_s


def make_run(run_dir: Path, cls: type, overrides: list[str], records: list[dict]) -> Path:
    """A run directory as a run leaves it: its resolved config.yaml and its metrics.jsonl."""
    run_dir.mkdir(parents=True)
    save_config(load_config(cls, None, [f"train.run_dir={run_dir}", *overrides]), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


@pytest.fixture()
def runs(tmp_path) -> tuple[Path, Path]:
    pre = make_run(tmp_path / "pre", PretrainConfig, [
        "model.img_size=32", "data.shards=/data/textures", "train.steps=4", "train.batch_size=256",
        "optim.base_lr=2e-4", "mpp.mask_ratio=0.15", "train.run_name=mpp 15%"], [
        {"step": 2, "loss": 5.0, "lr": 1e-5, "elapsed_s": 10.0},
        {"step": 2, "val_loss": 4.5, "val_acc": 0.10, "knn_top1_cls": 0.40, "elapsed_s": 12.0},
        {"step": 4, "loss": 4.0, "lr": 1e-6, "elapsed_s": 20.0},
        {"step": 4, "val_loss": 4.7, "val_acc": 0.12, "knn_top1_cls": 0.35, "elapsed_s": 23.0}])
    ft = make_run(tmp_path / "ft", FinetuneConfig, [
        "data.shards=/data/textures", "train.epochs=3", "init.checkpoint=runs/pre/export", "optim.lr=0.03"], [
        {"step": 10, "epoch": 1.0, "loss": 1.2, "elapsed_s": 30.0},
        {"step": 10, "val_loss": 1.1, "val_top1": 0.60, "val_samples": 20, "elapsed_s": 31.0},
        {"step": 30, "epoch": 3.0, "loss": 0.9, "elapsed_s": 90.0},
        {"step": 30, "val_loss": 1.0, "val_top1": 0.55, "val_samples": 20, "elapsed_s": 92.5}])
    return pre, ft


def test_two_runs_are_two_rows_in_markdown_and_in_csv(runs, tmp_path, capsys):
    pre, ft = runs
    rows = summary_main([str(pre), str(ft), "--csv", str(tmp_path / "runs.csv")])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 4 and lines[1].startswith("| --- |")  # header, rule, one row per run
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    pre_row = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert pre_row["name"] == "mpp 15%" and pre_row["stage"] == "pretrain" and pre_row["target"] == "mean_color"
    assert pre_row["mask_ratio"] == "0.15" and pre_row["lr"] == "1.25e-05" and pre_row["steps"] == "4"
    assert pre_row["final val_loss"] == "4.7000" and pre_row["best val_loss"] == "4.5000"
    assert pre_row["best knn_top1_cls"] == "0.4000" and pre_row["wall time"] == "0m23s"
    assert pre_row["model"] == "vit_tiny_patch16_224 @32" and pre_row["data"] == "/data/textures"
    ft_row = dict(zip(head, (c.strip() for c in lines[3].strip("|").split("|"))))
    assert (ft_row["stage"], ft_row["mode"], ft_row["init"], ft_row["epochs"]) == (
        "finetune", "finetune", "runs/pre/export", "3")
    assert ft_row["final val_top1"] == "0.5500" and ft_row["best val_top1"] == "0.6000" and ft_row["lr"] == "0.03"
    with open(tmp_path / "runs.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["run"] for r in table] == [str(pre), str(ft)] and list(table[0]) == head[:-1] + ["wall_s"]
    assert float(table[1]["best val_top1"]) == 0.6 and float(table[1]["wall_s"]) == 92.5
    assert float(table[0]["wall_s"]) == 23.0 and table[0]["epochs"] == "" and rows[1]["steps"] == 30


def test_on_a_terminal_the_table_is_turned_a_column_per_run(runs):
    import io

    from rich.console import Console

    rows = [run_row(d) for d in runs]
    out = io.StringIO()
    terminal_table(rows, columns(rows), Console(file=out, width=100, color_system=None))
    lines = {ln.split()[0] + (" " + ln.split()[1] if ln.split()[0] in ("final", "best", "wall") else ""): ln
             for ln in out.getvalue().splitlines() if ln.strip()}
    assert "mpp 15%" in lines["name"] and "ft" in lines["name"]
    assert "0.6000" in lines["best val_top1"] and "0m23s" in lines["wall time"]


def test_a_resumed_runs_time_goes_on_from_its_records(demo_shards, tmp_path):
    argv = ["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}", f"train.run_dir={tmp_path}",
            "data.num_workers=0", "train.steps=6", "train.ckpt_every=3", "train.log_every=1", "train.eval_every=0",
            "knn.train_images=0"]
    pretrain_main(argv)
    first = {r["step"]: r["elapsed_s"] for r in read_metrics(tmp_path)}
    shutil.rmtree(tmp_path / "checkpoints" / "step_000006")  # killed after its step-3 checkpoint: resumes at 3
    pretrain_main(argv)
    times = [r["elapsed_s"] for r in read_metrics(tmp_path)]
    assert times == sorted(times) and times[2] == first[3]  # the kept records, then on from where they stopped
    assert times[3] >= first[3] and wall_time_s(read_metrics(tmp_path)) == times[-1]
    assert wall_time_s([{"step": 1, "loss": 1.0}]) is None  # runs from before the records carried a time


def test_a_folder_that_is_not_a_run_directory_is_one_line(runs, tmp_path):
    (tmp_path / "notes").mkdir()
    result = run_module("analysis", "summary", str(runs[0]), str(tmp_path / "notes"), "--csv",
                        str(tmp_path / "out.csv"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'notes'} is not a run directory of this tool (no config.yaml of a pretraining or "
        "fine-tuning run)"]
    assert not (tmp_path / "out.csv").exists()  # nothing written before the mistake was found


def test_a_run_named_twice_is_one_line(runs, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # the table listed the run twice
        run_main(summary_main, [str(runs[0]), str(runs[1]), f"{runs[0]}/."])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: run directory {runs[0]}/. is named twice (as {runs[0]} and {runs[0]}/.): name each run once"]
