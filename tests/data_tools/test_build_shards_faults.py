"""build-shards under hostile inputs: each test reproduces a failure and checks the promised behaviour.

The rules: every input that is not written is in failures.jsonl with its reason, reproducibly; every user mistake
ends in one line `error: ...`, exit status 2, before anything in OUT is overwritten; a damaged build is reported by
`inspect` (exit 1), never a crash; Ctrl-C ends in one line and the same command resumes.
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_tools.builder.catalog import CatalogWriter
from data_tools.builder.writer import ShardWriter
from data_tools.cli import main as build_main
from data_tools.inspect_shards import verify
from tests.helpers.build import make_tree, one_line_error, result_files, samples, write_list
from tests.helpers.disks import resize, small_disk
from tests.helpers.processes import REPO, ctrl_c_enabled, interrupt_paused, subprocess_env
from tests.helpers.shards import image_bytes
from vit_mpp.data.manifest import ManifestError, check_every_sample_labelled, load_split


def failures(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "failures.jsonl").read_text().splitlines()]


def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_tools.cli", *args], capture_output=True, text=True,
                          env=subprocess_env(), cwd=REPO, timeout=timeout)


def assert_one_line(result: subprocess.CompletedProcess, status: int = 2) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# ---------------------------------------------------------------- 4: nothing vanishes unreported

def test_an_unreadable_class_folder_is_recorded_and_counted(tmp_path, monkeypatch, capsys):
    make_tree(tmp_path / "src", {"a": 4, "b": 3, "c": 2})
    unreadable = tmp_path / "src" / "b"
    if os.geteuid() != 0:
        unreadable.chmod(0)
    else:  # root reads any folder: make scandir fail as it does for a user without the permission
        real = os.scandir

        def scandir(path="."):
            if isinstance(path, (str, os.PathLike)) and Path(path) == unreadable:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)
    try:
        build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--val-fraction", "0"])
    finally:
        unreadable.chmod(0o755)
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert info["class_names"] == ["a", "b", "c"]  # the class keeps its label; it is empty, and it says why
    assert failures(tmp_path / "out") == [{"source": "b", "split": None, "reason": "unreadable_folder",
                                           "detail": "PermissionError: Permission denied"}]
    assert "inputs: 7 seen, 6 written, 1 failed (unreadable_folder 1; see failures.jsonl)" in capsys.readouterr().out


def test_dangling_links_loops_and_other_files_are_recorded(tmp_path, capsys):
    files = make_tree(tmp_path / "src", {"a": 3, "b": 2})
    outside = tmp_path / "elsewhere.jpg"
    outside.write_bytes(files["a/img000.jpg"])
    src = tmp_path / "src"
    (src / "a" / "dangling.jpg").symlink_to(tmp_path / "missing.jpg")
    (src / "a" / "back").symlink_to(src / "a")  # a folder link to a folder that contains it
    (src / "b" / "x.jpg").symlink_to(src / "b" / "y.jpg")
    (src / "b" / "y.jpg").symlink_to(src / "b" / "x.jpg")  # a chain of links that loops
    (src / "b" / "linked.jpg").symlink_to(outside)  # a good link: used
    (src / "b" / "README.txt").write_text("not an image")
    (src / "stray.jpg").write_bytes(files["a/img000.jpg"])  # outside any class folder
    os.mkfifo(src / "a" / "pipe.jpg")
    (src / ".hidden").mkdir()  # hidden entries are not inputs
    (src / ".hidden" / "x.jpg").write_bytes(files["a/img000.jpg"])
    build_main([str(src), str(tmp_path / "out"), "--val-fraction", "0"])
    got = {(f["source"], f["reason"]) for f in failures(tmp_path / "out")}
    assert got == {("a/dangling.jpg", "broken_link"), ("a/back", "symlink_loop"), ("b/x.jpg", "symlink_loop"),
                   ("b/y.jpg", "symlink_loop"), ("b/README.txt", "not_an_image"), ("stray.jpg", "outside_class_folder"),
                   ("a/pipe.jpg", "not_a_file")}
    written = sorted(json.loads(s["json"])["source"] for s in samples(tmp_path / "out", "train"))
    assert written == sorted([*files, "b/linked.jpg"])
    assert "inputs: 13 seen, 6 written, 7 failed" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["inside", "same", "inside_with_overwrite"])
def test_out_inside_source_is_refused(tmp_path, capsys, where):
    make_tree(tmp_path / "src", {"a": 3, "b": 3})
    out = tmp_path / "src" if where == "same" else tmp_path / "src" / "shards"
    extra = ["--overwrite"] if where == "inside_with_overwrite" else []
    message = one_line_error(capsys, str(tmp_path / "src"), str(out), *extra)
    assert "is inside SOURCE" in message
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["a", "b"]  # nothing created, nothing removed


# ---------------------------------------------------------------- 5: unlabelled rows

@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_a_list_mixing_labelled_and_unlabelled_rows(tmp_path, capsys, fmt):
    files = make_tree(tmp_path / "imgs", {"x": 6})
    names = sorted(files)
    rows = [{"path": f"imgs/{p}", "label": ["cat", "dog", None][i % 3]} for i, p in enumerate(names)]
    lst = write_list(tmp_path / f"list.{fmt}", rows)
    message = one_line_error(capsys, str(lst), str(tmp_path / "out"))
    assert "2 of 6 inputs" in message and "no label" in message and "--unlabelled-rows" in message
    assert not (tmp_path / "out").exists()

    build_main([str(lst), str(tmp_path / "skip"), "--unlabelled-rows", "skip", "--val-fraction", "0"])
    assert [(f["source"], f["reason"]) for f in failures(tmp_path / "skip")] == [
        (f"imgs/{names[2]}", "unlabelled"), (f"imgs/{names[5]}", "unlabelled")]
    assert all("cls" in s for s in samples(tmp_path / "skip", "train"))

    build_main([str(lst), str(tmp_path / "keep"), "--unlabelled-rows", "keep", "--val-fraction", "0"])
    info = json.loads((tmp_path / "keep" / "_info.json").read_text())
    got = samples(tmp_path / "keep", "train")
    assert info["num_unlabelled"] == 2 and len(got) == 6 and sum("cls" not in s for s in got) == 2
    # counted per split too, so fine-tuning refuses the split before it starts, not at its first unlabelled sample
    assert info["splits"]["train"]["num_unlabelled"] == 2
    with pytest.raises(ManifestError, match="split 'train' of .* has 2 sample.s. without a usable label: a "):
        check_every_sample_labelled(tmp_path / "keep", info, "train")
    assert "num_unlabelled" not in json.loads((tmp_path / "skip" / "_info.json").read_text())["splits"]["train"]


# ---------------------------------------------------------------- 5b: rows that repeat a path

def test_a_list_naming_a_path_twice(tmp_path, capsys):
    # Each row was written: an image listed twice was two samples, possibly one in train and one in val, and a
    # path listed with two labels gave the model both.
    files = make_tree(tmp_path / "imgs", {"x": 4})
    a, b, c, d = (f"imgs/{p}" for p in sorted(files))
    rows = [{"path": a, "label": "cat"}, {"path": b, "label": "cat"}, {"path": a, "label": "cat"},
            {"path": "./" + b, "label": "dog"}, {"path": c.replace("/", "//", 1), "label": "cat"},
            {"path": d, "label": "dog"}]
    lst = write_list(tmp_path / "list.csv", rows)
    message = one_line_error(capsys, str(lst), str(tmp_path / "out"))
    assert message == (f"error: 2 of the 6 rows of {lst} name a path an earlier row names (first: {a!r}, 1 of them "
                       "with another label); pass --repeated-rows skip to write each path once (its first row), or "
                       "--repeated-rows keep to write every row")
    assert not (tmp_path / "out").exists()

    build_main([str(lst), str(tmp_path / "skip"), "--repeated-rows", "skip", "--val-fraction", "0.5"])
    assert [(f["source"], f["reason"], f["detail"]) for f in failures(tmp_path / "skip")] == [
        (a, "repeated", f"names the path of an earlier row ({a}); written once, as that row"),
        ("./" + b, "repeated", f"names the path of an earlier row ({b}), with another label; written once, as that "
                               "row")]
    written = [(json.loads(s["json"])["source"], int(s["cls"])) for split in ("train", "val")
               for s in samples(tmp_path / "skip", split)]
    assert sorted(written) == sorted([(a, 0), (b, 0), (c.replace("/", "//", 1), 0), (d, 1)])  # each image once

    build_main([str(lst), str(tmp_path / "keep"), "--repeated-rows", "keep", "--val-fraction", "0"])
    assert len(samples(tmp_path / "keep", "train")) == 6
    assert json.loads((tmp_path / "keep" / "_info.json").read_text())["source"]["num_repeated"] == 2
    assert "num_repeated" not in json.loads((tmp_path / "skip" / "_info.json").read_text())["source"]
    assert "(2 repeating an earlier row's path, kept by --repeated-rows keep)" in capsys.readouterr().out


def test_repeats_are_found_exactly_whatever_the_hashes(tmp_path):
    writer = CatalogWriter(tmp_path, check_repeats=True)
    for source_id in ["a.jpg", "b.jpg", "./a.jpg", "http://h//x.jpg", "http://h/x.jpg", "c//d.jpg", "c/d.jpg"]:
        writer.add(source_id)
    catalog = writer.finish()
    expected = [[2, 0], [6, 5]]  # URLs are taken as written
    assert catalog.repeats.tolist() == expected
    catalog.find_repeats(np.zeros(len(catalog), dtype=np.int64))  # every hash the same: the ids decide
    assert catalog.repeats.tolist() == expected
    catalog.find_repeats(np.arange(len(catalog), dtype=np.int64))  # hashes all differ: no row is read
    assert catalog.repeats.tolist() == []
    catalog.close()


def test_bad_label_values_are_recorded_not_guessed(tmp_path):
    files = make_tree(tmp_path / "imgs", {"x": 6})
    names = sorted(files)
    labels = [0, 1, 2.5, -4, True, 10**12]
    lst = tmp_path / "list.jsonl"
    lst.write_text("".join(json.dumps({"path": f"imgs/{p}", "label": v}) + "\n" for p, v in zip(names, labels))
                   + "[1, 2]\nnot json\n" + json.dumps({"path": ""}) + "\n")
    build_main([str(lst), str(tmp_path / "out"), "--val-fraction", "0"])
    got = [(f["source"], f["reason"]) for f in failures(tmp_path / "out")]
    assert got == [(f"imgs/{names[i]}", "bad_label") for i in (2, 3, 4, 5)] + [
        ("list.jsonl:7", "bad_row"), ("list.jsonl:8", "bad_row"), ("list.jsonl:9", "bad_row")]
    assert json.loads((tmp_path / "out" / "_info.json").read_text())["class_names"] == ["0", "1"]


def test_an_hf_dataset_with_some_null_labels(tmp_path, capsys, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.Dataset.from_dict({"image": [{"bytes": image_bytes(rng), "path": None} for _ in range(5)],
                                "label": [0, None, 1, 1, None]}, features=features).save_to_disk(str(tmp_path / "hf"))
    capsys.readouterr()
    message = one_line_error(capsys, str(tmp_path / "hf"), str(tmp_path / "out"))
    assert "2 of 5 inputs" in message
    build_main([str(tmp_path / "hf"), str(tmp_path / "out"), "--unlabelled-rows", "skip", "--val-fraction", "0"])
    assert [f["source"] for f in failures(tmp_path / "out")] == ["train/1", "train/4"]


# ---------------------------------------------------------------- list paths

@pytest.mark.parametrize("path, allowed", [("../outside/img.jpg", True), ("ABSOLUTE", True),
                                           ("s3://bucket/img.jpg", None), ("file:///etc/hostname", None),
                                           ("pipe:cat /etc/hostname", False)],
                         ids=["dotdot", "absolute", "url", "file_url", "pipe"])
def test_list_paths_stay_in_the_lists_folder_unless_allowed(tmp_path, capsys, path, allowed):
    rng = np.random.default_rng(0)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "img.jpg").write_bytes(image_bytes(rng))
    (tmp_path / "lists" / "imgs").mkdir(parents=True)
    (tmp_path / "lists" / "imgs" / "in.jpg").write_bytes(image_bytes(rng))
    path = str(tmp_path / "outside" / "img.jpg") if path == "ABSOLUTE" else path
    lst = tmp_path / "lists" / "list.csv"
    lst.write_text(f"path\nimgs/in.jpg\n{path}\n")
    message = one_line_error(capsys, str(lst), str(tmp_path / "out"))
    assert "list.csv:3" in message and (("--allow-outside-paths" in message) != (allowed is False))
    if allowed is False:
        assert "never commands" in message
        message = one_line_error(capsys, str(lst), str(tmp_path / "out"), "--allow-outside-paths")
        assert "never commands" in message
    elif allowed:
        build_main([str(lst), str(tmp_path / "out"), "--allow-outside-paths", "--val-fraction", "0"])
        assert len(samples(tmp_path / "out", "train")) == 2


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01\xff\xfe" * 100, "not UTF-8 text"),
    (b"file,label\na.jpg,1\n", "no 'path' column"),
    (b"", "no 'path' column"),
])
def test_a_list_that_is_not_a_list_is_one_line(tmp_path, capsys, content, message):
    (tmp_path / "list.csv").write_bytes(content)
    assert message in one_line_error(capsys, str(tmp_path / "list.csv"), str(tmp_path / "out"))


@pytest.mark.parametrize("content, message", [
    (b"PAR1 not really" * 10, "is not a readable parquet file: Parquet magic bytes not found"),
    (b"", "is not a readable parquet file: Parquet file size is 0 bytes"),
])
def test_a_parquet_file_that_is_not_parquet_is_one_line_naming_it(tmp_path, capsys, content, message):
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "a.parquet").write_bytes(content)
    for source in ("lists/a.parquet", "lists"):  # the file itself, and a folder of lists holding it
        line = one_line_error(capsys, str(tmp_path / source), str(tmp_path / "out"))
        assert line.startswith(f"error: {tmp_path / 'lists/a.parquet'} {message}"), line
    assert not (tmp_path / "out").exists()


def test_a_damaged_parquet_dataset_is_one_line_without_the_log_of_datasets(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"not parquet")
    for extra in (["--source-kind", "hf"], ["--streaming"]):
        result = run(str(tmp_path / "a.parquet"), str(tmp_path / "out"), *extra)
        assert "Parquet magic bytes not found" in assert_one_line(result)  # datasets' own error log held back


# ---------------------------------------------------------------- 8: inspect reports damage

def _rewrite(shard: Path, change) -> None:
    """Rewrite a shard's samples through `change(key, files) -> list of (key, files)`."""
    import tarfile

    items: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for m in tar:
            key, ext = m.name.split(".", 1)
            items.setdefault(key, {})[ext] = tar.extractfile(m).read()
    writer = ShardWriter(shard)
    for key, files in items.items():
        for new_key, new_files in change(key, files):
            writer.write(new_key, new_files)
    writer.close()


