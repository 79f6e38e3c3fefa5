"""`build-shards subset SOURCE OUT --per-class K --seed S`: K samples of each class, the same ones for the same seed,
copied byte for byte into shards of their own whose manifest names the source's other splits where they are (a
fine-tuning reads the subset and the source's val split); `inspect` passes on it; every mistake is one line with
nothing written (a negative --seed too), a draw that was interrupted is drawn again whole, an identical rerun of a
finished one is "already complete" (status 0, nothing written) and one drawn otherwise names what differs."""

from __future__ import annotations

import io
import json
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest

from data_tools.cli import main as build_main
from data_tools.subset import SubsetError
from data_tools.subset import subset as draw_subset
from finetune.__main__ import main as finetune_main
from tests.helpers.disks import resize, small_disk
from tests.helpers.processes import REPO, in_process, subprocess_env
from tests.helpers.runs import audit, read_metrics
from tests.helpers.shards import write_shard_set
from vit_mpp.data.manifest import MANIFEST_NAME, load_split


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # 3 classes (sample i is labelled i % 3), uneven shards: 14, 10 and 9 of each class in train
    return write_shard_set(tmp_path_factory.mktemp("src") / "set", {"train": [13, 11, 9], "val": [6]})


def members(folder: Path, split: str = "train") -> dict[str, bytes]:
    """Every member of a split's shards, name -> bytes, in order."""
    shards, _ = load_split(folder, split)
    found = {}
    for url in shards.urls:
        with tarfile.open(url) as tar:
            for m in tar.getmembers():
                found[m.name] = tar.extractfile(m).read()
    return found


def labels(folder: Path) -> Counter:
    return Counter(int(v) for k, v in members(folder).items() if k.endswith(".cls"))


def subset(capsys, source: Path, out: Path, *more: str) -> tuple[int, str, str]:
    return in_process(build_main, ["subset", str(source), str(out), *more], capsys)


def test_k_of_each_class_the_same_for_the_same_seed_copied_byte_for_byte(source, tmp_path, capsys):
    code, out, _ = subset(capsys, source, tmp_path / "a", "--per-class", "4", "--seed", "1", "--shard-size", "5")
    assert code == 0 and "12 of the 33 labelled samples" in out, out
    assert labels(tmp_path / "a") == {0: 4, 1: 4, 2: 4}
    assert sorted(p.name for p in (tmp_path / "a").glob("*.tar")) == ["train-000000.tar", "train-000001.tar",
                                                                     "train-000002.tar"]  # 5 + 5 + 2 samples
    original = members(source)
    copied = members(tmp_path / "a")
    assert all(original[name] == data for name, data in copied.items())  # the bytes as they were
    assert list(copied) == [n for n in original if n in copied]  # in the source's order, each sample whole
    assert len(copied) == 12 * 3  # png, cls, json of each

    assert subset(capsys, source, tmp_path / "b", "--per-class", "4", "--seed", "1")[0] == 0
    assert subset(capsys, source, tmp_path / "c", "--per-class", "4", "--seed", "2")[0] == 0
    assert members(tmp_path / "b") == copied  # the same seed: the same samples (in one shard this time)
    assert members(tmp_path / "c").keys() != copied.keys()

    info = json.loads((tmp_path / "a" / "_info.json").read_text())
    assert info["subset"] == {"of": str(source), "split": "train", "per_class": 4, "seed": 1, "shard_size": 5,
                              "samples": 12, "of_samples": 33, "unlabelled_left_out": 0}
    assert len(info["fingerprint"]) == 64  # what a rerun compares (as a build's)
    assert info["class_names"] == ["a", "b", "c"] and info["num_classes"] == 3
    assert info["splits"]["val"]["filenames"] == [str(source / "val-000000.tar")]  # where it is, not copied
    assert members(tmp_path / "a", "val") == members(source, "val")
    code, out, _ = in_process(build_main, ["inspect", str(tmp_path / "a"), "--samples", "0"], capsys)
    assert code == 0 and "verified: every shard matches the manifest" in out, out


def test_a_fine_tuning_reads_the_subset_and_the_sources_val_split(source, tmp_path, capsys):
    assert subset(capsys, source, tmp_path / "few", "--per-class", "2")[0] == 0
    run_dir = tmp_path / "run"
    code, out, err = in_process(finetune_main, [
        "--config", "configs/finetune/tiny.yaml", f"data.shards={tmp_path / 'few'}", "init.checkpoint=",
        "model.img_size=16", "model.patch_size=4", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "data.num_workers=0", "train.epochs=2", "train.record_samples=true", f"train.run_dir={run_dir}"], capsys)
    assert code == 0, err[-2000:]
    evals = [r for r in read_metrics(run_dir) if "val_top1" in r]
    assert evals and all(r["val_samples"] == 6 for r in evals)  # the source's val split, read where it is
    drawn = {name.split(".")[0] for name in members(tmp_path / "few")}
    assert {k for r in audit(run_dir) for k in r["keys"]} == drawn  # trained on the subset, all of it


