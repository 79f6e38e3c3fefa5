"""The end of a run (vit_mpp/run/metering/summary.py): one short block and run_dir/summary.json, on both stages, whose
times agree with the run's own clock (the stage's main called to its return), start-up and export included;
`python -m analysis summary` takes its wall time from summary.json, and from metrics.jsonl for runs without one."""

from __future__ import annotations

import json
import time

import pytest
import torch

from analysis.run_table import run_row
from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.runs import read_metrics


def test_a_pretraining_summary_counts_the_whole_run_on_its_own_clock(demo_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    pretrain_main(["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}", f"train.run_dir={run_dir}",
                   "data.num_workers=0", "knn.train_images=32"])
    took = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    assert took - 0.5 <= summary["total_s"] <= took + 0.1  # main's whole call: imports of the stage, export
    assert summary["train_s"] + summary["eval_s"] + summary["other_s"] == pytest.approx(summary["total_s"], abs=0.2)
    assert summary["train_s"] > 0 and summary["eval_s"] > 0 and summary["other_s"] > 0 and summary["step"] == 6
    train_s = summary["train_s"]  # to 0.1 s: 6 steps of 8 images in it
    assert 48 / (train_s + 0.05) <= summary["img_per_s"] <= 48 / max(train_s - 0.05, 1e-3)
    records = read_metrics(run_dir)
    assert max(r["run_s"] for r in records) <= summary["total_s"]
    assert set(summary["final"]) == {"knn_top1_cls", "knn_top1_avg", "val_acc", "val_loss"}  # k-NN: pretraining's
    assert summary["best"]["val_loss"] == min(r["val_loss"] for r in records if "val_loss" in r)
    assert summary["exports"] == [str(run_dir / "export")] and summary["mfu"] is None  # a CPU: no peak known
    assert summary["threads"] == torch.get_num_threads()  # runs reproduce bit for bit at one thread count only
    out = capsys.readouterr().out.splitlines()
    block = out[out.index(next(line for line in out if line.startswith("run done at step 6"))):]
    assert len(block) == 4 and block[-1] == f"export: {run_dir / 'export'} | summary: {run_dir / 'summary.json'}"
    assert block[2].startswith("final knn_top1_cls ")

    # the table of runs takes the summary's wall time (start-up and export included), and metrics.jsonl's without
    assert run_row(run_dir)["wall_s"] == summary["total_s"] > max(r["elapsed_s"] for r in records)
    (run_dir / "summary.json").write_text(json.dumps({**summary, "step": 3}))  # a summary older than the records
    assert run_row(run_dir)["wall_s"] == max(r["elapsed_s"] for r in records)
    (run_dir / "summary.json").unlink()
    assert run_row(run_dir)["wall_s"] == max(r["elapsed_s"] for r in records)


def test_a_fine_tuning_summary_gives_the_validation_top1_and_the_exports(demo_shards, encoder_export, tmp_path,
                                                                            capsys):
    run_dir = tmp_path / "ft"
    finetune_main(["--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}", f"train.run_dir={run_dir}",
                   f"init.checkpoint={encoder_export}", "data.num_workers=0", "train.epochs=1"])
    summary = json.loads((run_dir / "summary.json").read_text())
    best = max(r["val_top1"] for r in read_metrics(run_dir) if "val_top1" in r)
    assert summary["best"]["val_top1"] == best and "val_top1" in summary["final"]
    assert summary["exports"] == [str(run_dir / "export"), str(run_dir / "export" / "best")]
    assert any(line.startswith("final val_top1 ") for line in capsys.readouterr().out.splitlines())
