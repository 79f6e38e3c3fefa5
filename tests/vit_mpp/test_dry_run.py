"""--dry-run (pretrain, finetune, evaluate): every start-up check, the resolved config, the plan, the learning rate
at a few steps and where the run would start are printed, exit 0, and nothing is written; a check that fails is one
line, as in a real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune import evaluate
from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.processes import in_process
from tests.helpers.runs import run_tiny_finetune
from tests.helpers.shards import write_shard_set


def files_under(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*")}


def test_a_pretraining_dry_run_with_mixed_precision_no_writes_nothing(demo_shards, tmp_path, capsys):
    before = files_under(demo_shards)
    code, out, err = in_process(pretrain_main, ["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}",
                                                f"train.run_dir={tmp_path / 'run'}", "train.mixed_precision=no",
                                                "--dry-run"], capsys)
    assert code == 0, err
    assert not (tmp_path / "run").exists() and files_under(demo_shards) == before and list(tmp_path.iterdir()) == []
    assert out.startswith("dry run: nothing is written; the resolved config:\nmodel:\n  name: vit_tiny_patch16_224")
    assert "mixed_precision: 'no'" in out  # the word the user wrote, not a YAML boolean
    for shown in ("17 tokens", "global batch 8 = 1 process(es) x 8 per device", "augment: crop scale [0.35, 1.0]",
                  "learning rate: step 1 0.001", "would start a new run in"):
        assert shown in out, shown


def test_a_fine_tuning_dry_run_lists_every_regulariser_and_says_it_would_resume(tmp_path, encoder_export, capsys):
    shards = write_shard_set(tmp_path / "s", {"train": [24, 16], "val": [7, 6]})
    args = ["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}", f"train.run_dir={tmp_path / 'run'}",
            f"init.checkpoint={encoder_export}", "data.num_workers=0", "train.label_smoothing=0.1",
            "model.drop_path_rate=0.1", "augment.reprob=0.25", "augment.mixup=0.8", "train.ema_decay=0.99"]
    code, out, err = in_process(finetune_main, [*args, "--dry-run"], capsys)
    assert code == 0 and not (tmp_path / "run").exists(), err
    for shown in ("drop path 0.1", "random erasing p=0.25", "mixup 0.8", "label smoothing 0.1", "EMA decay 0.99",
                  "would start a new run"):
        assert shown in out, shown
    run_tiny_finetune(shards, tmp_path / "run", encoder_export, "train.epochs=1")
    before = files_under(tmp_path / "run")
    code, out, err = in_process(finetune_main, [*args[:6], "train.epochs=2", "train.extend=true", "--dry-run"],
                                capsys)
    assert code == 0 and "would resume" in out and "train.epochs" in out, err
    assert files_under(tmp_path / "run") == before


def test_a_dry_run_meets_the_errors_a_run_would_meet(tmp_path, capsys):
    shards = write_shard_set(tmp_path / "s", {"train": [8]}, bad={"train": range(8)})  # not one readable image
    code, _, err = in_process(pretrain_main, ["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
                                              f"train.run_dir={tmp_path / 'run'}", "data.val_split=", "--dry-run"],
                              capsys)
    assert code == 2 and err.startswith("error: set 'test' (split 'train'): sample train_000000 of ") and \
        "is not a readable image" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_evaluation_dry_run_writes_nothing(probe_run_for_dry_run, capsys):
    run, shards = probe_run_for_dry_run
    code, out, err = in_process(evaluate.main, ["--checkpoint", str(run / "export"), "--shards", str(shards),
                                                "--workers", "0", "--dry-run"], capsys)
    assert code == 0, err
    assert "dry run: nothing is written; would evaluate" in out and "(13 images in 2 shards)" in out
    assert not (run / "export-eval-val").exists()


@pytest.fixture
def probe_run_for_dry_run(tmp_path, encoder_export) -> tuple[Path, Path]:
    shards = write_shard_set(tmp_path / "s", {"train": [24, 16], "val": [7, 6]})
    run_tiny_finetune(shards, tmp_path / "run", encoder_export, "train.epochs=1", "data.val_split=")
    return tmp_path / "run", shards
