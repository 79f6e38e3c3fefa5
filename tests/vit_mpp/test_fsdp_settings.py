"""FSDP as the launch config asks for it (vit_mpp/config/fsdp_settings.py): what Accelerate's launcher passes to the
ranks is read as it passes it; a setting that cannot go with FSDP, and a run directory whose checkpoints are the
other kind (vit_mpp/run/durability/checkpoint_files.py `check_sharding`), are one `error:` line and exit status 2
before the run directory is touched. Sharding itself, through the real launcher: tests/end_to_end/test_fsdp.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.processes import REPO, in_process, subprocess_env
from vit_mpp.config.fsdp_settings import DEEPSPEED_REFUSED, FsdpSettings, accelerate_fsdp_off

FSDP_CONFIG = "configs/accelerate/fsdp_vit_large.yaml"


def fsdp_env(monkeypatch: pytest.MonkeyPatch, **settings: str) -> None:
    """The environment Accelerate's launcher gives a rank of configs/accelerate/fsdp_vit_large.yaml, with `settings`."""
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
           "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block", "FSDP_RESHARD_AFTER_FORWARD": "true",
           "FSDP_OFFLOAD_PARAMS": "false", "FSDP_ACTIVATION_CHECKPOINTING": "false", **settings}
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_the_settings_are_read_as_accelerates_launcher_passes_them(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("from vit_mpp.config.fsdp_settings import FsdpSettings\nprint(FsdpSettings.read())\n")
    shown = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP_CONFIG,
                            "--num_processes", "1", "--mixed_precision", "no", "--main_process_port", "0",
                            str(script)], capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=REPO)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "FsdpSettings(version=2, units=('Block',), reshard_after_forward=True, activation_checkpointing=False, " \
           "offload_params=False, wrap_policy='TRANSFORMER_BASED_WRAP')" in shown.stdout, shown.stdout


