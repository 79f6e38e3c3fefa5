"""User errors end in one line on stderr and exit status 2, not a traceback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers.processes import REPO, run_module, subprocess_env
from vit_mpp.processes.exits import QUIET_WAIT_S


# Config errors under `python -m` (an unknown key, a wrong type, ...): tests/vit_mpp/test_config_faults.py.
@pytest.mark.parametrize("module, args, message", [
    ("pretrain", ["--config", "configs/pretrain/tiny.yaml", "data.shards=/nonexistent/shards"],
     "shard directory not found: /nonexistent/shards"),
    ("finetune", ["--config", "configs/finetune/tiny.yaml", "init.checkpoint=/nonexistent/encoder.safetensors"],
     "checkpoint not found: /nonexistent/encoder.safetensors"),
])
def test_one_line_error(module, args, message, demo_shards, tmp_path):
    if "data.shards" not in " ".join(args):
        args = [*args, f"data.shards={demo_shards}"]
    result = run_module(module, *args, f"train.run_dir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_help_lists_every_key():
    result = run_module("pretrain", "--help", timeout=120)
    assert result.returncode == 0
    for key in ("mpp.mask_ratio", "mpp.target", "optim.base_lr", "train.batch_size", "data.shards"):
        assert key in result.stdout


@pytest.mark.parametrize("rank, expected", [("0", "error: bad value"), ("1", "error: [rank 1] bad value")])
def test_under_a_launcher_the_main_rank_prints_and_a_silent_rank_speaks_only_if_still_running(
        rank, expected, monkeypatch, capsys):
    # A rank other than the main one waits: the launcher normally ends it once the main one has printed. If it was
    # not ended (the main one did not meet the error), it prints the line itself, so a line always appears.
    from vit_mpp.config.engine import ConfigError
    from vit_mpp.processes import exits

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(exits, "QUIET_WAIT_S", 0.01)

    def main(argv):
        raise ConfigError("bad value")

    with pytest.raises(SystemExit) as e:
        exits.run_main(main, [])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == expected


def _entry_points():
    from analysis.analyze import main as analyze
    from analysis.plot_runs import main as plot
    from analysis.run_table import main as summary
    from data_tools.cli import main as build_shards
    from data_tools.demo_images import main as demo_images
    from finetune.__main__ import main as finetune
    from finetune.evaluate import main as evaluate
    from finetune.predict import main as predict
    from pretrain.__main__ import main as pretrain

    return {"pretrain": pretrain, "finetune": finetune, "python -m finetune.evaluate": evaluate,
            "python -m finetune.predict": predict, "python -m analysis": analyze, "python -m analysis plot": plot,
            "python -m analysis summary": summary, "python -m data_tools.demo_images": demo_images,
            "build-shards": build_shards}


@pytest.mark.parametrize("prog", list(_entry_points()))
def test_a_bad_command_line_is_one_line_in_every_tool(prog, capsys):
    # argparse printed its usage block and `PROG: error: ...` (and under a launcher, once per rank); build-shards
    # alone said it in one line
    from vit_mpp.processes.exits import run_main

    for argv in (["--bogus", "x"], ["--batch-size", "many"]):  # an unknown flag, a bad value or a missing one
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run_main(_entry_points()[prog], argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
        assert err.endswith(f"(see {prog} --help)") and ("--bogus" in argv) <= ("--bogus" in err or "required" in err)


def test_help_still_prints_and_exits_0(capsys):
    from vit_mpp.processes.exits import run_main

    with pytest.raises(SystemExit) as e:
        run_main(_entry_points()["python -m analysis summary"], ["--help"])
    assert e.value.code == 0 and "usage: python -m analysis summary" in capsys.readouterr().out


# A local path in the config that does not exist is found with the config, before torch is imported (seconds).
PROBE = """import sys
from vit_mpp.processes.exits import run_main
from {stage}.__main__ import main
try:
    run_main(main, sys.argv[1:])
finally:
    print("torch imported" if "torch" in sys.modules else "no torch", file=sys.stderr)
"""


@pytest.mark.parametrize("stage, args, message", [
    ("pretrain", ["data.shards=/nonexistent/shards"], "error: shard directory not found: /nonexistent/shards ("),
    ("pretrain", ["data.shards=[{demo},/nonexistent/b]"], "error: shard directory not found: /nonexistent/b ("),
    ("pretrain", ["data.val_shards=/nonexistent/v/_info.json"], "error: manifest not found: /nonexistent/v/_info.json"),
    ("finetune", ["init.checkpoint=/nonexistent/encoder.safetensors"],
     "error: checkpoint not found: /nonexistent/encoder.safetensors (init.checkpoint: "),
    ("finetune", ["init.checkpoint=local-dir:/nonexistent/export"], "error: checkpoint not found: /nonexistent/export"),
])
def test_a_missing_local_path_is_one_line_before_torch_is_imported(stage, args, message, demo_shards, tmp_path):
    import subprocess
    import sys

    from tests.helpers.processes import REPO, subprocess_env

    argv = ["--config", f"configs/{stage}/tiny.yaml", f"data.shards={demo_shards}", f"train.run_dir={tmp_path / 'r'}",
            *[a.format(demo=demo_shards) for a in args]]
    result = subprocess.run([sys.executable, "-c", PROBE.format(stage=stage), *argv], capture_output=True, text=True,
                            timeout=120, env=subprocess_env(), cwd=REPO)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[0].startswith(message) and lines[1:] == ["no torch"], result.stderr
    assert not (tmp_path / "r").exists()


def test_remote_locations_and_names_are_left_to_the_run():
    from vit_mpp.data.manifest import ManifestError, check_location
    from vit_mpp.models.export_folder import check_checkpoint_path

    for url in ("s3://bucket/shards", "https://host/shards", "gs://b/x/_info.json", "pipe:cat /x", "hf://d/x"):
        check_location(url)  # reading them (with deadlines) is the run's: not found here
    for name in ("", "hf-hub:someone/tiny-mpp", "vit_base_patch16_224.augreg_in21k", "https://host/w.pth"):
        check_checkpoint_path(name)  # resolved by timm (which imports torch), or not a path
    with pytest.raises(ManifestError, match="shard directory not found: /nonexistent"):
        check_location("/nonexistent")


STOPPED_THEN_BAD_CONFIG = """
import os, signal, sys
from vit_mpp.config.engine import ConfigError
from vit_mpp.processes.exits import run_main
from vit_mpp.processes.stop_signals import stop_during_start_up

stop_during_start_up()
os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, as the main rank ends on the same error: kept for later

def main(argv):
    raise ConfigError("bad value")

run_main(main, [])
"""


def test_a_rank_stopped_before_its_config_failed_ends_at_once_without_a_line():
    # It waited QUIET_WAIT_S for the launcher's SIGTERM, which had come already, then printed the main rank's line again
    env = {**subprocess_env(), "TORCHELASTIC_RUN_ID": "test", "RANK": "1", "WORLD_SIZE": "2"}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", STOPPED_THEN_BAD_CONFIG], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and not result.stderr, result.stderr
    assert time.monotonic() - start < QUIET_WAIT_S


def test_ctrl_c_in_a_tool_is_one_line_and_status_130_and_build_shards_keeps_its_own(capsys):
    from vit_mpp.processes.exits import run_main

    def main(argv):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted; run the same command again\n"
    with pytest.raises(SystemExit) as e:  # build-shards says what its build kept (data_tools/cli.py)
        run_main(main, [], interrupted="interrupted; finished shards are kept")
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted; finished shards are kept\n"
