"""`build-shards index`: webdataset tars written by others (img2dataset's layout, timm's labelled `*-wds` layout)
get a manifest without being touched, and train as they are; remote sets (a brace pattern or a folder over loopback
HTTP) are indexed with the manifest elsewhere; a stalled, missing, damaged or non-tar shard is one line, or with
--skip-bad a recorded omission; --verify and `inspect --decode` report undecodable images per shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from data_tools.cli import main as build_main
from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.processes import REPO, ctrl_c_enabled, interrupt_paused, subprocess_env
from tests.helpers.servers import FaultyHandler, serve_directory, serve_faulty
from tests.helpers.shards import add, img2dataset_folder, jpeg, timm_style_folder
from vit_mpp.data.labels import MAX_CLASSES, sample_label
from vit_mpp.data.manifest import load_split
from vit_mpp.processes.exits import run_main

LENGTHS = [7, 12, 5]  # uneven shards


def digests(folder: Path) -> dict[str, tuple[str, float]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime) for p in folder.glob("*.tar")}


def index(*argv: str) -> None:
    build_main(["index", *argv, "--workers", "2"])


def refused(capsys, fn, argv: list[str]) -> str:
    """Run an entry point that must fail with a user error: exit status 2 and exactly one `error:` line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(fn, argv)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def pretrain(shards: str, run_dir: Path) -> None:
    pretrain_main(["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}", "data.val_split=",
                   "train.steps=3", "knn.train_images=0", f"train.run_dir={run_dir}"])
    assert (run_dir / "export" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def laion(tmp_path_factory) -> Path:
    """An img2dataset-style folder, indexed in place."""
    return img2dataset_folder(tmp_path_factory.mktemp("laion"), LENGTHS)


def test_an_img2dataset_folder_is_indexed_in_place_untouched_and_pretrains(laion, tmp_path, capsys):
    before = digests(laion)
    index(str(laion))
    assert digests(laion) == before  # the tars are never modified: same bytes, same mtime
    info = json.loads((laion / "_info.json").read_text())
    train = info["splits"]["train"]
    assert train["filenames"] == ["00000.tar", "00001.tar", "00002.tar"]
    assert train["shard_lengths"] == LENGTHS and train["num_samples"] == sum(LENGTHS)
    assert train["shard_bytes"] == [(laion / f).stat().st_size for f in train["filenames"]]
    assert train["image_extensions"] == {"jpg": sum(LENGTHS)} and train["num_without_image"] == 0
    assert info["indexed"] is True and info["source"]["kind"] == "index" and "location" not in info
    assert "num_classes" not in info and "class_names" not in info  # no labels: no classes
    summary = capsys.readouterr().out
    assert "indexed 3 shards: 24 samples" in summary and "jpg 24" in summary and "unlabelled" in summary
    assert "process worker(s))" in summary  # --pool auto: processes

    split, _ = load_split(str(laion), "train")  # what training reads
    assert split.lengths == LENGTHS and split.urls[0] == str(laion / "00000.tar")
    pretrain(str(laion), tmp_path / "pretrain")

    line = refused(capsys, finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={laion}",
                                           "data.val_split=", f"init.checkpoint={tmp_path / 'pretrain' / 'export'}",
                                           f"train.run_dir={tmp_path / 'finetune'}"])
    assert "carry no labels" in line


def test_reindexing_writes_the_same_manifest(laion):
    index(str(laion))  # its own first index: under xdist the test above may run in another worker
    first = (laion / "_info.json").read_bytes()
    index(str(laion), "--pool", "thread")
    assert (laion / "_info.json").read_bytes() == first  # no timing, host or order in it


def test_remote_shards_get_a_manifest_elsewhere_and_train_from_it(laion, tmp_path, capsys):
    out = tmp_path / "manifests"
    with serve_directory(laion) as base:
        index(f"{base}/{{00000..00002}}.tar", "--out", str(out))
        info = json.loads((out / "_info.json").read_text())
        assert info["location"] == base and info["splits"]["train"]["filenames"] == ["00000.tar", "00001.tar",
                                                                                    "00002.tar"]
        assert info["splits"]["train"]["shard_lengths"] == LENGTHS
        split, _ = load_split(str(out / "_info.json"), "train")
        assert split.urls == [f"{base}/0000{i}.tar" for i in range(3)]
        pretrain(str(out / "_info.json"), tmp_path / "run")
        # the folder URL (its index page) gives the same shards
        index(f"{base}/", "--out", str(tmp_path / "by_folder.json"))
        assert json.loads((tmp_path / "by_folder.json").read_text())["splits"] == info["splits"]
        # remote shards and no --out: nowhere to write
        assert "give --out" in refused(capsys, build_main, ["index", f"{base}/"])