def test_the_settings_and_accelerates_switch_taken_out_while_its_state_is_made():
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block, Attention",
           "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"}
    assert FsdpSettings.read(env) == FsdpSettings(units=("Block", "Attention"), reshard_after_forward=False,
                                                  activation_checkpointing=True)
    with accelerate_fsdp_off(env):
        assert "ACCELERATE_USE_FSDP" not in env and FsdpSettings.read(env) is None
    assert env["ACCELERATE_USE_FSDP"] == "true"  # a second run in the same process reads it again
    assert FsdpSettings.read({"ACCELERATE_USE_FSDP": "false"}) is None
    assert FsdpSettings.read({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                              "FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}).units == ()


def pretrain_argv(shards, run_dir, *overrides: str) -> list[str]:
    return ["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}",
            "train.steps=2", "data.num_workers=0", *overrides]


REFUSED = {
    "FSDP version 1": ({"FSDP_VERSION": "1"}, [], "this tool shards with FSDP2 (torch's fully_shard): set "
                                                   "fsdp_version: 2"),
    "size-based wrapping": ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, [],
                            "fsdp_auto_wrap_policy: SIZE_BASED_WRAP is not supported"),
    "parameters offloaded": ({"FSDP_OFFLOAD_PARAMS": "true"}, [], "fsdp_offload_params: true (parameters and "
                                                                  "optimizer state in host memory) is not supported"),
    "fp16": ({}, ["train.mixed_precision=fp16"], "train.mixed_precision=fp16 does not go with FSDP here"),
    "fp8": ({}, ["train.fp8=true"], "train.fp8=true has not been verified with FSDP"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_setting_that_cannot_go_with_fsdp_is_one_line_before_anything_is_written(case, demo_shards, tmp_path,
                                                                                  monkeypatch, capsys):
    settings, overrides, says = REFUSED[case]
    fsdp_env(monkeypatch, **settings)
    code, _, err = in_process(pretrain_main, pretrain_argv(demo_shards, tmp_path / "run", *overrides), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not (tmp_path / "run").exists()


def test_an_ema_is_refused_with_fsdp_before_anything_is_written(demo_shards, encoder_export, tmp_path, monkeypatch,
                                                                capsys):
    fsdp_env(monkeypatch)
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
                                              f"init.checkpoint={encoder_export}", f"train.run_dir={tmp_path / 'run'}",
                                              "train.ema_decay=0.99"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: train.ema_decay=0.99 needs the whole model on every process, and FSDP shards it; set "
        "train.ema_decay=0, or fine-tune without the FSDP accelerate config"], err
    assert not (tmp_path / "run").exists()


# semi.pool needs the EMA, and FSDP refuses an EMA: one line names both, whichever check meets them first (the pool's
# own check when train.ema_decay=0, FSDP's when it is > 0); each used to send the user to the other
SEMI_UNDER_FSDP = ("error: config key 'semi.pool' needs the model's EMA (train.ema_decay > 0) as its teacher, and an "
                   "EMA is not kept under FSDP (it needs the whole model on every process, and FSDP shards it): "
                   "fine-tune with the pool without the FSDP accelerate config, or without semi.pool")


def semi_argv(shards, run_dir, ema: str) -> list[str]:
    return ["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}", "init.checkpoint=",
            f"train.run_dir={run_dir}", f"semi.pool={shards}", ema]


@pytest.mark.parametrize("ema", ["train.ema_decay=0", "train.ema_decay=0.99"])
def test_a_pool_under_fsdp_is_one_line_naming_both_settings(ema, demo_shards, tmp_path, monkeypatch, capsys):
    fsdp_env(monkeypatch)
    code, _, err = in_process(finetune_main, semi_argv(demo_shards, tmp_path / "run", ema), capsys)
    assert code == 2 and err.strip().splitlines() == [SEMI_UNDER_FSDP], err
    assert not (tmp_path / "run").exists()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")  # without FSDP, the pool's own rule is as it was
    code, _, err = in_process(finetune_main, semi_argv(demo_shards, tmp_path / "run", "train.ema_decay=0"), capsys)
    assert code == 2 and "config key 'semi.pool' the pool's labels come from the model's EMA" in err, err
    assert not (tmp_path / "run").exists()


def test_a_pool_under_fsdp_through_the_command_is_one_line(demo_shards, tmp_path):
    # `python -m finetune` as each rank runs it, in the environment the FSDP launch config gives: status 2, one line
    env = {**subprocess_env(), "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    for ema in ("train.ema_decay=0", "train.ema_decay=0.99"):
        done = subprocess.run([sys.executable, "-m", "finetune", *semi_argv(demo_shards, tmp_path / "run", ema)],
                              capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [SEMI_UNDER_FSDP], done.stderr[-3000:]
        assert not (tmp_path / "run").exists()
    # and under the real launcher with configs/accelerate/fsdp_vit_large.yaml (torch elastic's, whose own report of
    # the failed rank follows, with its exit status 1): the rank's one line is this one
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP_CONFIG,
                           "--num_processes", "1", "--mixed_precision", "no", "--main_process_port", "0", "--quiet",
                           "-m", "finetune", *semi_argv(demo_shards, tmp_path / "run", "train.ema_decay=0.99")],
                          capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode != 0 and errors == [SEMI_UNDER_FSDP], done.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stage, extra", [
    ("pretrain", []), ("finetune", ["train.ema_decay=0"]), ("finetune", ["train.ema_decay=0.99"]),
])
def test_a_deepspeed_launch_is_one_line_before_anything_is_written(stage, extra, demo_shards, tmp_path):
    # Each rank as a DeepSpeed launch starts it (`accelerate launch --use_deepspeed` sets this variable): Accelerate's
    # DeepSpeed integration needs transformers, and each rank was a traceback in Accelerator(); with a pool, the
    # config's checks sent the user between train.ema_decay and the launch first. vit-mpp-launch says it before
    # any rank starts: tests/vit_mpp/test_job_launcher.py.
    env = {**subprocess_env(), "ACCELERATE_USE_DEEPSPEED": "true"}
    argv = pretrain_argv(demo_shards, tmp_path / "run") if stage == "pretrain" else semi_argv(
        demo_shards, tmp_path / "run", *extra)
    done = subprocess.run([sys.executable, "-m", stage, *argv], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"error: {DEEPSPEED_REFUSED}"], \
        done.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_unit_class_the_model_does_not_have_is_one_line(demo_shards, tmp_path, monkeypatch, capsys):
    fsdp_env(monkeypatch, FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer")
    code, _, err = in_process(pretrain_main, pretrain_argv(demo_shards, tmp_path / "run"), capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: fsdp_transformer_layer_cls_to_wrap names LlamaDecoderLayer, and the model has "
                               "no module of that class (it has ") and "Block" in lines[0], err


def test_checkpoints_resume_as_they_were_written_sharded_or_whole(demo_shards, tmp_path, monkeypatch, capsys):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert in_process(pretrain_main, pretrain_argv(demo_shards, whole), capsys)[0] == 0
    with monkeypatch.context() as launched_with_fsdp:
        fsdp_env(launched_with_fsdp)
        code, out, err = in_process(pretrain_main, pretrain_argv(demo_shards, sharded), capsys)
        assert code == 0, err
        assert "FSDP on one process: the model is whole; its checkpoints are in the sharded format" in out
        assert (sharded / "checkpoints" / "step_000002" / "model_optim" / ".metadata").is_file()
        before = {p: p.stat().st_mtime_ns for p in whole.rglob("*")}
        code, _, err = in_process(pretrain_main, pretrain_argv(demo_shards, whole, "train.steps=4",
                                                               "train.extend=true"), capsys)
        assert code == 2 and err.strip().splitlines() == [
            f"error: {whole}/checkpoints/step_000002 holds the whole model (the run was launched without FSDP), and "
            "this run is launched with the FSDP accelerate config: resume it as it was launched, or start a new "
            "train.run_dir to shard"], err
        assert {p: p.stat().st_mtime_ns for p in whole.rglob("*")} == before  # untouched
    before = {p: p.stat().st_mtime_ns for p in sharded.rglob("*")}
    code, _, err = in_process(pretrain_main, pretrain_argv(demo_shards, sharded, "train.steps=4", "train.extend=true"),
                              capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: {sharded}/checkpoints/step_000002 is sharded (the run was launched with FSDP): resume it with the "
        "FSDP accelerate config (accelerate launch --config_file configs/accelerate/fsdp_vit_large.yaml ..., on any "
        "number of processes)"], err
    assert {p: p.stat().st_mtime_ns for p in sharded.rglob("*")} == before