@pytest.mark.parametrize("more, says", [
    (["--per-class", "12"], "fewer samples of 3 class(es) (class 0 has 11, class 1 has 11, class 2 has 11)"),
    (["--per-class", "3", "--split", "test"], "has no split 'test'"),
])
def test_what_cannot_be_drawn_is_one_line_and_nothing_is_written(source, tmp_path, capsys, more, says):
    code, _, err = subset(capsys, source, tmp_path / "out", *more)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert not (tmp_path / "out").exists()


def test_outputs_that_are_refused(source, tmp_path, capsys):
    unlabelled = write_shard_set(tmp_path / "unlabelled", {"train": [6]}, labels={"train": [None] * 6})
    info = json.loads((unlabelled / "_info.json").read_text())
    del info["num_classes"], info["class_names"]
    (unlabelled / "_info.json").write_text(json.dumps(info))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    done = tmp_path / "done"
    assert subset(capsys, source, done, "--per-class", "2")[0] == 0
    before = {p.name: p.read_bytes() for p in done.iterdir()}
    for src, out, says in ((unlabelled, tmp_path / "x", "carries no labels"),
                           (source, source, "is the source set"),
                           (source, foreign, "holds files that are not a subset's"),
                           (source, done, "already holds a subset")):
        code, _, err = subset(capsys, src, out, "--per-class", "2", "--seed", "5")
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert {p.name: p.read_bytes() for p in done.iterdir()} == before
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1
    code, _, err = subset(capsys, source, done, "--per-class", "2", "--seed", "5", "--overwrite")
    assert code == 0, err
    assert json.loads((done / "_info.json").read_text())["subset"]["seed"] == 5


def test_an_interrupted_draw_is_drawn_again_whole(source, tmp_path, capsys):
    out = tmp_path / "out"
    assert subset(capsys, source, out, "--per-class", "3", "--shard-size", "2")[0] == 0
    expected = members(out)
    (out / "_info.json").unlink()  # killed before its manifest, the commit point: a stale tar and a .tmp left
    (out / "train-000004.tar").unlink()
    (out / "train-000009.tar.tmp").write_bytes(b"half")
    assert subset(capsys, source, out, "--per-class", "3", "--shard-size", "2")[0] == 0
    assert members(out) == expected and not list(out.glob("*.tmp"))


