"""`python -m experiments.compare`: the paired table's maths, the equal-compute epochs, resuming (a finished run is not
run again, a half-finished one is), the supervised arm skipped without labels, and every mistake as one line before
anything runs. The stages are faked here (their dry runs and launches); one slow test runs the real ones."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from data_tools.cli import main as build_main
from experiments import compare, compare_arms, compare_report, run_scheduler
from tests.helpers.disks import small_disk
from tests.helpers.processes import REPO, Background, in_process, run_module, subprocess_env
from tests.helpers.runs import read_metrics
from tests.helpers.shards import write_shard_set
from vit_mpp.data.manifest import read_manifest
from vit_mpp.processes.exits import run_main

PRE_STEPS, PRE_BATCH, FT_EPOCHS, FT_BATCH = 20, 8, 3, 4
REAL_LAUNCH = run_scheduler.launch  # FakeStages replaces it


def dry_run_text(cmd: list[str]) -> str:
    """What a stage's --dry-run prints, as far as compare reads it: the resolved config, then the start line."""
    module = cmd[cmd.index("-m") + 1]
    over = dict(c.split("=", 1) for c in cmd if "=" in c and not c.startswith("-"))
    samples = read_manifest(over["data.shards"])["splits"]["train"]["num_samples"]  # a subset's too
    if module == "pretrain":
        batch, epochs, steps = PRE_BATCH, None, int(over.get("train.steps", PRE_STEPS))
    else:
        batch = FT_BATCH
        epochs = int(over.get("train.epochs", FT_EPOCHS))
        steps = epochs * max(1, samples // batch)
    train = {"batch_size": batch, **({"epochs": epochs} if epochs else {"steps": steps})}
    cfg = {"model": {"name": "vit", "img_size": 16, "patch_size": 4}, "train": {**train, "crop": [0.5, 1.0]}}
    return (f"{run_scheduler.DRY_RUN_HEAD}\n{yaml.safe_dump(cfg, sort_keys=False)}model vit (1M params)\n"
            f"data {samples} train images\nlearning rate: step 1 0.1\n"
            f"would start a new run in {over['train.run_dir']}, {steps} steps\n")


def pool_of(overrides: list[str]) -> str:
    """The pool a run's command gives it, the last semi.pool= deciding ('' for none)."""
    return ([o.split("=", 1)[1] for o in overrides if o.startswith("semi.pool=")] or [""])[-1]


class FakeStages:
    """Stands for the stages' subprocesses: dry runs answer from the command, a launch writes what a finished run
    leaves (metrics.jsonl up to its last step with a val_top1, config.yaml, an export); records every call."""

    def __init__(self, monkeypatch, top1=lambda stage: 0.5, scored=lambda stage: 0.55) -> None:
        self.dry_runs, self.launched, self.top1, self.scored = [], [], top1, scored
        monkeypatch.setattr(run_scheduler, "dry_run", self.dry_run)
        monkeypatch.setattr(run_scheduler, "launch", self.launch)

    def dry_run(self, cmd):
        self.dry_runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, dry_run_text(cmd), "")

    def launch(self, stage, log, threads):
        self.launched.append(stage.name)
        run_dir = stage.run_dir
        pool = {"pseudo_kept": 0.5, "pseudo_acc": 0.75} if pool_of(stage.overrides) else {}
        records = [{"step": s, "loss": 1.0, "elapsed_s": 6.0 * s, **pool} for s in range(1, stage.steps + 1)]
        scored = {"ema_val_pseudo_kept": 0.6, "ema_val_pseudo_acc": 0.7} if pool else {}
        records.append({"step": stage.steps, "val_top1": self.top1(stage), "elapsed_s": 6.0 * stage.steps, **scored})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "summary.json").write_text(json.dumps({"step": stage.steps, "total_s": 6.0 * stage.steps}))
        (run_dir / "config.yaml").write_text(f"train:\n  batch_size: {stage.batch}\n")
        (run_dir / "export").mkdir(exist_ok=True)
        (run_dir / "export" / "config.json").write_text("{}")
        (run_dir / "export" / "model.safetensors").write_bytes(b"")
        if stage.score:  # --val: its export scored on --test, as finetune.evaluate writes it
            (run_dir / compare_arms.SCORES).mkdir(exist_ok=True)
            (run_dir / compare_arms.SCORES / "evaluation.json").write_text(
                json.dumps({"metrics": {"val_top1": self.scored(stage)}}))
        return 0


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    unlabelled = write_shard_set(root / "unlabelled_pool", {"train": [60]}, labels={"train": [None] * 60})
    info = json.loads((unlabelled / "_info.json").read_text())
    del info["num_classes"], info["class_names"]  # as build-shards writes a set without labels
    (unlabelled / "_info.json").write_text(json.dumps(info))
    return {"pool": write_shard_set(root / "pool", {"train": [60], "val": [6]}), "unlabelled_pool": unlabelled,
            "labelled": write_shard_set(root / "labelled", {"train": [12], "val": [6]}),
            "test": write_shard_set(root / "test", {"test": [9]})}


def argv(shards: dict[str, Path], out: Path, *more: str, pool: str = "pool") -> list[str]:
    return ["--unlabelled", str(shards[pool]), "--labelled", str(shards["labelled"]), "--test", str(shards["test"]),
            "--pretrain-config", "configs/pretrain/tiny.yaml", "--finetune-config", "configs/finetune/tiny.yaml",
            "--out", str(out), *more]


# ---------------------------------------------------------------------------------------------- the table's maths


def test_the_paired_table_is_per_seed_then_mean_and_sample_std():
    top1 = {"scratch": {0: 0.70, 1: 0.60, 2: 0.65}, "mpp": {0: 0.80, 1: 0.75, 2: 0.70},
            "scratch_equal": {0: 0.78, 1: 0.74, 2: None}, "probe": {0: 0.30, 1: 0.35, 2: 0.40}}
    rows = compare_report.table(top1, list(top1), [0, 1, 2])
    assert rows["arms"]["mpp"]["mean"] == pytest.approx(0.75)
    assert rows["arms"]["mpp"]["std"] == pytest.approx(statistics.stdev([0.80, 0.75, 0.70]))
    assert rows["arms"]["scratch_equal"]["mean"] == pytest.approx(0.76)  # the seed without a result left out
    assert list(rows["differences"]) == ["mpp - scratch", "mpp - scratch_equal", "mpp - probe"]
    diff = rows["differences"]["mpp - scratch"]
    assert diff["per_seed"] == pytest.approx({0: 0.10, 1: 0.15, 2: 0.05})  # paired by seed
    assert diff["mean"] == pytest.approx(0.10) and diff["std"] == pytest.approx(0.05)
    assert rows["differences"]["mpp - scratch_equal"]["per_seed"].keys() == {0, 1}  # only seeds both arms have
    one = compare_report.table({"scratch": {0: 0.5}, "mpp": {0: 0.6}}, ["scratch", "mpp"], [0])
    assert one["differences"]["mpp - scratch"]["std"] is None  # one seed: no spread to show
    assert compare_report.shown(0.1, None, signed=True) == "+0.100" and compare_report.shown(
        0.75, 0.05) == "0.750 ± 0.050"


def test_variants_are_compared_with_the_reference_and_every_baseline():
    arms = ["scratch", "mpp", "mpp-l2", "supervised", "probe", "probe-avg", "scratch_equal"]
    assert compare_report.differences(arms) == [
        ("mpp", "scratch"), ("mpp", "supervised"), ("mpp", "probe"), ("mpp", "probe-avg"), ("mpp", "scratch_equal"),
        ("mpp-l2", "mpp"), ("mpp-l2", "scratch"), ("mpp-l2", "supervised"), ("mpp-l2", "scratch_equal")]


# ----------------------------------------------------------------------------------------------- equal compute


def test_equal_compute_epochs():
    # The digits recipe: 2,000 MPP steps x 128 + 1,200 fine-tuning steps x 50 = 316,000 images; 100 labelled
    # images at batch 50 are 2 steps (100 images) an epoch, so 3,160 epochs.
    assert compare_arms.equal_epochs(2000 * 128 + 1200 * 50, 2, 50) == 3160
    assert compare_arms.equal_epochs(256_000, 380, 50) == 13  # the supervised pretraining on 19,000 pool images
    assert compare_arms.equal_epochs(10, 4, 50) == 1  # at least one epoch
    assert compare_arms.equal_epochs(150, 1, 100) == 2  # halves round up


