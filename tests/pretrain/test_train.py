"""The pretrain stage: the export is a plain timm model, every target trains, a killed run resumes."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import timm
import torch
from safetensors.torch import load_file

from pretrain.__main__ import main as pretrain_main
from pretrain.config import MPPConfig
from pretrain.mpp import MaskedPatchPrediction
from tests.helpers.models import write_encoder_export
from tests.helpers.processes import REPO, ctrl_c_enabled, in_process, subprocess_env
from tests.helpers.runs import read_metrics
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.vit import create_vit


def test_export_loads_with_timm_create_model_local_dir_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(name="vit_small_patch16_224", img_size=[32, 48], patch_size=8, depth=2)
    encoder = create_vit(cfg).eval()
    write_encoder_export(tmp_path, encoder, cfg, mean=(0.1, 0.2, 0.3), std=(0.3, 0.2, 0.1))
    model = timm.create_model(f"local-dir:{tmp_path}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 48)
    torch.testing.assert_close(model(x), encoder(x), rtol=0, atol=0)
    data = model.pretrained_cfg
    assert list(data["mean"]) == [0.1, 0.2, 0.3] and list(data["input_size"]) == [3, 32, 48]


def _structured_images(n: int, size: int, seed: int) -> torch.Tensor:
    """Smooth colour gradients: neighbouring patches predict each other, as in natural images."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    a, b, c = (torch.rand(n, 3, 1, 1, generator=g) for _ in range(3))
    img = a * yy + b * xx + c * (1 - yy)
    return (img / img.amax(dim=(2, 3), keepdim=True) * 255).to(torch.uint8)  # (n, 3, size, size)


@pytest.mark.parametrize("target", ["mean_color", "pixels_4x4", "l2", "hog"])
def test_every_target_trains(target):
    torch.manual_seed(0)
    enc = create_vit(ModelConfig(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4))
    model = MaskedPatchPrediction(enc, MPPConfig(target=target), (0.5,) * 3, (0.5,) * 3)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    images = _structured_images(64, 16, seed=1)
    losses = []
    for step in range(60):
        batch = images[(step * 16) % 64:(step * 16) % 64 + 16]
        loss = model(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, (first, last)


def test_killed_run_resumes_from_its_checkpoint_and_finishes(demo_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}",
           f"train.run_dir={run_dir}", "train.steps=100", "train.ckpt_every=5", "train.log_every=5",
           "train.eval_every=0", "data.val_split="]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 120
    while not list((run_dir / "checkpoints").glob("step_*/trainer_state.json")):
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9, mid-run
    proc.wait()
    assert not (run_dir / "export").exists()

    code, out, err = in_process(pretrain_main, cmd[3:], capsys)  # the same command, run again (in this process)
    assert code == 0, out[-2000:] + err[-2000:]
    resumed = int(out.split("(step ")[1].split(")")[0])
    assert resumed >= 5 and resumed % 5 == 0
    logged = [r["step"] for r in read_metrics(run_dir)]
    assert logged == list(range(5, 101, 5)), "each step logged once, in order, across the kill"
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert json.loads((run_dir / "checkpoints" / "step_000100" / "trainer_state.json").read_text())["step"] == 100


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_ctrl_c_while_a_stage_imports_torch_is_one_line_without_a_launcher(demo_shards, tmp_path, stage):
    # `python -m pretrain` at a terminal: a Ctrl-C in the seconds of its imports was a KeyboardInterrupt traceback
    # from inside torch (under a launcher it was already this line)
    run_dir = tmp_path / "run"
    extra = ["init.checkpoint=", "model.patch_size=4"] if stage == "finetune" else []
    proc = subprocess.Popen([sys.executable, "-m", stage, "--config", f"configs/{stage}/tiny.yaml",
                             f"data.shards={demo_shards}", f"train.run_dir={run_dir}", *extra], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_enabled)
    deadline = time.time() + 60
    while "libtorch_cpu" not in pathlib.Path(f"/proc/{proc.pid}/maps").read_text():  # inside `import torch`
        assert proc.poll() is None and time.time() < deadline, "torch was never loaded"
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines() == [
        "preempted (SIGINT) during start-up: nothing was saved; run the same command to start"], err[-3000:]
    assert not (run_dir / "checkpoints").exists()


def test_compiled_training_exports_every_encoder_weight(demo_shards, tmp_path):
    # torch.compile once returned a wrapper whose `_orig_mod.` keys left the export empty. Inductor compiles C++
    # for the CPU here, so this takes about 25 s.
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}",
         f"train.run_dir={run_dir}", "train.steps=3", "train.eval_every=0", "data.val_split=", "train.compile=true"],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    exported = load_file(run_dir / "export" / "model.safetensors")
    cfg = json.loads((run_dir / "export" / "config.json").read_text())["vit_mpp"]["model"]
    expected = create_vit(ModelConfig(**cfg)).state_dict()
    assert exported.keys() == {k for k in expected if not k.startswith("head.")}
    trained = load_file(run_dir / "checkpoints" / "step_000003" / "model.safetensors")
    torch.testing.assert_close(exported["blocks.0.attn.qkv.weight"], trained["encoder.blocks.0.attn.qkv.weight"])