def test_a_damaged_source_shard_is_one_line(source, tmp_path, capsys):
    damaged = shutil.copytree(source, tmp_path / "damaged")
    shard = damaged / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    code, _, err = subset(capsys, damaged, tmp_path / "out", "--per-class", "2")
    assert code == 2 and "train-000001.tar" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_the_command_line(source, tmp_path):
    # the installed command, as a user types it, and its help
    result = subprocess.run([sys.executable, "-m", "data_tools.cli", "subset", str(source), str(tmp_path / "s"),
                             "--per-class", "1"], capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert result.returncode == 0 and "3 of the 33 labelled samples" in result.stdout, result.stderr
    helped = subprocess.run([sys.executable, "-m", "data_tools.cli", "subset", "--help"], capture_output=True,
                            text=True, env=subprocess_env(), cwd=REPO)
    assert helped.returncode == 0 and "--per-class K" in helped.stdout and "--seed" in helped.stdout
    bad = subprocess.run([sys.executable, "-m", "data_tools.cli", "subset", str(source), str(tmp_path / "t"),
                          "--per-class", "0"], capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ")


def test_a_full_disk_is_one_line_and_the_same_command_goes_on_once_space_is_freed(tmp_path, capsys):
    # The real writer meets the kernel's ENOSPC: a tmpfs too small for the drawn samples' bytes (no injected error)
    big = write_shard_set(tmp_path / "big", {"train": [30, 30], "val": [3]}, size=64)
    with small_disk(tmp_path / "disk", 64) as disk:
        out = disk / "few"
        code, _, err = subset(capsys, big, out, "--per-class", "20")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "space" in lines[0], err
        assert not (out / "_info.json").exists()  # nothing that looks finished
        resize(disk, 4096)
        code, _, err = subset(capsys, big, out, "--per-class", "20")
        assert code == 0, err
        assert labels(out) == {0: 20, 1: 20, 2: 20}


def test_killed_mid_copy_by_sigkill_the_same_command_draws_it_whole(tmp_path):
    # The real command, killed -9 while it copies (some shards of OUT written, its manifest not yet): nothing looks
    # finished, and running it again gives what an uninterrupted draw gives
    big = write_shard_set(tmp_path / "big", {"train": [150] * 8, "val": [3]}, size=8, meta=False)
    command = [sys.executable, "-m", "data_tools.cli", "subset", str(big), "OUT", "--per-class", "300",
               "--shard-size", "3", "--seed", "4"]
    out = tmp_path / "out"
    proc = subprocess.Popen([str(out) if a == "OUT" else a for a in command], env=subprocess_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (out.is_dir() and len(list(out.glob("*.tar"))) >= 5):
            assert proc.poll() is None, "the draw ended before it could be killed mid-copy"
            time.sleep(0.002)
    finally:  # killed there, mid-copy (or on a failed assertion)
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "_info.json").exists() and len(list(out.glob("*.tar"))) < 300  # mid-copy, unfinished
    inspected = subprocess.run([sys.executable, "-m", "data_tools.cli", "inspect", str(out)], capture_output=True,
                               text=True, env=subprocess_env(), cwd=REPO)
    assert inspected.returncode == 2 and inspected.stderr.strip().splitlines()[-1].startswith("error: ")

    for folder in (out, tmp_path / "clean"):
        again = subprocess.run([str(folder) if a == "OUT" else a for a in command], capture_output=True, text=True,
                               env=subprocess_env(), cwd=REPO)
        assert again.returncode == 0, again.stderr
    assert members(out) == members(tmp_path / "clean") and labels(out) == {0: 300, 1: 300, 2: 300}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "clean").iterdir())


@pytest.mark.parametrize("more, says", [
    (["--per-class", "2", "--seed", "-1"], "--seed must be >= 0 (numpy's generator takes no negative seed), got -1"),
    (["--per-class", "0"], "--per-class must be >= 1, got 0"),
    (["--per-class", "2", "--shard-size", "-3"], "--shard-size must be >= 1, got -3"),
    (["--per-class", "2", "--read-timeout", "nan"], "--read-timeout must be > 0 and finite, got nan"),
    (["--per-class", "2", "--read-retries", "-1"], "--read-retries must be >= 0, got -1"),
])
def test_a_numeric_flag_out_of_range_is_one_line_naming_it_and_nothing_is_written(source, tmp_path, capsys, more,
                                                                                    says):
    code, out, err = subset(capsys, source, tmp_path / "out", *more)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {says}"), err
    assert not (tmp_path / "out").exists() and not out


def test_a_negative_seed_through_the_command_is_one_line(source, tmp_path):
    # numpy's generator raised its ValueError: a 27-line traceback and exit status 1
    bad = subprocess.run([sys.executable, "-m", "data_tools.cli", "subset", str(source), str(tmp_path / "out"),
                          "--per-class", "2", "--seed", "-1"], capture_output=True, text=True, env=subprocess_env(),
                         cwd=REPO)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --seed must be >= 0"), bad.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(SubsetError, match="--seed must be >= 0"):  # the function itself, for a caller in Python
        draw_subset(str(source), tmp_path / "out", 2, -1)
    assert not (tmp_path / "out").exists()


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_an_identical_rerun_is_already_complete_and_writes_nothing(source, tmp_path, capsys):
    out = tmp_path / "few"
    drawn = ["--per-class", "3", "--seed", "7", "--shard-size", "4"]
    assert subset(capsys, source, out, *drawn)[0] == 0
    before = snapshot(out)
    code, said, err = subset(capsys, source, out, *drawn, "--read-retries", "1")  # how it reads: not the subset
    assert code == 0 and not err, err
    assert said.strip().splitlines() == [f"{out} is already complete ({MANIFEST_NAME}: 3 of each class of "
                                         f"{source}:train, seed 7); pass --overwrite to draw it again"], said
    assert snapshot(out) == before  # not a byte, not a time stamp


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_a_rerun_over_a_damaged_subset_draws_it_again(source, tmp_path, capsys, damage):
    # "already complete" once read the manifest alone: a shard deleted or cut short since was handed on as it was
    out = tmp_path / "few"
    drawn = ["--per-class", "3", "--seed", "7", "--shard-size", "4"]
    assert subset(capsys, source, out, *drawn)[0] == 0
    before = {name: data for name, (data, _) in snapshot(out).items()}
    shard = sorted(out.glob("*.tar"))[0]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:512])
    code, said, err = subset(capsys, source, out, *drawn)
    assert code == 0 and err.startswith(f"warning: {out} is this draw, but its shard {shard.name} is "), err
    assert "already complete" not in said
    assert {name: data for name, (data, _) in snapshot(out).items()} == before  # the same draw, byte for byte