def test_the_equal_compute_arms_get_the_mpp_arms_images(tmp_path, monkeypatch, shards):
    fake = FakeStages(monkeypatch)
    report = compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "1"))
    mpp_images = PRE_STEPS * PRE_BATCH + FT_EPOCHS * (12 // FT_BATCH) * FT_BATCH  # 160 + 36
    # scratch_equal: 196 images / (3 steps x 4) = 16.3 -> 16 epochs; supervised: 160 / (15 steps x 4) -> 3 epochs
    assert report["epochs"] == {"scratch_equal": 16, "supervised": 3}
    assert report["cost"]["mpp"]["images"] == mpp_images
    assert report["cost"]["scratch_equal"]["images"] == 16 * 3 * FT_BATCH  # as near as whole epochs get
    assert report["cost"]["supervised"]["images"] == 3 * 15 * FT_BATCH + 36
    assert report["cost"]["probe"]["images"] == mpp_images  # the MPP pretraining it reads, and its own run
    assert len(fake.launched) == 2 * 7
    cmd = json.loads((tmp_path / "out/seed1/scratch_equal/finetune" / run_scheduler.SIDECAR).read_text())["command"]
    assert cmd[-1] == "train.epochs=16" and "init.checkpoint=" in cmd and "train.seed=1" in cmd
    probe = json.loads((tmp_path / "out/seed0/probe/finetune" / run_scheduler.SIDECAR).read_text())["command"]
    assert f"init.checkpoint={tmp_path / 'out/seed0/mpp/pretrain/export'}" in probe
    assert "train.mode=linear_probe" in probe and f"data.val_shards={shards['test']}" in probe
    assert "data.val_split=test" in probe  # the test set's own split, found in its manifest


def test_the_semi_arms_fine_tune_with_the_unlabelled_set_as_their_pool(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    report = compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "mpp,semi,semi_scratch",
                               "--set", "finetune:train.ema_decay=0.99", "semi.finetune:train.epochs=5"))
    # semi_scratch: the MPP pretraining's 160 images and the semi arm's fine-tuning's 60 = 220 -> 18 epochs of 3
    # steps x 4 (not its own fine-tuning's 36 as configured)
    assert report["epochs"] == {"semi_scratch": 18} and len(fake.launched) == 4
    assert report["cost"]["semi"]["images"] == PRE_STEPS * PRE_BATCH + 60  # the pretraining it reads, and its own
    semi = json.loads((tmp_path / "out/seed0/semi/finetune" / run_scheduler.SIDECAR).read_text())["command"]
    assert f"init.checkpoint={tmp_path / 'out/seed0/mpp/pretrain/export'}" in semi
    assert f"semi.pool={shards['pool']}" in semi and "train.ema_decay=0.99" in semi
    assert not any(o.startswith("semi.gate") for o in semi)  # the commands of runs made before the gate, reused
    scratch = json.loads((tmp_path / "out/seed0/semi_scratch/finetune" / run_scheduler.SIDECAR).read_text())["command"]
    assert "init.checkpoint=" in scratch and f"semi.pool={shards['pool']}" in scratch
    assert scratch[-1] == "train.epochs=18"
    assert compare_report.differences(["mpp", "semi", "semi_scratch", "supervised"]) == [
        ("mpp", "semi_scratch"), ("mpp", "supervised"), ("semi", "mpp"), ("semi", "semi_scratch"),
        ("semi", "supervised")]  # the pool's arm shows its gain over plain fine-tuning (semi - mpp)
    code, _, err = in_process(compare.main, argv(shards, tmp_path / "o2", "--arms", "mpp,semi", "--set",
                                                 "semi.finetune:semi.pool=elsewhere"), capsys)
    assert code == 2 and "compare sets semi.pool itself" in err


def test_a_finetune_config_with_a_pool_reaches_only_the_arms_with_the_pool(tmp_path, monkeypatch, shards):
    # A config made for the pool (configs/finetune/digits_pool.yaml) once gave its pool to every fine-tuning: the mpp
    # arm's "plain" fine-tuning and the supervised pretraining read it too, and semi - mpp measured nothing
    fake = FakeStages(monkeypatch)
    with_pool = tmp_path / "with_pool.yaml"
    with_pool.write_text((REPO / "configs/finetune/tiny.yaml").read_text()
                         + f"  ema_decay: 0.99\nsemi:\n  pool: {shards['labelled']}\n  ratio: 1\n")
    out = tmp_path / "out"
    compare.main([*argv(shards, out, "--seeds", "0", "--arms", "mpp,supervised,scratch,probe,semi,semi2,semi_scratch"),
                  "--finetune-config", str(with_pool)])
    def pool_read(cmd: list[str]) -> str:  # the command's semi.pool=, else its config file's
        given = [o for o in cmd if o.startswith("semi.pool=")]
        return pool_of(given) if given else str(shards["labelled"]) if str(with_pool) in cmd else ""

    pools = {}
    for side in out.glob(f"seed0/*/*/{run_scheduler.SIDECAR}"):
        pools[str(side.parent.relative_to(out / "seed0"))] = pool_read(json.loads(side.read_text())["command"])
    unlabelled = str(shards["pool"])
    assert pools == {"mpp/pretrain": "", "mpp/finetune": "", "supervised/pretrain": "", "supervised/finetune": "",
                     "scratch/finetune": "", "probe/finetune": "", "semi/finetune": unlabelled,
                     "semi2/finetune": unlabelled, "semi_scratch/finetune": unlabelled}
    assert all(pool_read(cmd) in ("", unlabelled) for cmd in fake.dry_runs)
    # a config without a pool leaves the commands as they were: the runs of earlier sweeps are reused
    compare.main(argv(shards, tmp_path / "plain", "--seeds", "0", "--arms", "mpp"))
    side = tmp_path / "plain/seed0/mpp/finetune" / run_scheduler.SIDECAR
    assert not any(o.startswith("semi.pool") for o in json.loads(side.read_text())["command"])