def test_inspect_reports_damaged_shards_as_problems(tmp_path, capsys):
    make_tree(tmp_path / "src", {"a": 10, "b": 10})
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "2", "--val-fraction", "0"])
    out = tmp_path / "out"
    shards = sorted(out.glob("train-*.tar"))
    shards[0].write_bytes(shards[0].read_bytes()[:700])  # truncated
    shards[1].write_bytes(b"")  # empty
    shards[2].write_text("this is not a tar file\n" * 40)  # not a tar
    shards[3].unlink()  # deleted
    _rewrite(shards[4], lambda k, f: [(k, {**f, "cls": b"7"})])  # labels out of range (2 classes)
    _rewrite(shards[5], lambda k, f: [(k, {**f, "cls": b"99999999999999999999"})])  # beyond any class index
    _rewrite(shards[6], lambda k, f: [(k, f), (k + "x", f)])  # more samples than the manifest says
    _rewrite(shards[7], lambda k, f: [(k, {**f, "cls": b"cat"})])  # not an integer
    _rewrite(shards[8], lambda k, f: [(k, {**f, "cls": b"-1"})])  # no label, as training reads it: not a problem
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        build_main(["inspect", str(out), "--grid", str(tmp_path / "grid.png")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 1 and captured.err == ""
    text = " ".join(captured.out.split())
    for expected in (f"{shards[0].name}: truncated: the file ends inside", f"{shards[1].name}: empty file",
                     f"{shards[2].name}: not a tar (no tar header at the start)", f"{shards[3].name}: missing",
                     f"{shards[4].name}: 2 bad label(s) for num_classes 2, e.g.",
                     "(7 not in 0..1)", f"{shards[5].name}: 2 bad label(s)", "is above the largest class index",
                     f"{shards[6].name}: 4 samples, manifest says 2", f"{shards[7].name}: 2 bad label(s)",
                     "is not an integer"):
        assert expected in text, expected
    assert f"{shards[8].name}: sha256 differs" in text and f"{shards[8].name}: 2 bad label" not in text
    assert Image.open(tmp_path / "grid.png").width > 0  # the grid is drawn from what is readable


def test_a_grid_that_cannot_be_written_is_one_line_before_the_shards_are_read(tmp_path, capsys):
    # a folder or a name without an image extension was a ValueError traceback from PIL, after every shard was read
    make_tree(tmp_path / "src", {"a": 2, "b": 2})
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "4", "--val-fraction", "0"])
    (tmp_path / "file").write_text("x")
    for grid, message in ((tmp_path, f"--grid {tmp_path} is a folder: give a file name"),
                          (tmp_path / "grid.txt", "give an image file name (.png, .jpg, ...)"),
                          (tmp_path / "file" / "g.png", f"{tmp_path / 'file'} is a file, not a folder")):
        capsys.readouterr()
        line = one_line_error(capsys, "inspect", str(tmp_path / "out"), "--grid", str(grid))
        assert message in line, line
    capsys.readouterr()
    build_main(["inspect", str(tmp_path / "out"), "--grid", str(tmp_path / "grid.JPG"), "--samples", "2"])
    assert Image.open(tmp_path / "grid.JPG").format == "JPEG"
    for _ in range(2):  # docs/build_shards.md's own example, into the set beside its shards; a rerun too
        build_main(["inspect", str(tmp_path / "out"), "--grid", str(tmp_path / "out" / "_samples.png")])
    assert Image.open(tmp_path / "out" / "_samples.png").format == "PNG"