def test_a_stalled_shard_is_one_line_in_bounded_time(laion, tmp_path, capsys):
    with serve_faulty(laion) as base:
        FaultyHandler.faults["/00001.tar"] = ("stall", 100)  # half the body, then silence
        start = time.monotonic()
        line = refused(capsys, build_main, ["index", f"{base}/{{00000..00002}}.tar", "--out", str(tmp_path / "m"),
                                            "--read-timeout", "1", "--read-retries", "1", "--workers", "2"])
        elapsed = time.monotonic() - start
        # On a loaded machine the server may take the retry's request off its queue after the client's 1 s
        # deadline (the retry then stalled before any byte): it is recorded then, not lost.
        deadline = time.monotonic() + 10
        while FaultyHandler.requests.count("/00001.tar") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert f"{base}/00001.tar" in line and "no data for 1 s" in line and "2 attempts" in line, line
    assert elapsed < 20, elapsed
    assert not (tmp_path / "m").exists()  # nothing written
    assert FaultyHandler.requests.count("/00001.tar") == 2  # retried once, then reported


@pytest.mark.parametrize("pool", ["process", "thread"])
def test_a_bad_shard_stops_a_stalled_read_at_once(laion, tmp_path, capsys, pool):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "00000.tar").write_bytes(b"not a tar at all" * 100)
    (folder / "00001.tar").write_bytes((laion / "00001.tar").read_bytes())
    with serve_faulty(folder) as base:
        FaultyHandler.faults["/00001.tar"] = ("stall", 100)
        start = time.monotonic()
        line = refused(capsys, build_main, ["index", f"{base}/{{00000..00001}}.tar", "--out", str(tmp_path / "m"),
                                            "--read-timeout", "60", "--workers", "2", "--pool", pool])
        elapsed = time.monotonic() - start
    assert "00000.tar: not a tar" in line, line
    assert elapsed < 15, elapsed  # the stalled read was left when the workers were told to stop, not after 60 s
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_ctrl_c_during_a_stalled_read_is_one_line_at_once(laion, tmp_path, pool):
    with serve_faulty(laion) as base:
        FaultyHandler.faults["/00001.tar"] = ("stall", 100)
        proc = subprocess.Popen(
            [sys.executable, "-m", "data_tools.cli", "index", f"{base}/{{00000..00002}}.tar", "--out",
             str(tmp_path / "m"), "--read-timeout", "60", "--workers", "2", "--pool", pool],
            env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=ctrl_c_enabled)
        deadline = time.monotonic() + 60
        while "/00001.tar" not in FaultyHandler.requests and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(0.5)  # the stalled half of the body has been read: the worker now waits for the rest
        start = time.monotonic()
        interrupt_paused(proc)
        _, err = proc.communicate(timeout=90)
        elapsed = time.monotonic() - start
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and lines == ["error: interrupted; nothing was written"], err
    assert elapsed < 15, elapsed  # not the 60 s of the read's deadline
    assert not (tmp_path / "m").exists()