def test_a_finetune_config_with_a_gate_is_one_line_before_anything_runs(tmp_path, monkeypatch, shards, capsys):
    # The gate would read the labels of the test split compare validates on and tables
    fake = FakeStages(monkeypatch)
    gated = tmp_path / "gated.yaml"
    gated.write_text((REPO / "configs/finetune/tiny.yaml").read_text() + "semi:\n  gate: 0.5\n")
    code, _, err = in_process(compare.main, [*argv(shards, tmp_path / "out", "--arms", "mpp,semi"),
                                             "--finetune-config", str(gated)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --finetune-config {gated} sets semi.gate 0.5: compare validates every fine-tuning "
                          "on --test unless --val names a validation set of its own"), err
    assert not fake.dry_runs and not fake.launched and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------ --val


def test_with_val_the_runs_validate_on_it_and_the_table_is_their_exports_on_test(tmp_path, monkeypatch, shards):
    # the gate needs a validation set apart from the one reported: with --val compare can measure it
    FakeStages(monkeypatch, top1=lambda stage: 0.9, scored=lambda stage: {"mpp": 0.4}.get(stage.arm, 0.6))
    out = tmp_path / "out"
    val = f"{shards['pool']}:val"
    report = compare.main(argv(shards, out, "--seeds", "0", "--arms", "mpp,scratch,semi", "--val", val, "--set",
                               "semi.finetune:train.ema_decay=0.99", "semi.finetune:semi.gate=0.5"))
    assert report["table"]["arms"]["mpp"]["per_seed"] == {0: 0.4}  # the export on --test, not the last val_top1
    assert report["table"]["differences"]["semi - mpp"]["per_seed"] == {0: pytest.approx(0.2)}
    assert report["val"] == str(shards["pool"]) and report["val_split"] == "val"
    semi = json.loads((out / "seed0/semi/finetune" / run_scheduler.SIDECAR).read_text())["command"]
    assert f"data.val_shards={shards['pool']}" in semi and "data.val_split=val" in semi and "semi.gate=0.5" in semi
    text = (out / "compare.md").read_text()
    assert f"each run validated on {shards['pool']}:val, its final export scored on the test images" in text
    assert "(val 0.60 / 0.70)" in text  # the teacher's pseudo-labels of the images it validated on
    assert report["pool"]["semi"]["val_pseudo_acc"] == 0.7 and "test_pseudo_acc" not in report["pool"]["semi"]
    stage = next(s for s in compare_arms.plan_runs(compare.check_args(argv(
        shards, out, "--seeds", "0", "--arms", "mpp", "--val", val))[0])[0] if s.name == "seed0/mpp/finetune")
    assert stage.score_command[2:] == ["finetune.evaluate", "--checkpoint", str(out / "seed0/mpp/finetune/export"),
                                       "--shards", str(shards["test"]), "--split", "test", "--out",
                                       str(out / "seed0/mpp/finetune/test")]
    # a run trained whose scoring did not end is not finished: the same command scores it, and trains nothing
    stage.steps = 9  # as its dry run sized it: 3 epochs of 3 steps
    (out / "seed0/mpp/finetune/test/evaluation.json").write_text('{"metrics": {"val_')  # torn
    assert not run_scheduler.finished(stage) and run_scheduler.trained(stage)
    ran = []
    monkeypatch.setattr(run_scheduler.children, "run", lambda command, **kw: ran.append(command) or 0)
    assert REAL_LAUNCH(stage, tmp_path / "log", 1) == 0
    assert [c[2] for c in ran] == ["finetune.evaluate"]


@pytest.mark.parametrize("val, says", [
    ("{test}", "--val {test}: give the split too, SHARDS:SPLIT"),
    (":train", "--val :train: give the shards before the split, SHARDS:SPLIT"),
    ("{pool}:nope", "--val {pool} has no split 'nope'"),
    ("{test}:test", "--val {test}:test holds the shard {test}/test-000000.tar of --test: validate on a set apart"),
    ("{unlabelled_pool}:train", "--val {unlabelled_pool} carries no labels"),
    ("{labelled}:train", "--val {labelled}:train holds the shard {labelled}/train-000000.tar of --labelled: validate "
                         "on a set apart from the images the runs train on"),
    ("{nowhere}:val", "--val: "),
])
def test_a_bad_val_is_one_line_before_anything_runs(tmp_path, monkeypatch, shards, capsys, val, says):
    fake = FakeStages(monkeypatch)
    where = {**{k: str(v) for k, v in shards.items()}, "nowhere": str(tmp_path / "nowhere")}
    code, _, err = in_process(compare.main, argv(shards, tmp_path / "out", "--val", val.format(**where)), capsys)
    assert code == 2 and err.startswith(f"error: {says.format(**where)}") and err.count("\n") == 1, err
    assert not fake.dry_runs and not (tmp_path / "out").exists()


def test_a_sweep_with_a_val_drawn_from_labelled_draws_its_subsets_apart_from_it(tmp_path, monkeypatch, shards,
                                                                               capsys):
    FakeStages(monkeypatch)
    val = tmp_path / "val"
    assert in_process(build_main, ["subset", str(shards["labelled"]), str(val), "--per-class", "2"], capsys)[0] == 0
    out = tmp_path / "out"
    report = compare.main(argv(shards, out, "--seeds", "0", "1", "--arms", "mpp", "--labels-per-class", "2", "all",
                               "--val", f"{val}:train"))
    assert any("at point all the fine-tunings train on --labelled whole" in n for n in report["points"]["k2"]["notes"])
    held = keys(val)
    for seed in (0, 1):
        drawn = out / f"labelled/k2_s{seed}"
        assert len(keys(drawn)) == 6 and not keys(drawn) & held  # 4 of each class, 2 of them --val's: 2 left
        assert read_manifest(drawn)["subset"]["exclude"][0]["of"] == str(val)
    # without --val the subsets left in out were drawn otherwise: one line, not a silent mix
    for seed in (0, 1):
        shutil.rmtree(out / f"seed{seed}")  # (its runs validated on --val, which says so first)
    code, _, err = in_process(compare.main, argv(shards, out, "--seeds", "0", "--arms", "mpp", "--labels-per-class",
                                                 "2"), capsys)
    assert code == 2 and f"apart from {val}): give another --out" in err, err
    # nor with a --val drawn again since: the subsets were drawn apart from other images
    assert in_process(build_main, ["subset", str(shards["labelled"]), str(val), "--per-class", "2", "--seed", "9",
                                   "--overwrite"], capsys)[0] == 0
    code, _, err = in_process(compare.main, argv(shards, out, "--seeds", "0", "--arms", "mpp", "--labels-per-class",
                                                 "2", "--val", f"{val}:train"), capsys)
    assert code == 2 and f"apart from {val}): give another --out" in err, err


def test_a_val_drawn_from_the_same_source_as_the_labels_is_refused_where_they_overlap(tmp_path, monkeypatch, shards,
                                                                                       capsys):
    # a --val that is not a subset of --labelled but of the same source: the records tell, and the keys count
    fake = FakeStages(monkeypatch)
    source = write_shard_set(tmp_path / "source", {"train": [30], "val": [6]})

    def subset(out: Path, *more: str) -> int:
        return in_process(build_main, ["subset", str(source), str(out), *more], capsys)[0]

    assert subset(tmp_path / "k4_s0", "--per-class", "4") == 0
    assert subset(tmp_path / "val", "--per-class", "6", "--seed", "1") == 0  # 18 of 30: shares some of the 12
    val, labelled = tmp_path / "val", tmp_path / "k4_s{seed}"
    n = len(keys(val) & keys(tmp_path / "k4_s0"))
    assert n
    without_sweep = argv({**shards, "labelled": labelled}, tmp_path / "out", "--seeds", "0", "--arms", "mpp", "--val",
                         f"{val}:train")
    code, _, err = in_process(compare.main, without_sweep, capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: --val {val}:train holds {n} of the images of --labelled {tmp_path / 'k4_s0'} (drawn from the same "
        "source): validate on a set apart from the images the runs train on (build-shards subset --exclude draws "
        "one)"], err
    # a sweep over --labelled = the source: its subsets are drawn apart only from a --val drawn from it, so a --val
    # drawn from a subset of it is found in the first seed's subsets, checked before anything is written
    assert subset(tmp_path / "val2", "--per-class", "8", "--seed", "3") == 0
    assert in_process(build_main, ["subset", str(tmp_path / "val2"), str(tmp_path / "val3"), "--per-class", "6"],
                      capsys)[0] == 0
    sweep = argv({**shards, "labelled": source}, tmp_path / "out", "--seeds", "0", "--arms", "mpp", "--val",
                 f"{tmp_path / 'val3'}:train", "--labels-per-class", "4")
    code, _, err = in_process(compare.main, sweep, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --val {tmp_path / 'val3'}:train holds ") \
        and "of the images of the subset k4 of seed 0 (drawn from the same source)" in lines[0], err
    assert not fake.dry_runs and not (tmp_path / "out").exists()
    # drawn apart (from the labels, or by the sweep from --val): accepted
    assert subset(tmp_path / "apart", "--per-class", "4", "--seed", "1", "--exclude", str(tmp_path / "k4_s0")) == 0
    assert compare.main(argv({**shards, "labelled": labelled}, tmp_path / "ok", "--seeds", "0", "--arms", "mpp",
                             "--val", f"{tmp_path / 'apart'}:train"))


def test_the_val_check_reads_the_keys_of_val_once_for_every_seed(tmp_path, monkeypatch, shards, capsys):
    # each seed's --labelled compared with --val read --val's keys again (12 reads for 4 points x 3 seeds)
    from vit_mpp.data import lineage

    FakeStages(monkeypatch)
    source = write_shard_set(tmp_path / "source", {"train": [30], "val": [6]})
    for seed in (0, 1, 2):
        assert in_process(build_main, ["subset", str(source), str(tmp_path / f"k2_s{seed}"), "--per-class", "2",
                                       "--seed", str(seed)], capsys)[0] == 0
    val = tmp_path / "val"
    assert in_process(build_main, ["subset", str(source), str(val), "--per-class", "3", "--seed", "9",
                                   *(f"--exclude={tmp_path / f'k2_s{seed}'}" for seed in (0, 1, 2))], capsys)[0] == 0
    read, real = [], lineage.split_keys
    monkeypatch.setattr(lineage, "split_keys", lambda of, *more: read.append(Path(of.location).name) or real(of, *more))
    assert compare.main(argv({**shards, "labelled": tmp_path / "k2_s{seed}"}, tmp_path / "out", "--seeds", "0", "1",
                             "2", "--arms", "mpp", "--val", f"{val}:train"))
    assert sorted(read) == ["k2_s0", "k2_s1", "k2_s2", "val"], read


def keys(folder: Path) -> set[str]:
    """The sample keys of a set's train split."""
    found = set()
    for tar in sorted(folder.glob("train-*.tar")):
        with tarfile.open(tar) as t:
            found |= {m.name.split(".")[0] for m in t.getmembers()}
    return found


# --------------------------------------------------------------------------------------------------- resuming


def test_a_finished_run_is_reused_and_a_half_finished_one_resumed(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch, top1=lambda stage: 0.9 if "mpp" in stage.name else 0.6)
    args = argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp", "--jobs", "2", "--threads", "3")
    first = compare.main(args)
    assert json.loads((tmp_path / "out/seed0/mpp/pretrain" / run_scheduler.SIDECAR).read_text())["threads"] == 3
    assert sorted(fake.launched) == ["seed0/mpp/finetune", "seed0/mpp/pretrain", "seed0/scratch/finetune"]
    assert fake.launched.index("seed0/mpp/pretrain") < fake.launched.index("seed0/mpp/finetune")
    # the pretraining, mpp's fine-tuning (with the pretraining's architecture: its export is to come) and scratch's
    assert len(fake.dry_runs) == 3
    given = [run for run in fake.dry_runs if "model.patch_size=4" in run]
    assert len(given) == 1 and "finetune" in given[0] and "init.checkpoint=" in given[0]
    out = capsys.readouterr().out
    assert "[1/3] " in out and "3/3 done" in out and "eta" in out
    assert first["table"]["differences"]["mpp - scratch"]["mean"] == pytest.approx(0.3)

    fake.launched.clear()
    half = tmp_path / "out/seed0/scratch/finetune"
    lines = (half / "metrics.jsonl").read_text().splitlines()
    (half / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")  # stopped at step 2
    second = compare.main(args)
    assert fake.launched == ["seed0/scratch/finetune"] and len(fake.dry_runs) == 3  # lengths kept from the first
    assert second["table"] == first["table"]
    fake.launched.clear()
    compare.main(args)
    assert fake.launched == []
    assert "3 of 3 runs finished earlier: reused" in capsys.readouterr().out
    for name in ("compare.md", "compare.csv", "compare.json"):
        assert (tmp_path / "out" / name).is_file()
    md = (tmp_path / "out/compare.md").read_text()
    assert "| mpp - scratch | +0.300 | +0.300 |" in md and "| mpp | 0.900 | 0.900 |" in md
    assert (tmp_path / "out/compare.csv").read_text().splitlines()[0] == "what,name,mean,std,seed_0"


def test_a_full_disk_as_the_report_is_written_is_one_line_and_the_old_report_is_kept_whole(tmp_path, monkeypatch,
                                                                                            shards, capsys):
    """A real full disk (a small tmpfs) under --out: compare.md and compare.json were plain writes, a traceback and
    a cut report once every run had finished; now each file is whole or as it was, and the same command, given room,
    writes them."""
    FakeStages(monkeypatch, top1=lambda stage: 0.9 if "mpp" in stage.name else 0.6)
    with small_disk(tmp_path / "disk", 2048) as disk:
        args = argv(shards, disk / "out", "--seeds", "0", "--arms", "scratch,mpp")
        compare.main(args)
        before = {name: (disk / "out" / name).read_bytes() for name in ("compare.md", "compare.csv", "compare.json")}
        (disk / "filler").write_bytes(b"x" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize))
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run_main(compare.main, args)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err and "cannot be written: no space left on device" in err, err
        assert "/out/compare." in err and {n: (disk / "out" / n).read_bytes() for n in before} == before, err
        assert not list((disk / "out").glob("*.tmp"))
        (disk / "filler").unlink()
        (disk / "out/compare.md").unlink()
        compare.main(args)
        assert {n: (disk / "out" / n).read_bytes() for n in before} == before


def test_a_torn_dry_run_cache_is_run_again_not_a_traceback(tmp_path, monkeypatch, shards):
    # what an older compare killed while it wrote its cache left: the lengths are dry-run again, the file rewritten
    fake = FakeStages(monkeypatch)
    args = argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp")
    first = compare.main(args)
    cache = tmp_path / "out" / run_scheduler.DRY_RUNS
    whole = cache.read_text()
    cache.write_text(whole[: len(whole) // 2])
    fake.dry_runs.clear()
    assert compare.main(args)["table"] == first["table"] and len(fake.dry_runs) == 3
    assert cache.read_text() == whole and not list(cache.parent.glob("*.tmp*"))


def test_report_only_reads_the_runs_and_runs_nothing(tmp_path, monkeypatch, shards):
    fake = FakeStages(monkeypatch)
    compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp"))
    fake.launched.clear()
    fake.dry_runs.clear()
    report = compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp", "--report-only"))
    assert not fake.launched and not fake.dry_runs and report["table"]["arms"]["mpp"]["mean"] == 0.5


def test_a_run_not_finished_is_no_result_though_it_logged_evaluations(tmp_path, monkeypatch, shards):
    # a sweep stopped, or looked at with --report-only while a run goes on: that run's evaluations so far are logged,
    # but its last one is not its result (it was reported as one)
    FakeStages(monkeypatch)
    args = argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp")
    compare.main(args)
    going = tmp_path / "out/seed0/scratch/finetune"
    (going / "summary.json").unlink()  # still running: no summary yet
    report = compare.main([*args, "--report-only"])
    assert report["table"]["arms"]["scratch"]["per_seed"] == {0: None}
    assert report["table"]["arms"]["mpp"]["per_seed"] == {0: 0.5}
    assert any(n.startswith("seed0/scratch/finetune: no test result") and "not finished" in n for n in report["notes"])
    # resumed to more steps than its summary covers: not finished either, until its new summary
    (going / "summary.json").write_text(json.dumps({"step": 1, "total_s": 6.0}))
    assert compare.main([*args, "--report-only"])["table"]["arms"]["scratch"]["per_seed"] == {0: None}


def test_an_arms_cost_is_that_of_its_seeds_with_a_result(tmp_path, monkeypatch, shards):
    # a seed whose fine-tuning is not there (not run yet) added its pretraining alone, or nothing, to the mean
    FakeStages(monkeypatch)
    args = argv(shards, tmp_path / "out", "--arms", "scratch,mpp")
    whole = compare.main([*args, "--seeds", "0"])["cost"]
    compare.main([*args, "--seeds", "0", "1"])
    shutil.rmtree(tmp_path / "out/seed1/mpp/finetune")
    shutil.rmtree(tmp_path / "out/seed1/scratch")
    report = compare.main([*args, "--seeds", "0", "1", "--report-only"])
    assert report["table"]["arms"]["mpp"]["per_seed"] == {0: 0.5, 1: None}
    assert report["cost"] == whole


def test_supervised_is_skipped_with_a_note_when_the_pool_has_no_labels(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    report = compare.main(argv(shards, tmp_path / "out", "--seeds", "0", pool="unlabelled_pool"))
    assert "supervised" not in report["table"]["arms"] and not any("supervised" in n for n in fake.launched)
    assert any(n.startswith("supervised arm skipped: the pool") for n in report["notes"])
    assert "note: supervised arm skipped" in capsys.readouterr().out
    assert "Note: supervised arm skipped" in (tmp_path / "out/compare.md").read_text()


def test_overrides_reach_their_stage_in_order(tmp_path, monkeypatch, shards):
    FakeStages(monkeypatch)
    compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp,mpp-l2,probe,probe-attentive",
                      "--set", "pretrain:train.steps=10", "mpp-l2.pretrain:mpp.target=l2", "finetune:optim.lr=0.1",
                      "probe.finetune:model.global_pool=avg", "probe-attentive.finetune:train.mode=attentive_probe"))

    def command(name: str) -> list[str]:
        return json.loads((tmp_path / "out/seed0" / name / run_scheduler.SIDECAR).read_text())["command"]

    assert "mpp.target=l2" in command("mpp-l2/pretrain") and "mpp.target=l2" not in command("mpp/pretrain")
    assert "train.steps=10" in command("mpp/pretrain") and "optim.lr=0.1" in command("scratch/finetune")
    probe = command("probe/finetune")
    assert probe.index("optim.lr=0.1") < probe.index("train.mode=linear_probe") < probe.index(
        "model.global_pool=avg")  # config-wide, the arm's own, then the arm's user overrides
    assert f"init.checkpoint={tmp_path / 'out/seed0/mpp/pretrain/export'}" in probe  # the first mpp arm's
    attentive = command("probe-attentive/finetune")  # the attentive probe: a probe arm whose mode is the user's
    assert attentive.index("train.mode=linear_probe") < attentive.index("train.mode=attentive_probe")
    assert "model.global_pool=avg" not in attentive


# ------------------------------------------------------------------------------------------ the label sweep


def test_a_label_sweep_shares_the_pretrainings_and_sizes_each_point(tmp_path, monkeypatch, shards, capsys):
    # 12 labelled images (4 of each of 3 classes); at 2 per class a subset of 6: 1 step an epoch at batch 4, all
    # of them 3. The fine-tunings make --finetune-steps 9 at both points; equal compute is sized per point.
    fake = FakeStages(monkeypatch, top1=lambda stage: {"mpp": 0.8, "scratch_equal": 0.6}.get(stage.arm, 0.7)
                      - (0.2 if stage.point == "k2" else 0.0))
    out = tmp_path / "out"
    args = argv(shards, out, "--seeds", "0", "1", "--arms", "mpp,scratch_equal,supervised,semi",
                "--labels-per-class", "2", "all", "--finetune-steps", "9", "--jobs", "2")
    report = compare.main(args)
    assert sorted(n for n in fake.launched if n.startswith("seed0/")) == sorted([
        "seed0/mpp/pretrain", "seed0/supervised/pretrain",  # once each, for both points
        *(f"seed0/{arm}/finetune_{p}" for arm in ("mpp", "scratch_equal", "supervised", "semi")
          for p in ("k2", "all"))])

    def command(name: str) -> list[str]:
        return json.loads((out / name / run_scheduler.SIDECAR).read_text())["command"]

    for seed in (0, 1):
        subset = out / "labelled" / f"k2_s{seed}"
        assert read_manifest(subset)["subset"]["per_class"] == 2 and read_manifest(subset)["splits"]["train"][
            "num_samples"] == 6
        assert f"data.shards={subset}" in command(f"seed{seed}/mpp/finetune_k2")
        assert f"init.checkpoint={out / f'seed{seed}/mpp/pretrain/export'}" in command(f"seed{seed}/semi/finetune_k2")
    assert f"data.shards={shards['labelled']}" in command("seed0/mpp/finetune_all")
    drawn = [(out / f"labelled/k2_s{seed}/train-000000.tar").read_bytes() for seed in (0, 1)]
    assert drawn[0] != drawn[1]  # a draw per seed
    assert command("seed0/mpp/finetune_k2")[-1] == "train.epochs=9"  # 9 steps at both points: the config's 3
    assert not any(c.startswith("train.epochs=") for c in command("seed0/mpp/finetune_all"))  # epochs make 9 at all
    # scratch_equal: the 20 x 8 MPP images and the 9 x 4 of the fine-tuning = 196, in 4 (k2) and 12 (all) an epoch
    assert command("seed0/scratch_equal/finetune_k2")[-1] == "train.epochs=49"
    assert command("seed0/scratch_equal/finetune_all")[-1] == "train.epochs=16"
    assert report["curve"]["points"] == [{"name": "k2", "per_class": 2.0}, {"name": "all", "per_class": 4.0}]
    assert report["curve"]["arms"]["mpp"] == {"k2": (pytest.approx(0.6), 0.0), "all": (pytest.approx(0.8), 0.0)}
    assert report["points"]["k2"]["table"]["differences"]["mpp - scratch_equal"]["mean"] == pytest.approx(0.2)
    md = (out / "compare.md").read_text()
    assert "| arm | k2 (2/class) | all (4/class) |" in md and "| mpp | 0.600 ± 0.000 | 0.800 ± 0.000 |" in md
    assert "## k2: 2 labelled images per class" in md and "## all: 4 labelled images per class" in md
    assert (out / "labels.png").stat().st_size > 10_000
    rows = (out / "compare.csv").read_text().splitlines()
    assert rows[0] == "point,what,name,mean,std,seed_0,seed_1" and any(r.startswith("all,arm,mpp,") for r in rows)

    fake.launched.clear()
    assert compare.main(args)["curve"] == report["curve"] and not fake.launched  # a rerun: every run reused
    assert compare.main([*args, "--report-only"])["curve"] == report["curve"]


def test_a_sweep_without_finetune_steps_keeps_the_first_points_steps(tmp_path, monkeypatch, shards):
    FakeStages(monkeypatch)
    out = tmp_path / "out"
    compare.main(argv(shards, out, "--seeds", "0", "--arms", "mpp", "--labels-per-class", "all", "1"))

    def command(name: str) -> list[str]:
        return json.loads((out / name / run_scheduler.SIDECAR).read_text())["command"]

    assert not command("seed0/mpp/finetune_all")[-1].startswith("train.epochs=")  # the config's 3 epochs, 9 steps
    assert command("seed0/mpp/finetune_k1")[-1] == "train.epochs=9"  # 3 images: 1 step an epoch


def test_semi2_goes_on_from_the_references_fine_tuning_with_its_head_and_the_pool(tmp_path, monkeypatch, shards):
    fake = FakeStages(monkeypatch)
    out = tmp_path / "out"
    report = compare.main(argv(shards, out, "--seeds", "0", "--arms", "mpp,semi2,semi_scratch", "--labels-per-class",
                               "2", "--finetune-steps", "9", "--set", "finetune:train.ema_decay=0.99"))
    assert sorted(fake.launched) == ["seed0/mpp/finetune_k2", "seed0/mpp/pretrain", "seed0/semi2/finetune_k2",
                                     "seed0/semi_scratch/finetune_k2"]
    assert fake.launched.index("seed0/mpp/finetune_k2") < fake.launched.index("seed0/semi2/finetune_k2")
    semi2 = json.loads((out / "seed0/semi2/finetune_k2" / run_scheduler.SIDECAR).read_text())["command"]
    assert f"init.checkpoint={out / 'seed0/mpp/finetune_k2/export'}" in semi2 and "init.keep_head=true" in semi2
    assert f"semi.pool={shards['pool']}" in semi2
    dry = next(cmd for cmd in fake.dry_runs if "semi.pool=" in " ".join(cmd) and "model.patch_size=4" in cmd)
    assert "init.checkpoint=" in dry and not any(c.startswith("init.keep_head") for c in dry)  # its export is to come
    # its cost: the pretraining, the reference's fine-tuning and its own; semi_scratch is given as many images
    assert report["points"]["k2"]["cost"]["semi2"]["images"] == PRE_STEPS * PRE_BATCH + 9 * 4 + 9 * 4
    assert report["points"]["k2"]["epochs"] == {"semi_scratch@k2": 58}  # 232 images in 4 an epoch
    assert "semi2 - mpp" in report["points"]["k2"]["table"]["differences"]
    # why a pool paid or did not: the share kept and the pseudo-labels right, at the last log
    # and, from the last evaluation, the teacher's pseudo-labels of the test images (no labels on the pool needed)
    ended = {"pseudo_kept": 0.5, "pseudo_acc": 0.75, "test_pseudo_kept": 0.6, "test_pseudo_acc": 0.7}
    assert report["points"]["k2"]["pool"]["semi2"] == {"per_seed": {0: ended}, **ended}
    assert "mpp" not in report["points"]["k2"]["pool"]
    assert "| semi2 | 0.50 / 0.75 (test 0.60 / 0.70) | 0.50 / 0.75 (test 0.60 / 0.70) |" in (out / "compare.md"
                                                                                           ).read_text()


def test_a_variant_may_have_a_suffix_of_several_words():
    assert compare_arms.parse_arms(["mpp,semi-strong-long,semi_scratch-strong-long"]) == [
        "mpp", "semi-strong-long", "semi_scratch-strong-long"]
    with pytest.raises(compare_arms.ConfigError, match="unknown arm 'semi--x'"):
        compare_arms.parse_arms(["mpp,semi--x"])


def test_a_variant_that_changes_only_fine_tuning_reads_the_references_pretraining(tmp_path, monkeypatch, shards):
    fake = FakeStages(monkeypatch)
    out = tmp_path / "out"
    report = compare.main(argv(shards, out, "--seeds", "0", "--arms", "mpp,mpp-long,mpp-l2", "--labels-per-class",
                               "2", "--finetune-steps", "6", "mpp-long=12", "--set",
                               "mpp-long.finetune:augment.color_jitter=0.4", "mpp-l2.pretrain:mpp.target=l2"))
    assert sorted(fake.launched) == ["seed0/mpp-l2/finetune_k2", "seed0/mpp-l2/pretrain", "seed0/mpp-long/finetune_k2",
                                     "seed0/mpp/finetune_k2", "seed0/mpp/pretrain"]  # no pretraining of its own

    def command(name: str) -> list[str]:
        return json.loads((out / name / run_scheduler.SIDECAR).read_text())["command"]

    assert f"init.checkpoint={out / 'seed0/mpp/pretrain/export'}" in command("seed0/mpp-long/finetune_k2")
    assert f"init.checkpoint={out / 'seed0/mpp-l2/pretrain/export'}" in command("seed0/mpp-l2/finetune_k2")
    assert command("seed0/mpp/finetune_k2")[-1] == "train.epochs=6" and command(
        "seed0/mpp-long/finetune_k2")[-1] == "train.epochs=12"  # its own steps (1 an epoch at 2 per class)
    cost = report["points"]["k2"]["cost"]
    assert cost["mpp-long"]["images"] == PRE_STEPS * PRE_BATCH + 12 * 4 and cost["mpp"]["images"] == (
        PRE_STEPS * PRE_BATCH + 6 * 4)


def test_a_supervised_variant_that_changes_only_fine_tuning_reads_the_supervised_pretraining(tmp_path, monkeypatch,
                                                                                          shards):
    # supervised-long once ran its own supervised pretraining, the very command of the supervised arm's
    fake = FakeStages(monkeypatch)
    out = tmp_path / "out"
    compare.main(argv(shards, out, "--seeds", "0", "--arms", "mpp,supervised,supervised-long,supervised-x",
                      "--labels-per-class", "2", "--finetune-steps", "6", "supervised-long=12", "--set",
                      "supervised-x.pretrain:optim.lr=0.01"))
    assert sorted(n for n in fake.launched if "supervised" in n) == [
        "seed0/supervised-long/finetune_k2", "seed0/supervised-x/finetune_k2", "seed0/supervised-x/pretrain",
        "seed0/supervised/finetune_k2", "seed0/supervised/pretrain"]  # supervised-x's pretraining is its own
    command = json.loads((out / "seed0/supervised-long/finetune_k2" / run_scheduler.SIDECAR).read_text())["command"]
    assert f"init.checkpoint={out / 'seed0/supervised/pretrain/export'}" in command and command[-1] == "train.epochs=12"


def test_semi_arms_skip_point_all_when_their_pool_is_the_labelled_set(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    args = argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "mpp,semi,semi_scratch", "--labels-per-class",
                "1", "all")
    args[args.index("--unlabelled") + 1] = str(shards["labelled"])
    report = compare.main(args)
    assert not any(n.endswith("finetune_all") and "semi" in n for n in fake.launched)
    assert "seed0/semi/finetune_k1" in fake.launched and "seed0/semi_scratch/finetune_k1" in fake.launched
    assert report["curve"]["arms"]["semi"]["all"] == (None, None)
    assert any("not run at point all" in n for n in report["points"]["k1"]["notes"])


def test_a_sweeps_dry_run_writes_nothing(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    out = tmp_path / "out"
    assert compare.main(argv(shards, out, "--seeds", "0", "--arms", "mpp", "--labels-per-class", "2", "all",
                             "--dry-run")) == {}
    printed = capsys.readouterr().out
    assert f"data.shards={out / 'labelled/k2_s0'}" in printed and "seed0/mpp/finetune_k2: 3 steps x 4" in printed
    assert not out.exists() and not fake.launched
    assert any(str(out / "labelled") not in " ".join(cmd) and "compare-dry-run-" in " ".join(cmd)
               for cmd in fake.dry_runs)  # the subset the stage's dry run read, drawn in a temporary folder


@pytest.mark.parametrize("more, says", [
    (["--labels-per-class", "two"], "--labels-per-class 'two': give counts"),
    (["--labels-per-class", "2", "2"], "names a point twice"),
    (["--labels-per-class", "0"], "--labels-per-class '0'"),
    (["--finetune-steps", "100"], "--finetune-steps 100: it sets the fine-tuning length of a label sweep "
                                  "(--labels-per-class); a single comparison's is its config's train.epochs"),
    (["--labels-per-class", "2", "--finetune-steps", "0"], "--finetune-steps 0: give a number of optimizer steps >= 1"),
    (["--labels-per-class", "2", "--finetune-steps", "10", "nope=20"], "nope is not an arm of --arms"),
    (["--labels-per-class", "2", "--finetune-steps", "scratch_equal=20"], "gives scratch_equal its length itself"),
    (["--labels-per-class", "5"], "--labels-per-class 5: "),  # 4 of each class in the labelled set
    (["--labels-per-class", "2", "5"], "--labels-per-class 5: "),  # the subsets of point 2 are not drawn either
])
def test_a_bad_sweep_is_one_line_before_anything_runs(tmp_path, monkeypatch, shards, capsys, more, says):
    fake = FakeStages(monkeypatch)
    code, _, err = in_process(compare.main, argv(shards, tmp_path / "out", *more), capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert " --per-class" not in err  # compare's flag, not the subset command's
    assert not fake.launched and not (tmp_path / "out").exists()  # nothing under --out: no lock, no subset


def test_a_subset_drawn_from_another_set_is_not_reused(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "mpp", "--labels-per-class", "2"))
    fake.launched.clear()
    args = argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "mpp", "--labels-per-class", "2")
    args[args.index("--labelled") + 1] = str(shards["pool"])
    code, _, err = in_process(compare.main, args, capsys)
    assert code == 2 and err.count("\n") == 1 and "holds another subset (2 per class of " in err, err
    assert not fake.launched


def test_a_sweep_needs_one_labelled_set(tmp_path, monkeypatch, shards, capsys):
    FakeStages(monkeypatch)
    args = argv(shards, tmp_path / "out", "--labels-per-class", "2")
    args[args.index("--labelled") + 1] = str(shards["labelled"]).replace("labelled", "{seed}_labelled")
    code, _, err = in_process(compare.main, args, capsys)
    assert code == 2 and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------- one-line mistakes


@pytest.mark.parametrize("more, says", [
    (["--arms", "scratch,mpp,magic"], "--arms: unknown arm 'magic'"),
    (["--arms", "scratch,probe"], "--arms has no mpp arm"),
    (["--set", "mpp.mask_ratio=0.4"], "give TARGET:KEY=VALUE"),
    (["--set", "nope.pretrain:mpp.mask_ratio=0.4"], "unknown target 'nope.pretrain'"),
    (["--set", "scratch.pretrain:train.steps=3"], "arm scratch has no pretrain stage"),
    (["--set", "finetune:train.seed=3"], "compare sets train.seed itself"),
    (["--set", "scratch_equal.finetune:train.epochs=3"], "compare sets train.epochs itself"),
    (["--set", "finetune:semi.gate=0.5"], "validates every fine-tuning on --test unless --val names a validation "
                                          "set of its own, so a gate there would open the pool with the test split's "
                                          "labels"),
    (["--seeds", "0", "0"], "--seeds must be distinct"),
    (["--jobs", "0"], "--jobs 0: give at least 1 (runs at a time)"),
    (["--threads", "-1"], "--threads -1: give at least 1 (threads per run)"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_bad_flag_is_one_line_before_anything_runs(tmp_path, monkeypatch, shards, capsys, more, says):
    fake = FakeStages(monkeypatch)
    code, _, err = in_process(compare.main, argv(shards, tmp_path / "out", *more), capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not fake.dry_runs and not fake.launched and not (tmp_path / "out").exists()


def test_bad_shards_are_one_line(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    cases = [(["--unlabelled", str(tmp_path / "nowhere")], "--unlabelled: shard directory not found"),
             (["--labelled", str(shards["unlabelled_pool"])], "carries no labels"),
             (["--labelled", str(shards["pool"]).replace("pool", "labelled_{seed}")], "--labelled: shard directory"),
             (["--test", f"{shards['test']}:val"], "has no split 'val' (it has: test)"),
             (["--pretrain-config", "configs/pretrain/none.yaml"], "--pretrain-config configs/pretrain/none.yaml")]
    for more, says in cases:
        code, _, err = in_process(compare.main, [*argv(shards, tmp_path / "out"), *more], capsys)
        assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not fake.dry_runs and not fake.launched


def test_a_stage_that_refuses_its_config_is_one_line_naming_the_arm(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)

    def refuse(cmd):
        fake.dry_runs.append(cmd)
        if "mpp.mask_ratio=7" in cmd:
            return subprocess.CompletedProcess(cmd, 2, "", "error: mpp.mask_ratio=7: must be in (0, 1)\n")
        return subprocess.CompletedProcess(cmd, 0, dry_run_text(cmd), "")

    monkeypatch.setattr(run_scheduler, "dry_run", refuse)
    code, _, err = in_process(compare.main, argv(shards, tmp_path / "out", "--set", "pretrain:mpp.mask_ratio=7"),
                              capsys)
    assert code == 2 and err == "error: mpp/pretrain: mpp.mask_ratio=7: must be in (0, 1)\n"
    assert not fake.launched and not (tmp_path / "out").exists()  # found before anything is written under --out
    code, _, err = in_process(compare.main, argv(shards, tmp_path / "out", "--labels-per-class", "2", "--set",
                                                 "pretrain:mpp.mask_ratio=7"), capsys)
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "out").exists()  # no subset drawn there either


def test_changed_settings_under_a_run_are_refused(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp"))
    fake.launched.clear()
    code, _, err = in_process(compare.main, argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp",
                                                 "--set", "finetune:optim.lr=0.5"), capsys)
    assert code == 2 and err.count("\n") == 1 and "holds a run of other settings (now optim.lr=0.5)" in err
    assert not fake.launched


def test_a_failed_run_is_one_line_after_the_others_end(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    ok = fake.launch

    def launch(stage, log, threads):
        if stage.name.endswith("scratch/finetune"):
            log.write_text("step 1\nerror: something broke\n")
            fake.launched.append(stage.name)
            return 2
        return ok(stage, log, threads)

    monkeypatch.setattr(run_scheduler, "launch", launch)
    code, out, err = in_process(compare.main, argv(shards, tmp_path / "out", "--seeds", "0", "--arms",
                                                   "scratch,mpp"), capsys)
    assert code == 2 and err.count("\n") == 1
    assert "seed0/scratch/finetune failed with exit status 2: something broke" in err and "to resume" in err


def test_dry_run_prints_every_run_and_writes_nothing(tmp_path, monkeypatch, shards, capsys):
    fake = FakeStages(monkeypatch)
    assert compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "1", "--dry-run")) == {}
    out = capsys.readouterr().out
    assert "seed1/scratch_equal/finetune: 48 steps x 4" in out and "seed0/mpp/pretrain: 20 steps x 8" in out
    assert out.count(f"{sys.executable} -m") >= 14 and not fake.launched and not (tmp_path / "out").exists()


def test_the_command_is_wired_and_a_mistake_is_one_line(tmp_path):
    result = run_module("experiments.compare", "--unlabelled", "x", "--labelled", "y", "--test", "z",
                        "--pretrain-config", "a", "--finetune-config", "b", "--out", str(tmp_path), "--arms", "foo")
    assert result.returncode == 2 and result.stderr.startswith("error: --arms: unknown arm 'foo'")
    assert result.stderr.count("\n") == 1 and not result.stdout
    moved = run_module("analysis", "compare", "--out", str(tmp_path))  # where it was: a pointer, one line
    assert moved.returncode == 2 and moved.stderr.startswith("error: compare trains runs, so it is an experiment now")
    assert moved.stderr.count("\n") == 1


def test_a_stop_signal_reaches_the_stages_under_way_and_none_starts_after_it():
    # compare's own handler, in this process: the child gets SIGTERM (its preemption signal), exits 75 as a stage
    # does once it saved, and a stage about to start does not
    stage = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75));"
             " print('up', flush=True); time.sleep(120)"]
    children, result = run_scheduler.Children(), {}
    with children.stop_signals():
        reader, writer = os.pipe()
        runner = threading.Thread(target=lambda: result.update(status=children.run(stage, stdout=writer)))
        runner.start()
        with os.fdopen(reader) as said:
            assert said.readline() == "up\n"  # its handler is set
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler or `kill` does: compare's process alone
            runner.join(30)
        os.close(writer)
    assert result == {"status": 75} and children.stopped_by == signal.SIGTERM
    assert children.run([sys.executable, "-c", "raise SystemExit(0)"]) == 128 + signal.SIGTERM  # not started
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the previous handler is back


def test_a_second_compare_on_a_busy_out_is_one_line(tmp_path, shards):
    # The kernel's lock on DIR, held by another live process: the real command refuses it before it writes anything
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from vit_mpp.processes.run_dir_lock import lock_run_dir; "
                               f"lock_run_dir(Path({str(out)!r})); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO)
    try:
        assert holder.stdout.readline() == "held\n"
        result = run_module("experiments.compare", *argv(shards, out, "--seeds", "0", "--arms", "scratch,mpp"))
        table = run_module("experiments.compare", *argv(shards, out, "--seeds", "0", "--arms", "scratch,mpp",
                                                          "--report-only"))
    finally:
        holder.kill()
        holder.wait()
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {out} is in use by another "
                                                                             f"run (pid {holder.pid}"), result.stderr
    assert lines[0].endswith("or use another --out") and sorted(p.name for p in out.iterdir()) == [".lock"]
    assert table.returncode == 2 and "has a test result yet" in table.stderr  # a table of what is there: not refused


@pytest.mark.parametrize("how", ["ctrl-c", "scheduler", "scheduler under nohup"])
def test_a_stop_while_compare_checks_its_runs_is_one_line_and_stops_its_dry_runs(tmp_path, shards, how):
    # While the real command dry-runs its stages, nothing has started, so nothing to resume: status 128 + the signal
    # and one line. A terminal's Ctrl-C is SIGINT to the whole foreground group (compare and the dry run under way);
    # a scheduler's SIGTERM reaches compare alone, which stops its dry run itself; under nohup a hang-up changes
    # nothing (SIGHUP stays ignored) and the scheduler's SIGTERM still stops it
    command = [sys.executable, "-m", "experiments.compare", *argv(
        shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp,scratch_equal,supervised", "--jobs", "1",
        "--set", "finetune:model.patch_size=4", "finetune:model.embed_dim=32", "finetune:model.depth=2",
        "finetune:model.num_heads=2", "finetune:model.img_size=16")]

    def as_launched() -> None:  # SIGINT not ignored, as from a terminal: pytest-xdist's workers ignore it, and an
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # ignored signal stays ignored across exec
        if how.endswith("nohup"):
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            cwd=REPO, start_new_session=True, preexec_fn=as_launched)
    try:
        assert proc.stdout.readline().startswith("checking ")  # the first of 5 dry runs (seconds each) starts now
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            if how.endswith("nohup"):
                proc.send_signal(signal.SIGHUP)
                time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 30:  # its dry run is stopped, not left running in the group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("a dry run outlived the compare that started it")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    assert proc.returncode == 128 + sig and "Traceback" not in err, err[-3000:]
    assert out.strip().splitlines()[-1] == (f"compare stopped by {sig.name} while checking its runs: no run was "
                                            "started; run the same command to start")
    assert not (tmp_path / "out" / "seed0").exists()


def test_a_signal_its_parent_ignores_stays_ignored():
    # `nohup compare ...`: the hang-up of the terminal must not stop a sweep of hours
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with run_scheduler.Children().stop_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
    finally:
        signal.signal(signal.SIGHUP, previous)


# ------------------------------------------------------------------------------------------------ for real


@pytest.mark.slow
def test_a_tiny_real_comparison_runs_and_resumes(tmp_path, monkeypatch, shards):
    """The real stages (configs/*/tiny.yaml, a few steps): runs, the table, and a rerun that launches nothing."""
    tiny = ["--set", "finetune:model.patch_size=4", "finetune:model.embed_dim=32", "finetune:model.depth=2",
            "finetune:model.num_heads=2", "finetune:model.img_size=16", "pretrain:train.steps=4",
            "finetune:train.epochs=1", "finetune:data.num_workers=0", "pretrain:data.num_workers=0"]
    args = argv(shards, tmp_path / "out", "--seeds", "0", "--arms", "scratch,mpp", "--jobs", "2", "--threads", "1",
                *tiny)
    report = compare.main(args)
    assert all(report["table"]["arms"][a]["per_seed"][0] is not None for a in ("scratch", "mpp"))
    for run in ("seed0/mpp/pretrain", "seed0/mpp/finetune", "seed0/scratch/finetune"):  # what a rerun must match
        assert json.loads((tmp_path / "out" / run / run_scheduler.SIDECAR).read_text())["threads"] == 1
        assert json.loads((tmp_path / "out" / run / "summary.json").read_text())["threads"] == 1
    assert report["test_samples"] == 9
    launched = []
    monkeypatch.setattr(run_scheduler, "launch", lambda *a: launched.append(a) or 0)
    assert compare.main(args)["table"] == report["table"] and not launched


@pytest.mark.slow
def test_a_tiny_real_comparison_with_val_scores_each_export_on_test_and_a_lost_score_is_made_again(tmp_path,
                                                                                                   shards):
    """The real stages and the real finetune.evaluate: each fine-tuning validates on --val (the gate with it), its
    export is scored on --test, the table is those scores; a score lost is made again by the same command, which
    trains nothing."""
    tiny = ["--set", "finetune:model.patch_size=4", "finetune:model.embed_dim=32", "finetune:model.depth=2",
            "finetune:model.num_heads=2", "finetune:model.img_size=16", "pretrain:train.steps=4",
            "finetune:train.epochs=1", "finetune:data.num_workers=0", "pretrain:data.num_workers=0",
            "semi.finetune:train.ema_decay=0.9", "semi.finetune:semi.gate=0.5"]
    out = tmp_path / "out"
    args = argv(shards, out, "--seeds", "0", "--arms", "mpp,semi", "--val", f"{shards['pool']}:val", "--threads", "1",
                *tiny)
    report = compare.main(args)
    for arm in ("mpp", "semi"):
        scored = json.loads((out / f"seed0/{arm}/finetune/test/evaluation.json").read_text())
        assert report["table"]["arms"][arm]["per_seed"][0] == scored["metrics"]["val_top1"]
        assert scored["metrics"]["val_samples"] == 9  # --test's 9 images; the runs validated on --val's 6
        assert {r["val_samples"] for r in read_metrics(out / f"seed0/{arm}/finetune") if "val_samples" in r} == {6}
    trained = (out / "seed0/mpp/finetune/metrics.jsonl").read_text()
    shutil.rmtree(out / "seed0/mpp/finetune/test")
    again = compare.main(args)
    assert again["table"] == report["table"]
    assert (out / "seed0/mpp/finetune/metrics.jsonl").read_text() == trained  # scored again, not trained again
    log = (out / "logs/seed0_mpp_finetune.log").read_text()
    assert log.count("-m finetune.evaluate") == 2 and log.count("-m finetune --config") == 1


@pytest.mark.slow
def test_a_tiny_real_label_sweep(tmp_path, shards):
    """The real subsets and stages: one MPP pretraining, fine-tunings at 1 label per class and at all of them, each
    scored on the test set, the curve and its plot."""
    tiny = ["--set", "finetune:model.patch_size=4", "finetune:model.embed_dim=32", "finetune:model.depth=2",
            "finetune:model.num_heads=2", "finetune:model.img_size=16", "pretrain:train.steps=4",
            "finetune:data.num_workers=0", "pretrain:data.num_workers=0"]
    out = tmp_path / "out"
    report = compare.main(argv(shards, out, "--seeds", "0", "--arms", "mpp,scratch_equal", "--labels-per-class",
                               "1", "all", "--finetune-steps", "3", "--jobs", "2", *tiny))
    assert all(report["curve"]["arms"][a][p][0] is not None for a in ("mpp", "scratch_equal") for p in ("k1", "all"))
    assert [r["step"] for r in read_metrics(out / "seed0/mpp/finetune_k1") if "loss" in r][-1] == 3
    assert [r["step"] for r in read_metrics(out / "seed0/mpp/finetune_all") if "loss" in r][-1] == 3
    assert read_manifest(out / "labelled/k1_s0")["splits"]["train"]["num_samples"] == 3
    assert (out / "labels.png").is_file() and len(list((out / "seed0/mpp").iterdir())) == 3  # 1 pretraining


@pytest.mark.slow
def test_a_stop_signal_to_the_real_compare_stops_its_runs_which_save_and_the_same_command_resumes(tmp_path, shards):
    """`kill PID` of compare alone (not its group): its running pretraining saves and exits 75, compare exits 75
    with one line, nothing of it is left running, and the same command resumes the pretraining where it stopped."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "experiments.compare", *argv(
        shards, out, "--seeds", "0", "--arms", "mpp", "--jobs", "1", "--set", "pretrain:train.steps=300",
        "pretrain:train.ckpt_every=100000", "pretrain:train.eval_every=0", "pretrain:train.log_every=10",
        "pretrain:data.num_workers=0", "finetune:model.patch_size=4", "finetune:model.embed_dim=32",
        "finetune:model.depth=2", "finetune:model.num_heads=2", "finetune:model.img_size=16",
        "finetune:train.epochs=1", "finetune:data.num_workers=0")]
    first = Background(command, tmp_path / "first.log", "compare-stop")
    try:
        first.wait_for("seed0/mpp/pretrain started")
        metrics = out / "seed0/mpp/pretrain/metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):  # in its loop, past step 10
            assert first.proc.poll() is None, first.output()[-3000:]
            time.sleep(0.05)
        os.kill(first.proc.pid, signal.SIGTERM)
        first.wait_gone(120)  # the stage too: nothing of compare is left running
    finally:
        first.kill()
    said = first.output().strip().splitlines()
    assert first.proc.returncode == 75, first.output()[-3000:]
    assert said[-1].startswith("compare stopped by SIGTERM: 1 run(s) under way stopped, 1 of them with a checkpoint "
                               "saved (seed0/mpp/pretrain); 2 of 2 not finished; run the same command"), said[-3:]
    log = (out / "logs/seed0_mpp_pretrain.log").read_text()
    stopped_at = int(log.split("preempted at step ")[1].split(":")[0])
    assert 10 <= stopped_at < 300 and not (out / "seed0/mpp/finetune/metrics.jsonl").exists()

    again = subprocess.run(command, capture_output=True, text=True, timeout=900, env=subprocess_env(), cwd=REPO)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    log = (out / "logs/seed0_mpp_pretrain.log").read_text()
    assert f"(step {stopped_at})" in log.split("preempted at step")[1]  # resumed there, not started again
    assert [r["step"] for r in read_metrics(out / "seed0/mpp/pretrain") if "loss" in r][-1] == 300
    assert "wrote" in again.stdout and (out / "compare.md").is_file()
