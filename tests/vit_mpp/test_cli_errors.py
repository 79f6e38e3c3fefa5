"""User errors end in one line on stderr and exit status 2, not a traceback."""

from __future__ import annotations

import pytest

from tests.helpers.processes import run_module


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
    from vit_mpp import cli
    from vit_mpp.config.engine import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(cli, "QUIET_WAIT_S", 0.01)

    def main(argv):
        raise ConfigError("bad value")

    with pytest.raises(SystemExit) as e:
        cli.run_main(main, [])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == expected


def _entry_points():
    from analysis.analyze import main as analyze
    from analysis.compare_runs import main as plot
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
    from vit_mpp.cli import run_main

    for argv in (["--bogus", "x"], ["--batch-size", "many"]):  # an unknown flag, a bad value or a missing one
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run_main(_entry_points()[prog], argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
        assert err.endswith(f"(see {prog} --help)") and ("--bogus" in argv) <= ("--bogus" in err or "required" in err)


def test_help_still_prints_and_exits_0(capsys):
    from vit_mpp.cli import run_main

    with pytest.raises(SystemExit) as e:
        run_main(_entry_points()["python -m analysis summary"], ["--help"])
    assert e.value.code == 0 and "usage: python -m analysis summary" in capsys.readouterr().out