def test_inspect_counts_samples_as_training_reads_them(tmp_path, capsys):
    # inspect grouped members by their name's first dot: a folder member or webdataset's `__meta__` members were
    # counted as samples, and a healthy shard reported as holding more samples than its manifest says
    make_tree(tmp_path / "src", {"a": 2, "b": 2})
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "4", "--val-fraction", "0"])
    shard = next((tmp_path / "out").glob("train-*.tar"))
    with tarfile.open(shard, "a") as tar:
        folder = tarfile.TarInfo("a.folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        meta = tarfile.TarInfo("__meta__")
        meta.size = 2
        tar.addfile(meta, io.BytesIO(b"{}"))
    _, info = load_split(tmp_path / "out", "train")
    problems = verify(str(tmp_path / "out"), info)
    assert all("samples, manifest says" not in p for p in problems), problems  # sha256 and size differ, not count
    assert problems and all(("sha256" in p or "bytes, manifest says" in p) for p in problems), problems


@pytest.mark.parametrize("manifest, message", [
    (None, "no _info.json in"), (b"{not json", "is not valid JSON"), (b"[1, 2]", "is not a build-shards manifest"),
    (b'{"splits": 3}', "no 'splits'"),
    (b'{"splits": {"train": {"filenames": ["a.tar"], "shard_lengths": []}}}', "lists of the same length"),
    (b'{"splits": {"train": {"filenames": ["../../etc/passwd"], "shard_lengths": [1]}}}', "not a plain name"),
])
def test_inspect_without_a_usable_manifest_is_one_line(tmp_path, capsys, manifest, message):
    (tmp_path / "out").mkdir()
    if manifest is not None:
        (tmp_path / "out" / "_info.json").write_bytes(manifest)
    assert message in one_line_error(capsys, "inspect", str(tmp_path / "out"))


# ---------------------------------------------------------------- 11: OUT, Ctrl-C

def test_out_under_a_file_or_not_writable_is_one_line(tmp_path, capsys):
    make_tree(tmp_path / "src", {"a": 3})
    (tmp_path / "file").write_text("a file")
    assert "is a file" in one_line_error(capsys, str(tmp_path / "src"), str(tmp_path / "file" / "out"))
    assert "is a file" in one_line_error(capsys, str(tmp_path / "src"), str(tmp_path / "file"))
    if os.geteuid() != 0:
        (tmp_path / "locked").mkdir(mode=0o555)
        unwritable = tmp_path / "locked" / "out"
    else:  # root writes anywhere but on read-only file systems
        unwritable = Path("/sys/build-shards-test-out")
    assert "is not writable" in one_line_error(capsys, str(tmp_path / "src"), str(unwritable))
    assert (tmp_path / "file").read_text() == "a file"


@pytest.mark.parametrize("sig, whole_job", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)])
def test_ctrl_c_is_one_line_and_the_same_command_resumes(tmp_path, sig, whole_job):
    # Ctrl-C; a scheduler's stop of the main process; one of every process of the job (SLURM's scancel), where the
    # workers end of it too: the line says interrupted, not that a worker died
    make_tree(tmp_path / "src", {"a": 150, "b": 150}, size=64)
    args = [str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "5", "--max-side", "40", "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "data_tools.cli", *args], env=subprocess_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_enabled,
                            start_new_session=whole_job)
    journal = tmp_path / "out" / "_journal.jsonl"
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline and (
            not journal.exists() or len(journal.read_text().splitlines()) < 8):
        time.sleep(0.005)
    if whole_job:
        os.killpg(proc.pid, sig)
    else:
        interrupt_paused(proc, sig)
    _, err = proc.communicate(timeout=60)
    assert not (tmp_path / "out" / "_info.json").exists(), "the build finished before Ctrl-C"
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, err
    assert lines[0].startswith("error: interrupted") and "re-run the same command to resume" in lines[0]
    result = run(*args)
    assert result.returncode == 0 and "resuming" in result.stdout, result.stdout + result.stderr
    build_main([args[0], str(tmp_path / "clean"), *args[2:]])
    assert result_files(tmp_path / "out") == result_files(tmp_path / "clean")
    assert not list((tmp_path / "out").glob("*.tmp"))


