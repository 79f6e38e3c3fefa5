"""FSDP through the real launcher: `accelerate launch --config_file configs/accelerate/fsdp_vit_large.yaml` on CPU
processes with gloo (FSDP2 shards there as on GPUs; vit_mpp/run/start/sharding.py). Each Block's weights are split
over the processes, in memory and in the checkpoint; the losses are data parallel's; the export, gathered, is the
checkpoint's model and loads in timm; the sharded checkpoint resumes on one process and on three, each sample read
once per epoch; fine-tuning with layer decay trains as data parallel does. The settings FSDP is refused with:
tests/vit_mpp/test_fsdp_settings.py."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.processes import JOB_LAUNCHER, LAUNCH, REPO, Background, subprocess_env, wait_all_gone
from tests.helpers.runs import assert_each_sample_once_per_epoch, read_metrics
from tests.helpers.shards import write_shard_set

TRAIN = {"train": [30, 18, 24, 24], "val": [8]}  # 96 training samples in uneven shards; an epoch is 8 steps of 12
FSDP = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/fsdp_vit_large.yaml",
        "--mixed_precision", "no", "--main_process_port", "0"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shard_set(tmp_path_factory.mktemp("shards"), TRAIN, size=16)


def pretrain(launch: list[str], shards: Path, run_dir: Path, *overrides: str) -> str:
    """A tiny pretraining run (global batch 12: 1, 2 or 3 processes) under `launch`; its output."""
    done = subprocess.run([*launch, "-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
                           f"train.run_dir={run_dir}", "train.batch_size=12", "train.steps=4", "train.ckpt_every=4",
                           "train.log_every=1", "train.eval_every=0", "data.val_split=", "train.record_samples=true",
                           *overrides], capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def fsdp(processes: int) -> list[str]:
    return [*FSDP, "--num_processes", str(processes)]


@pytest.fixture(scope="module")
def sharded_run(shards, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    return run_dir, pretrain(fsdp(2), shards, run_dir)


def test_each_block_is_split_over_the_processes_and_the_run_trains_as_data_parallel(shards, sharded_run, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run_dir, out = sharded_run
    assert "FSDP over 2 processes (each Block a unit, freed after its forward): rank 0 holds" in out
    pretrain(LAUNCH, shards, tmp_path / "dp")
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "dp"), rel=1e-6)  # the same initial weights and steps

    saved = run_dir / "checkpoints" / "step_000004" / "model_optim"
    metadata = FileSystemReader(saved).read_metadata()
    files = {index.fqn: set() for index in metadata.storage_data}
    for index, info in metadata.storage_data.items():
        files[index.fqn].add(info.relative_path)
    blocks = [name for name in metadata.state_dict_metadata if name.startswith("model.") and ".blocks." in name
              and name.endswith(".weight") and "norm" not in name]
    assert len(blocks) == 8  # 2 blocks x (qkv, proj, fc1, fc2)
    for name in blocks:  # half of each weight from each process, in its own file
        assert len(metadata.state_dict_metadata[name].chunks) == 2, name
        assert files[name] == {"__0_0.distcp", "__1_0.distcp"}, name

    # The export is the checkpoint's encoder, gathered whole; timm loads it as any other
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(saved, tmp_path / "whole.pt")
    model = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    export = load_file(run_dir / "export" / "model.safetensors")
    assert export and all(torch.equal(tensor, model[f"encoder.{name}"]) for name, tensor in export.items())
    import timm

    vit = timm.create_model(f"local-dir:{run_dir / 'export'}", pretrained=True)
    assert vit.blocks[0].attn.qkv.weight.shape == (96, 32)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_one_process_and_on_three_each_sample_once_per_epoch(shards, sharded_run,
                                                                                             tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(sharded_run[0], run_dir)
    one = pretrain(fsdp(1), shards, run_dir, "train.steps=12", "train.extend=true")
    assert "FSDP on one process" in one and "resuming from" in one
    three = pretrain(fsdp(3), shards, run_dir, "train.steps=20", "train.extend=true")
    assert "FSDP over 3 processes" in three and "resuming from" in three
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == list(range(1, 21))
    assert assert_each_sample_once_per_epoch(run_dir, 20) == 2  # epochs 0 and 1 whole, over 2, 1 and 3 processes


def finetune(launch: list[str], shards: Path, run_dir: Path, init: Path) -> str:
    """A tiny fine-tuning run with AdamW, layer-wise lr decay and weight decay (no-decay groups), from `init`."""
    done = subprocess.run([*launch, "-m", "finetune", "--config", "configs/finetune/tiny.yaml",
                           f"init.checkpoint={init}", f"data.shards={shards}", f"train.run_dir={run_dir}",
                           "train.batch_size=12", "train.epochs=2", "train.log_every=1", "optim.name=adamw",
                           "optim.lr=1e-3", "optim.layer_decay=0.75", "optim.weight_decay=0.05"],
                          capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_fine_tuning_sharded_from_a_sharded_export_trains_as_data_parallel_and_its_export_scores_the_same(
        shards, sharded_run, tmp_path):
    init = sharded_run[0] / "export"
    out = finetune(fsdp(2), shards, tmp_path / "fsdp", init)
    assert "FSDP over 2 processes" in out
    finetune(LAUNCH, shards, tmp_path / "dp", init)
    sharded, plain = read_metrics(tmp_path / "fsdp"), read_metrics(tmp_path / "dp")
    assert [m["loss"] for m in sharded if "loss" in m] == pytest.approx([m["loss"] for m in plain if "loss" in m],
                                                                         rel=1e-5)
    last = [m for m in sharded if "val_top1" in m][-1]
    assert last["val_loss"] == pytest.approx([m for m in plain if "val_top1" in m][-1]["val_loss"], rel=1e-5)
    from finetune import evaluate

    report = evaluate.main(["--checkpoint", str(tmp_path / "fsdp" / "export"), "--shards", str(shards),
                            "--workers", "0", "--out", str(tmp_path / "eval")])
    assert report["metrics"]["val_top1"] == last["val_top1"]  # the gathered export is the model the run evaluated
    assert report["metrics"]["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)


def job(processes: int, *machine: str) -> list[str]:
    """vit-mpp-launch (the launcher a scheduler starts) with the FSDP config."""
    return [*JOB_LAUNCHER, *FSDP[3:], "--num_processes", str(processes), *machine]


def endless(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    """A tiny pretraining run that goes on until it is stopped (global batch 12), checkpointed when preempted."""
    return ["-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
            f"train.run_dir={run_dir}", "train.batch_size=12", "train.steps=100000", "train.ckpt_every=1000",
            "train.log_every=1", "train.eval_every=0", "data.val_split=", "train.record_samples=true", *overrides]


@pytest.mark.slow
def test_a_sharded_run_preempted_exits_75_killed_with_minus_9_resumes_and_reads_each_sample_once(shards, tmp_path):
    run_dir = tmp_path / "run"
    first = Background([*job(2), *endless(shards, run_dir, "data.num_workers=1")], tmp_path / "first",
                       "fsdp-preempted")
    first.wait_for("step 6/")
    first.signal_all(signal.SIGTERM)  # SLURM's way: every process
    first.wait_gone(60)
    out = first.output()
    assert first.proc.returncode == 75, out[-3000:]
    step = int(re.search(r"preempted at step (\d+): checkpoint saved; run the same command to resume", out)[1])
    assert len(re.findall(r"^preempted ", out, re.M)) == 1 and "Traceback" not in out
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "model_optim" / ".metadata").is_file()

    second = Background([*job(2), *endless(shards, run_dir, "data.num_workers=2", "train.ckpt_every=3")],
                        tmp_path / "second", "fsdp-killed")
    second.wait_for(f"step {step + 5}/")
    os.kill(second.rank(1), signal.SIGKILL)
    second.wait_gone(60)
    assert second.proc.returncode == 2 and "Traceback" not in second.output(), second.output()[-3000:]

    resumed = subprocess.run([*fsdp(1), *endless(shards, run_dir, f"train.steps={step + 16}")], capture_output=True,
                             text=True, timeout=600, env=subprocess_env(), cwd=REPO)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert_each_sample_once_per_epoch(run_dir, step + 16)


@pytest.mark.slow
def test_two_machines_sharded_on_one_host_preempted_then_resumed_as_one(shards, tmp_path):
    run_dir, port = tmp_path / "run", str(29800 + (int(time.time()) % 150))
    machines = [Background([*job(2, "--num_machines", "2", "--machine_rank", str(m), "--main_process_ip",
                                 "127.0.0.1", "--main_process_port", port), *endless(shards, run_dir)],
                           tmp_path / f"machine{m}", "fsdp-two-machines") for m in (0, 1)]
    machines[0].wait_for("step 6/")
    assert "FSDP over 2 processes" in machines[0].output()  # one process on each machine
    machines[0].signal_all(signal.SIGTERM)
    wait_all_gone(machines, 60)
    assert [m.proc.returncode for m in machines] == [75, 75], machines[0].output()[-3000:]
    step = int(re.search(r"preempted at step (\d+)", machines[0].output())[1])
    resumed = subprocess.run([*fsdp(1), *endless(shards, run_dir, f"train.steps={step + 10}")], capture_output=True,
                             text=True, timeout=600, env=subprocess_env(), cwd=REPO)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "FSDP on one process" in resumed.stdout and "resuming from" in resumed.stdout
    assert_each_sample_once_per_epoch(run_dir, step + 10)


@pytest.mark.slow
def test_what_each_rank_holds_is_the_memory_tables_formula():
    """docs/cluster.md's memory table is computed (16 bytes a parameter, over the ranks): ViT-B/16 sharded over two
    processes holds half of each kind of state on rank 0, measured on the tensors themselves."""
    done = subprocess.run([*fsdp(2), "benchmarks/fsdp_memory.py", "--check"], capture_output=True, text=True,
                          timeout=600, env=subprocess_env(), cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ratios = [float(r) for r in re.findall(r"\(ratio ([\d.]+)\)", done.stdout)]
    assert len(ratios) == 3 and all(abs(r - 1) <= 0.01 for r in ratios), done.stdout
