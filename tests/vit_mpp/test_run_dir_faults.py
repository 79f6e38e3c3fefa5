"""One run owns a run directory, and a run directory always resumes from something whole: a second run gets one
line naming the holder, ranks die with their launcher, an unreadable newest checkpoint is set aside and the one
before it used, and a resumed run may not change its architecture (refused before config.yaml is touched)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrain.__main__ import main as pretrain_main
from tests.helpers.processes import LAUNCH, REPO, alive, children, in_process, subprocess_env
from tests.helpers.runs import read_metrics


def pretrain(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    return ["-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
            f"train.run_dir={run_dir}", "train.eval_every=0", "data.val_split=", *overrides]


def run(args: list[str], capsys) -> subprocess.CompletedProcess:
    """`python <args>` (a `pretrain` command line) in this process: the run that is not the one being killed or
    locked out needs no interpreter of its own. A run dir this process has used stays locked by it to the end."""
    assert args[:2] == ["-m", "pretrain"]
    code, out, err = in_process(pretrain_main, args[2:], capsys)
    return subprocess.CompletedProcess([sys.executable, *args], code, out, err)


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def holder(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / ".lock").read_text())
    except (OSError, ValueError):
        return {}


def test_a_second_run_on_a_locked_run_dir_gets_one_line_naming_the_holder(demo_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, *pretrain(demo_shards, run_dir, "train.steps=100000")], cwd=REPO,
                             env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: holder(run_dir).get("pid") == first.pid and (run_dir / "config.yaml").is_file(),
                 "the first run to lock its run dir and write its config")
        config_before = (run_dir / "config.yaml").read_text()
        second = run(pretrain(demo_shards, run_dir, "train.steps=5", "optim.lr=0.5"), capsys)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"error: {run_dir} is in use by another run (pid {first.pid} on ")
        assert (run_dir / "config.yaml").read_text() == config_before  # nothing of the second run was written
    finally:
        first.kill()  # kill -9: the lock goes with the process
        first.wait()
    # The lock is free. Whether the killed run got to its first checkpoint depends on the machine's speed (CI's
    # did not), so either start is right; what matters is that the dry run, which checks the lock, passed it.
    third = run([*pretrain(demo_shards, run_dir, "train.steps=100000"), "--dry-run"], capsys)
    assert third.returncode == 0 and re.search(r"^would (resume|start a new run) ", third.stdout, re.M), \
        third.stderr[-2000:]


def test_ranks_stop_when_their_launcher_is_killed(demo_shards, tmp_path, capsys):
    # The launcher killed with -9 left its ranks training in their own sessions; a re-run then collided with them.
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([*LAUNCH[:1], *LAUNCH[1:], *pretrain(demo_shards, run_dir, "train.steps=100000")],
                                cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: holder(run_dir).get("pid") in children(launcher.pid), "rank 0 to lock the run dir")
        ranks = children(launcher.pid)
        assert len(ranks) == 2
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not any(alive(r) for r in ranks), "the orphaned ranks to stop", timeout=30)
    finally:
        for pid in children(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    again = run([*pretrain(demo_shards, run_dir, "train.steps=100000"), "--dry-run"], capsys)  # free again
    assert again.returncode == 0, again.stderr[-2000:]


def test_an_unreadable_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(demo_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = run(pretrain(demo_shards, run_dir, "train.steps=6", "train.ckpt_every=3", "train.keep_last=3"), capsys)
    assert first.returncode == 0, first.stderr[-2000:]
    weights = run_dir / "checkpoints" / "step_000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as a full disk or a crash leaves it
    resumed = run(pretrain(demo_shards, run_dir, "train.steps=9", "train.ckpt_every=3", "train.keep_last=3",
                           "train.extend=true"), capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "checkpoint" in resumed.stderr and "step_000006 cannot be read" in resumed.stderr
    assert f"resuming from {run_dir / 'checkpoints' / 'step_000003'} (step 3)" in resumed.stdout
    assert (run_dir / "checkpoints" / "step_000006.unreadable").is_dir()
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == [2, 4, 6, 8, 9]  # each step once: the log was cut back to step 3 and carried on

    # The same step damaged again: set aside under a free name (the rename over the first one was an OSError).
    shutil.rmtree(run_dir / "checkpoints" / "step_000009")
    weights = run_dir / "checkpoints" / "step_000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    again = run(pretrain(demo_shards, run_dir, "train.steps=9", "train.ckpt_every=3", "train.keep_last=3"), capsys)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run_dir / "checkpoints" / "step_000006.unreadable").is_dir()
    assert (run_dir / "checkpoints" / "step_000006.unreadable-2").is_dir()


def test_a_run_dir_whose_only_checkpoint_is_unreadable_is_one_line_not_a_fresh_start(demo_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run(pretrain(demo_shards, run_dir, "train.steps=3", "train.keep_last=1"), capsys).returncode == 0
    (run_dir / "checkpoints" / "step_000003" / "model.safetensors").write_bytes(b"")
    again = run(pretrain(demo_shards, run_dir, "train.steps=6", "train.extend=true"), capsys)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith(f"error: no checkpoint of {run_dir} can be read")


def test_a_resumed_run_may_not_change_its_architecture(demo_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run(pretrain(demo_shards, run_dir, "train.steps=3"), capsys).returncode == 0
    before = (run_dir / "config.yaml").read_text()
    changed = run(pretrain(demo_shards, run_dir, "train.steps=6", "model.depth=3", "mpp.target=l2"), capsys)
    lines = changed.stderr.strip().splitlines()
    assert changed.returncode == 2 and len(lines) == 1, changed.stderr
    assert "a resumed run cannot change model.depth (2 -> 3), mpp.target ('mean_color' -> 'l2')" in lines[0]
    assert (run_dir / "config.yaml").read_text() == before
    # other settings may change
    ok = run(pretrain(demo_shards, run_dir, "train.steps=6", "optim.lr=0.002", "train.extend=true"), capsys)
    assert ok.returncode == 0
    assert "note: config differs from the previous run in: optim.lr, train.extend, train.steps" in ok.stdout


def test_a_run_dir_under_a_file_is_one_line(demo_shards, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    result = run(pretrain(demo_shards, tmp_path / "file" / "run", "train.steps=2"), capsys)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: train.run_dir {tmp_path / 'file' / 'run'} is (or lies under) a file, " \
                                    "not a folder"


def test_a_run_dir_that_cannot_be_made_is_one_line(demo_shards, capsys):
    # under /proc (tests run as root, so permissions stop nothing): a FileNotFoundError traceback
    result = run(pretrain(demo_shards, Path("/proc/no-such-run"), "train.steps=2"), capsys)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: train.run_dir /proc/no-such-run cannot be created: no such file or " \
                                    "directory"


def test_an_image_size_the_named_models_patch_does_not_divide_is_one_line_before_the_run_dir(demo_shards, tmp_path,
                                                                                             capsys):
    # The patch size comes from model.name (16), not from model.patch_size: only timm knows it. The run directory
    # and its config.yaml were written before the model was built and refused.
    result = run(pretrain(demo_shards, tmp_path / "run", "model.patch_size=null", "model.img_size=24"), capsys)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: model.img_size 24x24 is not divisible by the patch size 16x16"
    assert not (tmp_path / "run").exists()


def test_a_shard_folder_is_refused_as_a_run_dir_before_anything_is_written(demo_shards, capsys):
    # train.run_dir=data.shards: a run would write its lock, config, logs and checkpoints among the shards.
    before = sorted(os.listdir(demo_shards))
    for dry in ([], ["--dry-run"]):
        result = run(pretrain(demo_shards, demo_shards, *dry), capsys)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0] == f"error: train.run_dir {demo_shards} is a shard folder (it holds _info.json): a run " \
                           "writes its checkpoints and logs into a folder of its own; use another train.run_dir"
    assert sorted(os.listdir(demo_shards)) == before


def test_a_models_folder_is_never_written_into_by_a_run_or_a_build(demo_shards, demo_folder, encoder_export,
                                                                   tmp_path, capsys):
    # train.run_dir=EXPORT wrote the run's config, logs and curves.png over the model's own; build-shards OUT=EXPORT
    # put shards and a manifest among its files (then a run could not resume there: "a shard folder")
    from data_tools.cli import main as build_main

    export = shutil.copytree(encoder_export, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in export.iterdir() if p.is_file()}
    for dry in ([], ["--dry-run"]):
        result = run(pretrain(demo_shards, export, *dry), capsys)
        assert result.returncode == 2 and result.stderr.strip() == (
            f"error: train.run_dir {export} is an export: a run writes its checkpoints and logs into a folder of its "
            "own; use another train.run_dir"), result.stderr
    code, _, err = in_process(build_main, [str(demo_folder), str(export), "--min-side", "4"], capsys)
    assert code == 2 and err.strip() == f"error: OUT {export} is an export: give the shards a folder of their own"
    code, _, err = in_process(build_main, ["subset", str(demo_shards), str(export), "--per-class", "1"], capsys)
    assert code == 2 and err.strip() == f"error: OUT {export} is an export: give the subset a folder of its own"
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before