def test_sigterm_to_the_whole_job_during_a_stalled_read_is_one_line(laion, tmp_path):
    # a scheduler (SLURM's scancel) signals every process of the job: the worker processes end, the main one says
    # it was interrupted, not that a worker died
    with serve_faulty(laion) as base:
        FaultyHandler.faults["/00001.tar"] = ("stall", 100)
        proc = subprocess.Popen(
            [sys.executable, "-m", "data_tools.cli", "index", f"{base}/{{00000..00002}}.tar", "--out",
             str(tmp_path / "m"), "--read-timeout", "60", "--workers", "2", "--pool", "process"],
            env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        deadline = time.monotonic() + 60
        while "/00001.tar" not in FaultyHandler.requests and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(0.5)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        elapsed = time.monotonic() - start
    assert proc.returncode == 130 and err.strip().splitlines() == ["error: interrupted; nothing was written"], err
    assert elapsed < 15, elapsed
    assert not (tmp_path / "m").exists()


def test_a_missing_shard_of_a_pattern_is_one_line(laion, tmp_path, capsys):
    line = refused(capsys, build_main, ["index", str(laion / "{00000..00003}.tar"), "--out", str(tmp_path / "m")])
    assert "00003.tar: no such shard" in line
    with serve_directory(laion) as base:
        line = refused(capsys, build_main, ["index", f"{base}/{{00000..00003}}.tar", "--out", str(tmp_path / "m")])
    assert f"{base}/00003.tar missing: HTTP 404" in line
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("argv, expected", [
    (["{empty}"], "no .tar files"),
    (["{laion}", "--split", "train", "--split", "val"], "--split is given 2 times for 1 LOCATIONs"),
    (["{laion}", "--split", "va-l"], "split names are letters"),
    (["{laion}", "{laion}/00000.tar", "--split", "train", "--split", "val"], "is named twice"),
    (["{laion}/nothing"], "no such folder or file"),
    (["{laion}/{{00000..00002.tar"], "unbalanced braces"),
    (["{laion}", "--read-timeout", "inf"], "--read-timeout must be > 0 and finite"),
    (["{laion}", "--workers", "0"], "--workers must be >= 1"),
    (["{laion}", "--out", "{laion}/00000.tar/m"], "00000.tar is a file, not a folder"),
    (["{laion}", "--reader", "compiled"], "--reader compiled: the compiled tar walker was removed"),
])
def test_mistakes_are_one_line_and_write_nothing(laion, tmp_path, capsys, argv, expected):
    (tmp_path / "empty").mkdir()
    before = sorted(os.listdir(laion))
    argv = [a.format(laion=laion, empty=tmp_path / "empty") for a in argv]
    assert expected in refused(capsys, build_main, ["index", *argv])
    assert sorted(os.listdir(laion)) == before and not os.listdir(tmp_path / "empty")


def test_verify_reports_undecodable_images_per_shard(tmp_path, capsys):
    folder = img2dataset_folder(tmp_path / "set", LENGTHS, corrupt="000010003")
    index(str(folder))
    plain = json.loads((folder / "_info.json").read_text())["splits"]["train"]
    assert "num_undecodable" not in plain  # not decoded without --verify
    capsys.readouterr()
    index(str(folder), "--verify")
    out = capsys.readouterr().out
    train = json.loads((folder / "_info.json").read_text())["splits"]["train"]
    assert train["num_undecodable"] == 1 and train["shard_lengths"] == LENGTHS
    [entry] = train["undecodable"]
    assert entry["shard"] == "00001.tar" and entry["count"] == 1 and entry["keys"] == ["000010003"]
    assert "undecodable: " in out and "00001.tar: 1 sample(s), e.g. 000010003" in out
    assert "1 undecodable" in out


def test_inspect_decode_finds_what_plain_inspect_calls_verified(tmp_path, capsys):
    folder = img2dataset_folder(tmp_path / "set", LENGTHS, corrupt="000020001")
    index(str(folder))
    capsys.readouterr()
    assert build_inspect(folder) == 0
    assert "verified: every shard matches the manifest" in capsys.readouterr().out
    assert build_inspect(folder, "--decode") == 1
    out = capsys.readouterr().out
    assert "00002.tar: undecodable image(s) in 1 sample(s), e.g. 000020001" in out


def build_inspect(folder: Path, *flags: str) -> int:
    try:
        build_main(["inspect", str(folder), "--samples", "0", *flags])
    except SystemExit as e:
        return int(e.code)
    return 0


def test_skip_bad_records_a_non_tar_file_and_leaves_it_out(tmp_path, capsys):
    folder = img2dataset_folder(tmp_path / "set", LENGTHS)
    (folder / "00003.tar").write_text("<html>this is not a tar</html>\n" * 30)
    line = refused(capsys, build_main, ["index", str(folder)])
    assert "00003.tar: not a tar" in line and "--skip-bad" in line
    assert not (folder / "_info.json").exists()
    before = digests(folder)
    index(str(folder), "--skip-bad")
    assert digests(folder) == before
    info = json.loads((folder / "_info.json").read_text())
    assert info["splits"]["train"]["filenames"] == ["00000.tar", "00001.tar", "00002.tar"]
    assert info["num_bad_shards"] == 1
    [bad] = info["bad_shards"]
    assert bad["shard"] == str(folder / "00003.tar") and bad["split"] == "train"
    assert bad["reason"].startswith("not a tar")
    assert "left out: " in capsys.readouterr().out


@pytest.mark.parametrize("damage, reason", [
    (lambda data, header: data[: len(data) // 2 + 100], "truncated"),
    (lambda data, header: data[:header] + b"garbage!" * 8 + data[header + 64:], "damaged tar header at byte"),
    (lambda data, header: b"", "empty file"),
])
def test_damaged_tars_are_named_with_their_reason(tmp_path, capsys, damage, reason):
    folder = img2dataset_folder(tmp_path / "set", lengths=[4, 4])
    path = folder / "00001.tar"
    with tarfile.open(path) as tar:
        header = tar.getmembers()[4].offset  # the second sample's first header
    path.write_bytes(damage(path.read_bytes(), header))
    line = refused(capsys, build_main, ["index", str(folder)])
    assert str(path) in line and reason in line, line
    assert not (folder / "_info.json").exists()


RAW_LABELS = (b"1", b"cat", b"99999999999999999999", str(MAX_CLASSES).encode(), str(MAX_CLASSES - 1).encode(), b"-3")


def test_labels_that_are_not_class_indices_are_recorded_not_counted(tmp_path, capsys):
    # a label of 10**20 made the index build a list of 10**20 class names: the machine ran out of memory
    folder = tmp_path / "set"
    folder.mkdir()
    rng = np.random.default_rng(0)
    with tarfile.open(folder / "00000.tar", "w") as tar:
        for key, label in zip("abcdef", RAW_LABELS):
            add(tar, f"{key}.jpg", jpeg(rng))
            add(tar, f"{key}.cls", label)
    index(str(folder))
    info = json.loads((folder / "_info.json").read_text())
    assert info["num_classes"] == MAX_CLASSES and info["label_range"] == [1, MAX_CLASSES - 1]
    assert "class_names" not in info and len((folder / "_info.json").read_bytes()) < 4096  # no 10**7 names
    assert info["num_unlabelled"] == 4  # f (a negative label is no label, as training reads it) and the bad ones
    bad = info["splits"]["train"]["bad_labels"]
    assert info["splits"]["train"]["num_bad_labels"] == 3 and bad[0]["keys"] == ["b", "c", "d"]
    assert info["splits"]["train"]["num_unlabelled"] == 4
    assert "bad label: " in capsys.readouterr().out
    # fine-tuning refuses the split before its run directory is written, not at the first such sample, an epoch in
    run_dir = tmp_path / "finetune"
    line = refused(capsys, finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={folder}",
                                           "data.val_split=", "init.checkpoint=", f"train.run_dir={run_dir}"])
    assert line == (f"error: split 'train' of {folder} has 4 sample(s) without a usable label (3 of them with a .cls "
                    "that is not a class index; the manifest lists their keys): a classifier needs a label on every "
                    "sample; pretraining accepts them"), line
    # and pretraining does: the stream reads labels by the index's rule (vit_mpp/data/labels.py), a bad one as none; a
    # label of 10**20 stopped pretraining with an int64 overflow traceback from a loader worker
    assert [sample_label({"cls": raw}) for raw in RAW_LABELS] == [1, -1, -1, -1, MAX_CLASSES - 1, -1]
    pretrain(str(folder), tmp_path / "pretrain")
    assert not run_dir.exists()


def test_timm_style_labelled_shards_get_classes_and_fine_tune(tmp_path, capsys):
    folder = timm_style_folder(tmp_path / "toy-wds", train=[20, 14], val=[9])
    (folder / "_info.json").write_text(json.dumps({"name": "toy", "splits": {}}))  # timm's own manifest
    argv = [str(folder / "toy-train-{0000..0001}.tar"), str(folder / "toy-validation-00.tar"),
            "--split", "train", "--split", "val"]
    assert "--overwrite replaces it" in refused(capsys, build_main, ["index", *argv])
    index(*argv, "--overwrite")
    info = json.loads((folder / "_info.json").read_text())
    assert info["num_classes"] == 3 and "class_names" not in info and info["label_range"] == [0, 2]
    assert info["num_unlabelled"] == 0 and info["source"]["split"] == ["train", "val"]
    assert info["splits"]["train"]["shard_lengths"] == [20, 14] and info["splits"]["val"]["num_samples"] == 9
    assert "labelled, 3 classes (0..2)" in capsys.readouterr().out
    run_dir = tmp_path / "finetune"
    finetune_main(["--config", "configs/finetune/tiny.yaml", f"data.shards={folder}", "data.num_workers=0",
                   "init.checkpoint=", "model.patch_size=4", "model.embed_dim=32", "model.depth=1",
                   "model.num_heads=2", "train.epochs=1", f"train.run_dir={run_dir}"])
    assert (run_dir / "export" / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("val_top1" in m for m in metrics)