# ---------------------------------------------------------------- images and failure records

def png16(pixels: np.ndarray) -> bytes:
    """A real 16-bit RGB or RGBA PNG (colour type 2 or 6), rows filtered with each of the five PNG filters in turn,
    as encoders with adaptive filtering write them."""
    h, w, c = pixels.shape
    bpp = 2 * c
    raw = [pixels[y].astype(">u2").tobytes() for y in range(h)]
    out, prior = bytearray(), bytes(w * bpp)
    for y, row in enumerate(raw):
        kind = y % 5
        line = bytearray(len(row))
        for i, x in enumerate(row):
            a = row[i - bpp] if i >= bpp else 0
            b = prior[i]
            cc = prior[i - bpp] if i >= bpp else 0
            if kind == 0:
                pred = 0
            elif kind == 1:
                pred = a
            elif kind == 2:
                pred = b
            elif kind == 3:
                pred = (a + b) // 2
            else:
                p = a + b - cc
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - cc)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else cc)
            line[i] = (x - pred) % 256
        out += bytes([kind]) + line
        prior = row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 16, 2 if c == 3 else 6, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(out)))
            + chunk(b"IEND", b""))


def test_16_bit_png_becomes_8_bit_rgb_with_exact_scaling(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 65536, (11, 13, 3), dtype=np.uint16)
    rgb[0, :4] = [[0, 0, 0], [255, 255, 255], [0x80FF, 0x80FF, 0x80FF], [65535, 65535, 65535]]  # rounding edges
    rgba = np.concatenate([rgb, np.full((11, 13, 1), 65535, np.uint16)], axis=2)
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "rgb16.png").write_bytes(png16(rgb))
    (tmp_path / "src" / "a" / "rgba16.png").write_bytes(png16(rgba))
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--val-fraction", "0", "--format", "png",
                "--min-side", "1"])
    expected = ((rgb.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)  # round(v * 255 / 65535)
    assert expected[0, :4, 0].tolist() == [0, 1, 128, 255]  # where PIL's high byte alone gives 0, 0, 128, 255
    got = {json.loads(s["json"])["source"]: s["png"] for s in samples(tmp_path / "out", "train")}
    for name in ("a/rgb16.png", "a/rgba16.png"):
        img = Image.open(io.BytesIO(got[name]))
        assert img.mode == "RGB" and img.info.get("bitdepth", 8) == 8 and got[name][24] == 8  # IHDR bit depth
        assert np.array_equal(np.asarray(img), expected), name


def test_failures_are_reproducible(tmp_path):
    rng = np.random.default_rng(0)
    make_tree(tmp_path / "src", {"a": 4, "b": 4})
    jpeg = image_bytes(rng, 64, 48)
    for name, data in {"random.jpg": rng.bytes(500), "truncated.jpg": jpeg[: len(jpeg) // 2], "empty.png": b"",
                       "text.webp": b"hello\n" * 30, "tiny.png": image_bytes(rng, 3, 3, "PNG")}.items():
        (tmp_path / "src" / "a" / name).write_bytes(data)
    (tmp_path / "src" / "b" / "wide.png").write_bytes(_wide_rgba_png())
    for out, workers in (("one", "1"), ("two", "2")):
        build_main([str(tmp_path / "src"), str(tmp_path / out), "--workers", workers, "--shard-size", "2",
                    "--format", "webp", "--max-side", "0"])
    first, second = ((tmp_path / o / "failures.jsonl").read_bytes() for o in ("one", "two"))
    assert first == second and b"0x" not in first and str(tmp_path).encode() not in first
    reasons = {f["source"]: f["reason"] for f in failures(tmp_path / "one")}
    assert reasons == {"a/random.jpg": "undecodable", "a/truncated.jpg": "truncated", "a/empty.png": "empty",
                       "a/text.webp": "undecodable", "a/tiny.png": "too_small", "b/wide.png": "unencodable"}


def test_a_build_of_which_every_input_failed_is_an_error_and_keeps_the_reasons(tmp_path):
    # An exit status of 0 over an empty dataset would let a script go on to pretrain on nothing.
    make_tree(tmp_path / "src", {"a": 3, "b": 2}, size=24)
    for _ in range(2):  # the second run finds the build complete, and says the same
        result = run(str(tmp_path / "src"), str(tmp_path / "out"), "--min-side", "100", "--workers", "1")
        line = assert_one_line(result)
        assert line == f"error: none of the 5 inputs could be written (too_small 5): the reason of each is in " \
                       f"{tmp_path / 'out'}/failures.jsonl", line
    assert len(failures(tmp_path / "out")) == 5 and "0 written" in run(str(tmp_path / "src"), str(tmp_path / "o2"),
                                                                         "--min-side", "100").stdout


def _wide_rgba_png() -> bytes:
    """Too wide for WebP (16383 pixels at most): decodes, but cannot be re-encoded as asked."""
    out = io.BytesIO()
    Image.new("RGBA", (17000, 8), (10, 20, 30, 128)).save(out, format="PNG")
    return out.getvalue()


def test_a_mistake_with_overwrite_leaves_out_as_it_was(tmp_path, capsys):
    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    for i in range(4):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(image_bytes(rng))
    good = tmp_path / "good.csv"
    good.write_text("path\n" + "".join(f"imgs/{i}.jpg\n" for i in range(4)))
    build_main([str(good), str(tmp_path / "out")])
    before = result_files(tmp_path / "out")
    bad = tmp_path / "bad.csv"
    bad.write_text("path\nimgs/0.jpg\n../elsewhere.jpg\n")
    assert "--allow-outside-paths" in one_line_error(capsys, str(bad), str(tmp_path / "out"), "--overwrite")
    assert "--part must be" in one_line_error(capsys, str(good), str(tmp_path / "out"), "--overwrite", "--part", "3")
    assert result_files(tmp_path / "out") == before  # a mistake is found before anything is deleted


def test_overwrite_deletes_only_the_builds_own_files(tmp_path):
    make_tree(tmp_path / "src", {"a": 4, "b": 4})
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "2"])
    (tmp_path / "out" / "my-backup.tar").write_bytes(b"mine")
    (tmp_path / "out" / "notes.txt").write_text("mine")
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "3", "--overwrite"])
    assert (tmp_path / "out" / "my-backup.tar").read_bytes() == b"mine"
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    shards = {p.name for p in (tmp_path / "out").glob("*-*.tar")} - {"my-backup.tar"}
    assert shards == {f for s in info["splits"].values() for f in s["filenames"]}  # the old layout's are gone


