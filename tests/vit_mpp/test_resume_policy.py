"""What a re-run may do to a run directory (train.resume, train.extend): a finished run is not quietly extended (its
learning rate would jump back up), a length below the step reached is refused, `never` and `must` refuse a run
directory that holds a run / holds none; each is one line before anything is written."""

from __future__ import annotations

from pathlib import Path

from pretrain.__main__ import main as pretrain_main
from tests.helpers.processes import in_process
from tests.helpers.runs import read_metrics


def pretrain(shards: Path, run_dir: Path, capsys, *overrides: str) -> tuple[int, str, str]:
    return in_process(pretrain_main, ["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
                                      f"train.run_dir={run_dir}", "data.num_workers=0", "data.val_split=",
                                      *overrides], capsys)


def test_a_finished_run_is_extended_only_when_asked(demo_shards, tmp_path, capsys):
    assert pretrain(demo_shards, tmp_path, capsys, "train.steps=4")[0] == 0
    config = (tmp_path / "config.yaml").read_text()
    code, _, err = pretrain(demo_shards, tmp_path, capsys, "train.steps=8")
    assert code == 2 and err.startswith(f"error: {tmp_path} holds a finished run (step 4); train.steps=8 would "
                                        "extend it to step 8") and "set train.extend=true" in err
    assert (tmp_path / "config.yaml").read_text() == config  # refused before anything is written
    code, out, _ = pretrain(demo_shards, tmp_path, capsys, "train.steps=8", "train.extend=true")
    assert code == 0 and "note: the finished run goes on from step 4 to 8 (train.extend)" in out
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [2, 4, 6, 8]


def test_a_length_below_the_step_reached_is_refused(demo_shards, tmp_path, capsys):
    assert pretrain(demo_shards, tmp_path, capsys, "train.steps=4")[0] == 0
    code, _, err = pretrain(demo_shards, tmp_path, capsys, "train.steps=2")
    assert code == 2 and "train.steps=2 ends at step 2, before step 4, which the run in" in err


def test_resume_never_and_must(demo_shards, tmp_path, capsys):
    code, _, err = pretrain(demo_shards, tmp_path / "new", capsys, "train.resume=must")
    assert code == 2
    assert err.strip() == f"error: train.resume=must, but {tmp_path / 'new'} holds no checkpoint to resume"
    assert pretrain(demo_shards, tmp_path / "run", capsys, "train.steps=2", "train.resume=never")[0] == 0
    code, _, err = pretrain(demo_shards, tmp_path / "run", capsys, "train.steps=2", "train.resume=never")
    assert code == 2 and "train.resume=never, but" in err and "holds a run (step_000002)" in err
    assert pretrain(demo_shards, tmp_path / "run", capsys, "train.steps=2", "train.resume=must")[0] == 0
