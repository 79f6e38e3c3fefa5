"""The whole pipeline under a real `accelerate launch` with two processes (two CPU processes with gloo here)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.processes import launch
from tests.helpers.runs import read_metrics


def launched(module: str, *args: str) -> str:
    """`accelerate launch -m module args` with two CPU processes, which must succeed; returns its stdout."""
    result = launch("-m", module, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_pretrain_resume_then_finetune_with_two_processes(demo_shards, tmp_path):
    pre = tmp_path / "pretrain"
    common = ["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}", f"train.run_dir={pre}"]
    out = launched("pretrain", *common, "train.steps=3")
    assert "global batch 8 = 2 process(es) x 4 per device x 1 accumulation step(s)" in out
    assert (pre / "checkpoints" / "step_000003" / "trainer_state.json").is_file()

    # Same run directory, longer run: resumes from the step-3 checkpoint and finishes.
    out = launched("pretrain", *common, "train.steps=6", "train.extend=true")
    assert "resuming from" in out and "(step 3)" in out
    logged = [m for m in read_metrics(pre) if "loss" in m]
    assert [m["step"] for m in logged] == [2, 3, 4, 6]  # log_every 2, plus the last step of each run
    assert any("val_loss" in m for m in read_metrics(pre))
    assert sorted(p.name for p in (pre / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    for r in logged:  # the realised corruption fractions always sum to one, also in the first log after resuming
        assert r["frac_mask"] + r["frac_random"] + r["frac_keep"] == pytest.approx(1.0, abs=1e-6), r
    # The first log after resuming (step 4) averages over the one step run since, not over log_every 2: not halved.
    assert abs(logged[2]["loss"] - logged[1]["loss"]) < 0.5 * logged[1]["loss"]
    weights = load_file(pre / "export" / "model.safetensors")
    # configs/pretrain/tiny.yaml trains at a learning rate that moves the weights (optim.lr, not 2e-4 scaled to 8)
    before = load_file(pre / "checkpoints" / "step_000003" / "model.safetensors")["encoder.patch_embed.proj.weight"]
    assert (weights["patch_embed.proj.weight"] - before).norm() / before.norm() > 1e-3
    assert "pos_embed" in weights and not any(k.startswith(("head", "mask_token")) for k in weights)
    assert weights["pos_embed"].shape == (1, 1 + 4 * 4, 32)
    assert json.loads((pre / "export" / "config.json").read_text())["vit_mpp"]["model"]["img_size"] == 16

    ft = tmp_path / "finetune"
    out = launched("finetune", "--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
                   f"init.checkpoint={pre / 'export'}", f"train.run_dir={ft}", "train.epochs=1")  # one evaluation
    assert "final validation top-1" in out
    evals = [m for m in read_metrics(ft) if "val_top1" in m]
    n_val = json.loads((demo_shards / "_info.json").read_text())["splits"]["val"]["num_samples"]
    assert evals and evals[-1]["val_samples"] == n_val  # every validation image counted once over both processes
    assert sum(evals[-1]["val_per_class_count"]) == n_val
    assert (ft / "export" / "best" / "model.safetensors").is_file()
    model = load_file(ft / "export" / "model.safetensors")
    assert model["pos_embed"].shape == (1, 1 + 6 * 6, 32)  # resized from 16px to 24px
    assert model["head.weight"].shape == (4, 32) and torch.count_nonzero(model["head.weight"]) > 0