def test_hostile_values_of_the_other_commands_and_executors(tmp_path, capsys, monkeypatch):
    make_tree(tmp_path / "src", {"a": 3})
    build_main([str(tmp_path / "src"), str(tmp_path / "out")])
    capsys.readouterr()
    assert "--samples must be >= 0" in one_line_error(capsys, "inspect", str(tmp_path / "out"), "--samples", "-1")
    assert "unrecognized arguments" in one_line_error(capsys, "merge", str(tmp_path / "out"), "--part", "1")
    (tmp_path / "file").write_text("not a folder")
    assert "no build-shards journal" in one_line_error(capsys, "merge", str(tmp_path / "file"))
    (tmp_path / "out" / "_journal-part-00001-of-00002.jsonl").write_bytes(b"\x00garbage\n")
    assert "is not a build-shards journal" in one_line_error(capsys, "merge", str(tmp_path / "out"))
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    message = one_line_error(capsys, str(tmp_path / "src"), str(tmp_path / "ray_out"), "--executor", "ray")
    assert "pip install 'vit-mpp[ray]'" in message and not (tmp_path / "ray_out").exists()


# ---------------------------------------------------------------- a full disk


def test_a_full_disk_is_one_line_and_the_same_command_finishes_once_there_is_room(tmp_path, demo_folder):
    # A full disk was a traceback from a worker, with its half-written `.tar.tmp` files left in OUT.
    with small_disk(tmp_path / "disk", 100) as disk:  # room for a few shards
        args = [str(demo_folder), str(disk / "out"), "--shard-size", "16", "--val-fraction", "0.1667",
                "--min-side", "4", "--max-side", "0", "--format", "png", "--workers", "1"]
        full = run(*args)
        line = assert_one_line(full)
        assert f"{disk / 'out'}/" in line and "cannot be written: no space left on device" in line, line
        assert "MB needed" in line and "run the same command to go on" in line, line
        assert not list((disk / "out").glob("*.tmp")) and not (disk / "out" / "_info.json").exists()
        kept = {p.name: p.read_bytes() for p in (disk / "out").glob("*.tar")}
        assert kept  # the shards finished before the disk filled
        resize(disk, 4096)
        again = run(*args)
        assert again.returncode == 0, again.stderr
        assert "resuming" in again.stdout and (disk / "out" / "_info.json").is_file()
        assert all((disk / "out" / name).read_bytes() == data for name, data in kept.items())


