"""`python -m finetune.evaluate`: the numbers of fine-tuning's own evaluation, each sample once with any number of
processes, the outputs, and one line `error: ...` (exit 2) for each bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetune import evaluate
from tests.helpers.models import SMALL, write_encoder_export
from tests.helpers.processes import launch, run_module
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.export import Export, write_export
from vit_mpp.models.vit import create_vit
from vit_mpp.processes.exits import run_main

N_VAL = 13  # the validation images of the `shards` fixture (tests/finetune/conftest.py)


@pytest.fixture
def run(probe_run) -> Path:
    """The run these tests evaluate: a linear probe of a random encoder (tests/finetune/conftest.py)."""
    return probe_run


def classifier(out: Path, num_classes: int, class_names: list[str] | None) -> Path:
    cfg = ModelConfig(img_size=24, **SMALL)
    return write_export(Export(out, create_vit(cfg, num_classes).state_dict(), cfg, num_classes=num_classes,
                               mean=(0.5,) * 3, std=(0.5,) * 3, class_names=class_names), kind="classifier")


def test_the_numbers_are_those_of_fine_tunings_final_evaluation(run, shards):
    record = json.loads((run / "export" / "config.json").read_text())["vit_mpp"]["metrics"]
    export_files = sorted(p.relative_to(run) for p in (run / "export").rglob("*"))
    report = evaluate.main(["--checkpoint", str(run / "export"), "--shards", str(shards), "--workers", "0"])
    m = report["metrics"]
    assert m["val_samples"] == record["val_samples"] == N_VAL
    assert (m["val_top1"], m["val_mean_class_acc"]) == (record["val_top1"], record["val_mean_class_acc"])
    assert m["val_loss"] == pytest.approx(record["val_loss"], rel=1e-6)  # the same sum, added in another order
    trained = json.loads((run / "confusion_matrix.json").read_text())  # the final evaluation's
    assert report["confusion"] == trained["confusion"] and len({tuple(r) for r in trained["confusion"]}) > 1
    assert report["per_class_acc"] == pytest.approx(trained["per_class_acc"], abs=1e-6)
    assert report["class_names"] == ["a", "b", "c"]
    # written beside the export folder, never into it
    out = run / "export-eval-val"
    assert json.loads((out / "evaluation.json").read_text()) == report
    assert (out / "confusion_matrix.png").stat().st_size > 1000 and (out / "confusion_matrix.json").is_file()
    assert sorted(p.relative_to(run) for p in (run / "export").rglob("*")) == export_files


def test_the_default_out_is_beside_the_outermost_export(run):
    assert evaluate.default_out(str(run / "export" / "best"), "val") == run / "export-best-eval-val"
    assert evaluate.default_out(f"local-dir:{run / 'export'}", "test") == run / "export-eval-test"
    assert evaluate.default_out(str(run / "export" / "model.safetensors"), "val") == run / "export-eval-val"
    assert evaluate.default_out("hf-hub:me/vit@v1", "val") == Path("hf-hub_me_vit_v1-eval-val")


def test_batches_and_workers_do_not_change_the_numbers(run, shards, tmp_path):
    one = evaluate.main(["--checkpoint", str(run / "export" / "best"), "--shards", str(shards), "--workers", "0",
                         "--out", str(tmp_path / "a")])
    other = evaluate.main(["--checkpoint", str(run / "export" / "best"), "--shards", str(shards), "--workers", "2",
                           "--batch-size", "5", "--out", str(tmp_path / "b")])
    assert one["confusion"] == other["confusion"] and one["metrics"]["val_samples"] == N_VAL
    best = json.loads((run / "export" / "best" / "config.json").read_text())["vit_mpp"]["metrics"]
    assert one["metrics"]["val_top1"] == best["val_top1"]


def test_two_processes_count_each_sample_once_and_agree_with_one(run, shards, tmp_path):
    result = launch("-m", "finetune.evaluate", "--checkpoint", str(run / "export"), "--shards", str(shards),
                    "--workers", "1", "--batch-size", "4", "--out", str(tmp_path / "two"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("per-class accuracy") == 1  # printed by the main process only
    two = json.loads((tmp_path / "two" / "evaluation.json").read_text())
    one = evaluate.main(["--checkpoint", str(run / "export"), "--shards", str(shards), "--workers", "0",
                         "--out", str(tmp_path / "one")])
    assert two["num_processes"] == 2 and two["metrics"]["val_samples"] == N_VAL  # 7 + 6 images, padded to 2 x 7
    assert two["confusion"] == one["confusion"] and two["metrics"]["val_top1"] == one["metrics"]["val_top1"]
    assert two["metrics"]["val_loss"] == pytest.approx(one["metrics"]["val_loss"], rel=1e-6)


@pytest.fixture(scope="module")
def bad(shards, tmp_path_factory) -> dict[str, Path]:
    """Inputs evaluate must refuse."""
    root = tmp_path_factory.mktemp("bad")
    unnamed = root / "unnamed_shards"  # labels 0..2, and a manifest that names no classes
    shutil.copytree(shards, unnamed)
    info = json.loads((unnamed / "_info.json").read_text())
    info.pop("class_names"), info.pop("num_classes")
    (unnamed / "_info.json").write_text(json.dumps(info))
    unlabelled = root / "unlabelled_shards"  # an indexed set counting samples without a usable label
    shutil.copytree(shards, unlabelled)
    info = json.loads((unlabelled / "_info.json").read_text())
    info["splits"]["val"].update(num_unlabelled=2, num_bad_labels=1)
    (unlabelled / "_info.json").write_text(json.dumps(info))
    run = root / "run"  # a training run's directory, with the confusion matrix its last evaluation wrote
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "confusion_matrix.json"):
        (run / name).write_text("{}\n")
    return {"run": run, "encoder": write_encoder_export(root / "encoder", create_vit(ModelConfig(img_size=16, **SMALL)),
                                            ModelConfig(img_size=16, **SMALL)),
            "two": classifier(root / "two", 2, ["a", "b"]), "two_unnamed": classifier(root / "two_unnamed", 2, None),
            "renamed": classifier(root / "renamed", 3, ["a", "b", "x"]),
            "reordered": classifier(root / "reordered", 3, ["c", "b", "a"]), "unnamed_shards": unnamed,
            "unlabelled_shards": unlabelled}


BAD_INPUTS = [  # (id, arguments, what the one line must say)
    ("missing checkpoint", ["--checkpoint", "{root}/nothing", "--shards", "{shards}"], "checkpoint not found"),
    ("encoder export", ["--checkpoint", "{encoder}", "--shards", "{shards}"],
     "is not a fine-tuned classifier export"),
    ("missing split", ["--checkpoint", "{renamed}", "--shards", "{shards}", "--split", "test"],
     "split 'test' not in"),
    ("missing shards", ["--checkpoint", "{renamed}", "--shards", "{root}/nothing"], "shard directory not found"),
    ("class count", ["--checkpoint", "{two}", "--shards", "{shards}"],
     "the classifier has 2 classes but the shards at"),
    ("labels outside the classes", ["--checkpoint", "{two_unnamed}", "--shards", "{unnamed_shards}", "--workers", "1"],
     "has label 2, outside the 2 classes"),
    ("samples without labels", ["--checkpoint", "{renamed}", "--shards", "{unlabelled_shards}"],
     "has 2 sample(s) without a usable label (1 of them with a .cls that is not a class index"),
    ("class names", ["--checkpoint", "{renamed}", "--shards", "{shards}"],
     "class 2 is 'x' in the classifier, 'c' in the shards"),
    ("class order", ["--checkpoint", "{reordered}", "--shards", "{shards}"], "the same names in another order"),
    ("out is an export", ["--checkpoint", "{renamed}", "--shards", "{shards}", "--out", "{two}"],
     "is an export: give a folder for the results"),
    ("out is a training run", ["--checkpoint", "{renamed}", "--shards", "{shards}", "--out", "{run}"],
     "is a training run's directory (config.yaml, metrics.jsonl): give a folder for the results"),
    ("batch size", ["--checkpoint", "{renamed}", "--shards", "{shards}", "--batch-size", "0"],
     "--batch-size must be at least 1"),
]


def fill(args: list[str], bad: dict[str, Path], shards: Path, root: Path) -> list[str]:
    return [a.format(shards=shards, root=root, **bad) for a in args]


@pytest.mark.parametrize("args, message", [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS])
def test_a_bad_input_is_one_line(args, message, bad, shards, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(evaluate.main, fill(args, bad, shards, tmp_path) + ["--workers", "0"] * ("--workers" not in args))
    assert e.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.parametrize("row", [BAD_INPUTS[1], BAD_INPUTS[5]], ids=lambda row: row[0])
def test_a_bad_input_is_one_line_under_python_m(row, bad, shards, tmp_path):
    result = run_module("finetune.evaluate", *fill(row[1], bad, shards, tmp_path), timeout=120)
    assert result.returncode == 2
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and row[2] in lines[0], result.stderr


def test_renamed_classes_are_evaluated_with_a_warning_when_asked(bad, shards, tmp_path, capsys):
    report = evaluate.main(["--checkpoint", str(bad["renamed"]), "--shards", str(shards), "--workers", "0",
                            "--ignore-class-names"])
    assert "warning: the shards' class names differ" in capsys.readouterr().out
    assert report["class_names"] == ["a", "b", "x"] and report["metrics"]["val_samples"] == N_VAL
    assert (bad["renamed"].parent / "renamed-eval-val" / "evaluation.json").is_file()
