"""The checks of `--device` and `--out` that predict, evaluate and analysis share (vit_mpp/tools/args.py): made
before any work, one ConfigError each."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.models import SMALL_MODEL, write_encoder_export
from vit_mpp.config.engine import ConfigError
from vit_mpp.durable import WriteFailed
from vit_mpp.errors import StoppedWriting
from vit_mpp.models.vit import create_vit
from vit_mpp.tools.args import (
    check_device,
    check_out_file,
    check_out_folder,
    make_out_folder,
    open_out_file,
    write_out_text,
)


def test_devices():
    assert check_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="--device banana: not a device"):
        check_device("banana")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda:1: this machine has 0 CUDA device"):
            check_device("cuda:1")
    else:
        with pytest.raises(ConfigError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}")


def test_out_files(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a folder: give a file name"):
        check_out_file(str(tmp_path))
    with pytest.raises(ConfigError, match=f"{tmp_path / 'f'} is a file, not a folder"):
        check_out_file(str(tmp_path / "f" / "a" / "b.csv"))
    assert check_out_file(str(tmp_path / "new" / "b.csv")) == tmp_path / "new" / "b.csv"


def test_an_output_file_never_replaces_a_model_a_shard_set_or_a_run_record(tmp_path):
    # predict --out runs/x/export/config.json replaced the export's config (the model no longer loaded), and
    # --out runs/x/metrics.jsonl the run's log
    export = write_encoder_export(tmp_path / "run" / "export", create_vit(SMALL_MODEL), SMALL_MODEL)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        (run / name).write_text("{}\n")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "_info.json").write_text("{}")
    for path, says in [(export / "config.json", "is inside an export"), (export / "new.csv", "is inside an export"),
                       (tmp_path / "shards" / "_info.json", "is one of a shard set's files"),
                       (tmp_path / "shards" / "train-000000.tar", "is one of a shard set's files"),
                       (run / "checkpoints" / "step_4" / "model.safetensors", "is inside a checkpoint"),
                       (run / "metrics.jsonl", "is one of a training run's records"),
                       (run / "summary.json", "is one of a training run's records")]:
        with pytest.raises(ConfigError, match=re.escape(f"--out {path} {says}: give a file of its own")):
            check_out_file(str(path))
    assert check_out_file(str(run / "predictions.csv")) == run / "predictions.csv"  # a file of its own in a run
    grid = tmp_path / "shards" / "_samples.png"  # docs/build_shards.md: inspect OUT --grid OUT/_samples.png
    assert check_out_file(str(grid), "--grid") == grid
    assert not (tmp_path / "new").exists()  # created when the file is written, not by the check


def test_out_folders(tmp_path):
    (tmp_path / "f").write_text("x")
    export = write_encoder_export(tmp_path / "export", create_vit(SMALL_MODEL), SMALL_MODEL)
    with pytest.raises(ConfigError, match="is a file: give a folder"):
        check_out_folder(tmp_path / "f")
    with pytest.raises(ConfigError, match="is an export: give a folder"):
        check_out_folder(export)
    # evaluate wrote evaluation.json and its confusion matrix among a data set's shards
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "_info.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a shard set \(_info.json\): give a folder"):
        check_out_folder(tmp_path / "shards")
    # evaluate into a training run's directory wrote over the confusion matrix the run had made
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("train: {}\n")
    with pytest.raises(ConfigError, match=r"is a training run's directory \(config.yaml, metrics.jsonl\): give a fold"):
        check_out_folder(run)
    assert check_out_folder(run / "test") == run / "test"  # a folder of its own inside it: compare --val's scores
    assert check_out_folder(tmp_path / "results") == tmp_path / "results"


def test_an_output_in_a_place_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    # a read-only place (a read-only mount: root cannot write there either) for --out of evaluate or analysis was an
    # OSError traceback, evaluate's after the whole evaluation; summary --csv did not check its file at all
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    with pytest.raises(ConfigError, match=f"--out {locked / 'results'}: {locked} is not writable"):
        check_out_folder(locked / "results")
    with pytest.raises(ConfigError, match=f"--out {locked}: {locked} is not writable"):
        check_out_folder(locked)
    with pytest.raises(ConfigError, match=f"--csv {locked / 'a' / 'b.csv'}: {locked} is not writable"):
        check_out_file(str(locked / "a" / "b.csv"), "--csv")


def test_what_the_checks_cannot_foresee_is_one_line_too():
    # under /proc nothing can be created, whatever the permissions say
    with pytest.raises(ConfigError, match="--out /proc/no-such/results cannot be created: no such file or directory"):
        make_out_folder(Path("/proc/no-such/results"))
    with pytest.raises(WriteFailed, match="--csv /proc/no-such/a.csv cannot be written: no such file or directory"):
        with open_out_file("/proc/no-such/a.csv", "--csv"):
            pass


def test_summary_checks_its_csv_before_reading_the_runs(tmp_path, capsys):
    from analysis.run_table import main as summary
    from vit_mpp.processes.exits import run_main

    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as e:
        run_main(summary, [str(tmp_path / "not-a-run"), "--csv", str(tmp_path / "file" / "t.csv")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: --csv {tmp_path / 'file' / 't.csv'}: {tmp_path / 'file'} " \
                                              "is a file, not a folder"


@pytest.fixture
def default_sigterm():
    """SIGTERM's default action in this test (a pytest worker may have its own handler), restored after."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def test_a_stop_signal_while_an_output_is_written_removes_its_temporary_file(tmp_path, default_sigterm):
    # The real command under a real SIGTERM: tests/finetune/test_predict.py. Here: where the handler is and is not.
    out = tmp_path / "out.csv"
    out.write_text("old\n")
    with pytest.raises(StoppedWriting, match=f"stopped \\(SIGTERM\\): {re.escape(str(out))} was not written") as e:
        with open_out_file(out) as f:
            f.write("new\n")
            os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.status == 128 + signal.SIGTERM and not isinstance(e.value, Exception)  # no `except Exception`
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"] and out.read_text() == "old\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default back once the output is written
    write_out_text(out, "whole\n")
    assert out.read_text() == "whole\n" and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_stop_handler_someone_set_is_left_alone_while_an_output_is_written(tmp_path, default_sigterm):
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))  # a training run's preemption handler
    with open_out_file(tmp_path / "out.csv") as f:
        f.write("row\n")
        os.kill(os.getpid(), signal.SIGTERM)
    assert got == [signal.SIGTERM] and (tmp_path / "out.csv").read_text() == "row\n"