def test_a_range_published_while_another_fails_is_journaled_and_not_written_again(tmp_path, capsys, monkeypatch):
    # CI caught it: range 0's shard was still being published (synced, renamed) when range 1 hit the full disk; the
    # error ended the build before range 0 was journaled, so its finished shard was written again on resume.
    import errno

    from data_tools.builder import shard_ranges
    from data_tools.store import LocalStore

    make_tree(tmp_path / "src", {"a": 8})
    argv = [str(tmp_path / "src"), str(tmp_path / "out"), "--shard-size", "4", "--val-fraction", "0",
            "--workers", "1"]
    real_write, real_publish = shard_ranges._write_range, LocalStore.publish

    def fails_after_the_first(task, *args):
        if task.index > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(task, *args)

    def slow_publish(self, tmp, name):
        time.sleep(1.0)  # the failure reaches the main process while this shard is being published
        real_publish(self, tmp, name)

    monkeypatch.setattr(shard_ranges, "_write_range", fails_after_the_first)  # the forked worker inherits it
    monkeypatch.setattr(LocalStore, "publish", slow_publish)
    assert "no space left on device" in one_line_error(capsys, *argv)
    journal = (tmp_path / "out" / "_journal.jsonl").read_text().splitlines()
    assert [json.loads(x)["range"] for x in journal[1:]] == [0]
    monkeypatch.undo()
    build_main(argv)
    assert "resuming: 4 of 8 inputs are in 1 finished ranges" in capsys.readouterr().out