@pytest.mark.parametrize("other, differs", [
    (["--seed", "8"], "--seed 7 there, 8 now"),
    (["--per-class", "2"], "--per-class 3 there, 2 now"),
    (["--shard-size", "5"], "--shard-size 4 there, 5 now"),
    (["--split", "val", "--per-class", "2"], "--split train there, val now; --per-class 3 there, 2 now"),
])
def test_a_rerun_with_other_settings_is_one_line_naming_what_differs(source, tmp_path, capsys, other, differs):
    out = tmp_path / "few"
    drawn = {"--per-class": "3", "--seed": "7", "--shard-size": "4"}
    assert subset(capsys, source, out, *[x for kv in drawn.items() for x in kv])[0] == 0
    before = snapshot(out)
    now = {**drawn, **dict(zip(other[::2], other[1::2]))}
    code, said, err = subset(capsys, source, out, *[x for kv in now.items() for x in kv])
    assert code == 2 and err.strip().splitlines() == [
        f"error: OUT {out} already holds a subset drawn otherwise ({differs}): give --overwrite to draw it again"], err
    assert snapshot(out) == before
    assert subset(capsys, source, out, *[x for kv in now.items() for x in kv], "--overwrite")[0] == 0


def test_a_rerun_from_another_source_or_a_changed_one_is_refused(source, tmp_path, capsys):
    copy = shutil.copytree(source, tmp_path / "copy")
    out = tmp_path / "few"
    assert subset(capsys, copy, out, "--per-class", "2")[0] == 0
    before = snapshot(out)
    code, _, err = subset(capsys, source, out, "--per-class", "2")
    assert code == 2 and err.strip().splitlines() == [
        f"error: OUT {out} already holds a subset drawn otherwise (SOURCE {copy} there, {source} now): give "
        "--overwrite to draw it again"], err
    info = json.loads((copy / MANIFEST_NAME).read_text())
    info["splits"]["val"]["filenames"] = [str(copy / "val-000000.tar")]  # the same shards, named otherwise
    (copy / MANIFEST_NAME).write_text(json.dumps(info))
    code, _, err = subset(capsys, copy, out, "--per-class", "2")
    assert code == 2 and err.strip().splitlines() == [
        f"error: OUT {out} already holds a subset drawn otherwise (SOURCE's {MANIFEST_NAME} changed since): give "
        "--overwrite to draw it again"], err
    assert snapshot(out) == before


def test_a_rerun_of_the_command_is_already_complete(source, tmp_path):
    # the real command twice, as a script that repeats its steps runs it: the second time is status 0
    command = [sys.executable, "-m", "data_tools.cli", "subset", str(source), str(tmp_path / "s"), "--per-class", "1"]
    first = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert first.returncode == 0, first.stderr
    before = snapshot(tmp_path / "s")
    again = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    assert again.returncode == 0 and not again.stderr, again.stderr
    assert again.stdout.strip().splitlines() == [f"{tmp_path / 's'} is already complete ({MANIFEST_NAME}: 1 of each "
                                                 f"class of {source}:train, seed 0); pass --overwrite to draw it "
                                                 "again"], again.stdout
    assert snapshot(tmp_path / "s") == before
    other = subprocess.run([*command, "--seed", "3"], capture_output=True, text=True, env=subprocess_env(), cwd=REPO)
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and len(lines) == 1 and "--seed 0 there, 3 now" in lines[0], other.stderr
    assert snapshot(tmp_path / "s") == before


# ------------------------------------------------------------------------------------------- --exclude


def keys_of(folder: Path) -> set[str]:
    return {name.split(".")[0] for name in members(folder)}


def test_exclude_draws_a_validation_set_apart_from_the_training_labels(source, tmp_path, capsys):
    # the gate's validation images must not be the labelled images a run trains on (docs/finetune.md)
    assert subset(capsys, source, tmp_path / "train", "--per-class", "4", "--seed", "0")[0] == 0
    code, out, _ = subset(capsys, source, tmp_path / "val", "--per-class", "6", "--seed", "0", "--exclude",
                          str(tmp_path / "train"))
    assert code == 0 and "18 of the 21 labelled samples" in out and "12 sample(s) of --exclude left out" in out, out
    assert labels(tmp_path / "val") == {0: 6, 1: 6, 2: 6}  # of the 11 of each class less the 4 drawn
    assert not keys_of(tmp_path / "val") & keys_of(tmp_path / "train")
    info = json.loads((tmp_path / "val" / MANIFEST_NAME).read_text())["subset"]
    assert info["excluded"] == 12 and info["exclude"][0]["of"] == str(tmp_path / "train")
    # several: what is left after two draws (1 of each class); one too many of a class is the usual one line
    assert subset(capsys, source, tmp_path / "third", "--per-class", "1", "--exclude",
                  str(tmp_path / "train"), "--exclude", str(tmp_path / "val"))[0] == 0
    assert not keys_of(tmp_path / "third") & (keys_of(tmp_path / "train") | keys_of(tmp_path / "val"))
    assert labels(tmp_path / "third") == {0: 1, 1: 1, 2: 1}
    code, _, err = subset(capsys, source, tmp_path / "none", "--per-class", "8", "--exclude", str(tmp_path / "train"))
    assert code == 2 and "less --exclude has fewer samples of 3 class(es) (class 0 has 7" in err, err
    assert not (tmp_path / "none").exists()
    # without --exclude the draw and its fingerprint are as they were: subsets drawn before are still complete
    first = json.loads((tmp_path / "train" / MANIFEST_NAME).read_text())
    assert "exclude" not in first["subset"] and "excluded" not in first["subset"]


def test_a_rerun_is_complete_and_an_excluded_set_drawn_again_makes_it_another_draw(source, tmp_path, capsys):
    train, val = tmp_path / "train", tmp_path / "val"
    assert subset(capsys, source, train, "--per-class", "2", "--seed", "0")[0] == 0
    draw = ["--per-class", "3", "--exclude", str(train)]
    assert subset(capsys, source, val, *draw)[0] == 0
    before = snapshot(val)
    code, out, _ = subset(capsys, source, val, *draw)
    assert code == 0 and "is already complete" in out and snapshot(val) == before
    code, _, err = subset(capsys, source, val, "--per-class", "3")
    assert code == 2 and f"(--exclude {train} there, none now)" in err, err
    assert subset(capsys, source, train, "--per-class", "2", "--seed", "5", "--overwrite")[0] == 0
    code, _, err = subset(capsys, source, val, *draw)
    assert code == 2 and f"(--exclude {train} holds other samples than when OUT was drawn)" in err, err
    assert snapshot(val) == before


def test_what_cannot_be_excluded_is_one_line_and_nothing_is_written(source, tmp_path, capsys):
    assert subset(capsys, source, tmp_path / "few", "--per-class", "1")[0] == 0
    renamed = shutil.copytree(tmp_path / "few", tmp_path / "renamed")  # samples that are not the source's
    with tarfile.open(renamed / "train-000000.tar") as tar:
        kept = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(renamed / "train-000000.tar", "w") as tar:
        for m, data in kept:
            m.name = "x" + m.name
            tar.addfile(m, io.BytesIO(data))
    assert in_process(build_main, ["index", str(renamed), "--overwrite"], capsys)[0] == 0
    for exclude, says in [(tmp_path / "nowhere", f"--exclude {tmp_path / 'nowhere'}: "),
                          (renamed, "3 of its 3 samples are not in"),
                          (tmp_path / "out", "is OUT itself"),
                          (tmp_path / "few", "holds every labelled sample of"),
                          (source, "holds every labelled sample of")]:  # the source itself: nothing left
        more = ["--split", "val"] if exclude == tmp_path / "few" else []  # its val is the source's: none left
        code, _, err = subset(capsys, source, tmp_path / "out", "--per-class", "1", "--exclude", str(exclude), *more)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
        assert not (tmp_path / "out").exists()


def test_a_class_with_no_sample_in_the_split_is_one_line_not_a_subset_without_it(tmp_path, capsys):
    # the draw went by the classes it met: a split without class c gave a subset of the others, and none at all
    # gave an empty OUT and the indexer's error
    lopsided = write_shard_set(tmp_path / "src", {"train": [6]}, labels={"train": [0, 1, 0, 1, 0, 1]})
    code, _, err = subset(capsys, lopsided, tmp_path / "out", "--per-class", "1")
    assert code == 2 and err.strip().splitlines() == [
        f"error: --per-class 1: {lopsided}:train has fewer samples of 1 class(es) (class 2 has 0): each class needs "
        "samples there"], err
    assert not (tmp_path / "out").exists()
