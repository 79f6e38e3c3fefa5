"""predict: every image format build-shards reads (one list of extensions, vit_mpp/data/image_formats.py); with images
it cannot read, the unreadable are skipped with a warning and the others labelled; none readable is one line
`error: ...`, exit 2, and no CSV (not a CSV holding only its header, with exit 0)."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from finetune import predict as predict_module
from tests.helpers.disks import small_disk
from tests.helpers.models import SMALL_MODEL
from tests.helpers.processes import REPO, ctrl_c_enabled, in_process, subprocess_env
from vit_mpp.data.image_formats import IMAGE_SUFFIXES
from vit_mpp.models.export import Export, write_export
from vit_mpp.models.vit import create_vit


def test_predict_labels_a_bmp_and_a_tiff_as_build_shards_reads_them(tmp_path):
    # predict once kept its own list (jpg, jpeg, png, webp) and skipped .bmp/.tif files that build-shards accepts.
    torch.manual_seed(0)
    model = create_vit(SMALL_MODEL, num_classes=3)
    export = write_export(Export(tmp_path / "export", model.state_dict(), SMALL_MODEL, num_classes=3, mean=(0.5,) * 3,
                                 std=(0.5,) * 3, class_names=["a", "b", "c"]), kind="classifier")
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name in ("photo.bmp", "scan.TIF", "shot.png"):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(images / name)
    (images / "notes.txt").write_text("not an image")
    assert {".bmp", ".tif", ".png"} <= IMAGE_SUFFIXES
    out = tmp_path / "preds.csv"
    predict_module.main(["--checkpoint", str(export), "--images", str(images), "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert sorted(r["path"] for r in rows) == sorted(str(images / n) for n in ("photo.bmp", "scan.TIF", "shot.png"))
    assert all(r["class_name"] in ("a", "b", "c") for r in rows)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    torch.manual_seed(0)
    cfg = SMALL_MODEL
    return write_export(Export(tmp_path_factory.mktemp("export"), create_vit(cfg, 3).state_dict(), cfg, num_classes=3,
                               mean=(0.5,) * 3, std=(0.5,) * 3, class_names=["a", "b", "c"]), kind="classifier")


def predict(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune.predict", *args], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(), cwd=REPO)


def test_one_corrupt_image_is_one_error_line_and_no_csv(export, tmp_path):
    bad = tmp_path / "photo.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    out = tmp_path / "preds.csv"
    result = predict("--checkpoint", str(export), "--images", str(bad), "--out", str(out))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: none of the 1 image(s) could be read, so nothing was labelled ({bad}: ")
    assert not out.exists() and result.stdout == ""
    to_stdout = predict("--checkpoint", str(export), "--images", str(bad))
    assert to_stdout.returncode == 2 and to_stdout.stdout == ""  # not even the header


def test_the_readable_ones_are_written_and_the_others_reported(export, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "a_bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # first in order: held, then reported
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(images / "b_good.png")
    (images / "c_bad.jpg").write_bytes(b"garbage")
    out = tmp_path / "preds.csv"
    result = predict("--checkpoint", str(export), "--images", str(images), "--out", str(out), "--batch-size", "1")
    assert result.returncode == 0, result.stderr
    assert [r["path"] for r in csv.DictReader(out.open())] == [str(images / "b_good.png")]
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("warning: skipped")]
    assert [w.split(":")[1].strip().split(" ")[-1] for w in warnings] == [str(images / "a_bad.png"),
                                                                          str(images / "c_bad.jpg")]
    assert result.stderr.strip().splitlines()[-1] == f"labelled 1 of 3 images -> {out}"


@pytest.mark.parametrize("extra, message", [
    (["--out", "{tmp}"], "error: --out {tmp} is a folder: give a file name"),
    (["--out", "{tmp}/file.txt/preds.csv"], "error: --out {tmp}/file.txt/preds.csv: {tmp}/file.txt is a file, not a "
                                            "folder"),
    (["--device", "banana"], "error: --device banana: not a device (cpu, cuda, cuda:N, mps)"),
    # the CSV was written over the image (exit 0)
    (["--out", "{tmp}/a.png"], "error: --out {tmp}/a.png is one of the images to label: the CSV would overwrite it"),
], ids=["out is a folder", "out under a file", "no such device", "out is an input"])
def test_a_bad_out_or_device_is_one_line_before_any_image_is_read(export, tmp_path, capsys, extra, message):
    # These were tracebacks (IsADirectoryError, NotADirectoryError, RuntimeError), the first two after labelling.
    (tmp_path / "file.txt").write_text("x")
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(image)
    extra = [a.format(tmp=tmp_path) for a in extra]
    code, out, err = in_process(predict_module.main, ["--checkpoint", str(export), "--images", str(image), *extra],
                                capsys)
    assert code == 2 and err.strip() == message.format(tmp=tmp_path) and out == "", err
    assert Image.open(image).size == (20, 20)


def test_an_out_among_the_export_it_labels_with_is_one_line_and_the_export_still_loads(export, tmp_path, capsys):
    # --out EXPORT/config.json wrote the CSV over the export's config (exit 0): the model no longer loaded
    model = shutil.copytree(export, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(image)
    code, out, err = in_process(predict_module.main, ["--checkpoint", str(model), "--images", str(image), "--out",
                                                      str(model / "config.json")], capsys)
    assert code == 2 and err.strip() == f"error: --out {model / 'config.json'} is inside an export: give a file of " \
        "its own" and out == "", err
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before
    assert in_process(predict_module.main, ["--checkpoint", str(model), "--images", str(image), "--out",
                                            str(tmp_path / "preds.csv")], capsys)[0] == 0
    # through a link: an output is written through it, so its target is held to the same rule
    link = tmp_path / "latest.csv"
    link.symlink_to(model / "config.json")
    code, out, err = in_process(predict_module.main, ["--checkpoint", str(model), "--images", str(image), "--out",
                                                      str(link)], capsys)
    assert code == 2 and err.strip() == f"error: --out {link} (a link to {(model / 'config.json').resolve()}) is " \
        "inside an export: give a file of its own", err
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before and link.is_symlink()


@pytest.mark.parametrize("name, message", [
    ("nowhere.png", "no such image or folder: {p}"),
    ("fifo", "{p} is neither an image file nor a folder"),  # said "no such image or folder", though it is there
])
def test_an_images_argument_that_is_no_file_or_folder_is_one_line(export, tmp_path, capsys, name, message):
    path = tmp_path / name
    if name == "fifo":
        os.mkfifo(path)
    code, out, err = in_process(predict_module.main, ["--checkpoint", str(export), "--images", str(path)], capsys)
    assert code == 2 and err.strip() == "error: " + message.format(p=path) and out == ""


def test_top_k_above_the_classes_gives_a_column_per_class(export, tmp_path, capsys):
    # the header named --top-k classes while each row held one per class: a CSV whose rows are shorter than its header
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "preds.csv"
    predict_module.main(["--checkpoint", str(export), "--images", str(image), "--out", str(out), "--top-k", "1000"])
    rows = list(csv.reader(out.open()))
    num_classes = (len(rows[1]) - 1) // 3
    assert len(rows) == 2 and len(rows[0]) == len(rows[1]) and 1 < num_classes < 1000
    assert rows[0][-3:] == [f"class_index_{num_classes}", f"class_name_{num_classes}", f"prob_{num_classes}"]


def test_out_in_a_folder_that_does_not_exist_yet_is_created(export, tmp_path):
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "new" / "deeper" / "preds.csv"
    predict_module.main(["--checkpoint", str(export), "--images", str(image), "--out", str(out)])
    assert [r["path"] for r in csv.DictReader(out.open())] == [str(image)]


def test_a_full_disk_as_predict_writes_is_one_line_and_the_old_csv_is_kept_whole(export, tmp_path):
    """A real full disk (a small tmpfs) under the real command: the rows were streamed into --out, so a full disk
    was a traceback and left a cut CSV where the old one had been; now they go under a temporary name, renamed over
    --out only when the last row is written."""
    images = tmp_path / "images"
    images.mkdir()
    for i in range(120):
        Image.fromarray(np.full((20, 20, 3), i, dtype=np.uint8)).save(images / f"image_with_a_long_name_{i:04d}.png")
    with small_disk(tmp_path / "disk", 64) as disk:
        out = disk / "preds.csv"
        first = predict("--checkpoint", str(export), "--images", str(images / "image_with_a_long_name_0000.png"),
                        "--out", str(out))
        assert first.returncode == 0, first.stderr
        before = out.read_bytes()
        (disk / "filler").write_bytes(b"x" * (64 - 12) * 1024)  # 8 KiB left; the CSV of 120 images needs ~19
        result = predict("--checkpoint", str(export), "--images", str(images), "--out", str(out), "--top-k", "3")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
        assert lines[0].startswith(f"error: --out {out} cannot be written: no space left on device"), lines
        assert out.read_bytes() == before and sorted(p.name for p in disk.iterdir()) == ["filler", "preds.csv"]


def test_an_out_that_is_a_pipe_or_a_device_is_written_straight_into(export, tmp_path):
    """--out /dev/stdout: written into, not replaced by a file of that name (outputs are written under a temporary
    name and renamed over the old file, which a device or a link to one must not be)."""
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8)).save(image)
    result = predict("--checkpoint", str(export), "--images", str(image), "--out", "/dev/stdout")
    assert result.returncode == 0, result.stderr
    assert [r["path"] for r in csv.DictReader(result.stdout.splitlines())] == [str(image)]
    assert os.path.islink("/dev/stdout") or not os.path.isfile("/dev/stdout")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_predict_writes_is_one_line_leaving_the_old_csv_and_no_temporary_file(export, tmp_path, sig):
    """`timeout`, a scheduler or a closed terminal stopping predict mid-way: the rows go to `preds.csv.tmp`, which
    SIGTERM's default action left behind; now the signal ends the command through its clean-up, with one line and
    the status the signal gives (128 + 15), the old CSV as it was. Ctrl-C was a KeyboardInterrupt traceback from
    wherever predict stood (an image decoder); now `run_main`'s line and 130."""
    images = tmp_path / "images"
    images.mkdir()
    noise = np.random.default_rng(0).integers(0, 256, (384, 384, 3), dtype=np.uint8)
    Image.fromarray(noise).save(images / "i0000.png")
    for i in range(1, 600):  # ~8 ms each at batch 1: seconds of labelling after the temporary file appears
        os.link(images / "i0000.png", images / f"i{i:04d}.png")
    out = tmp_path / "preds.csv"
    out.write_text("the old predictions\n")
    child = subprocess.Popen([sys.executable, "-m", "finetune.predict", "--checkpoint", str(export), "--images",
                              str(images), "--out", str(out), "--batch-size", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO,
                             preexec_fn=ctrl_c_enabled)
    tmp = tmp_path / "preds.csv.tmp"
    deadline = time.monotonic() + 120
    while not tmp.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tmp.exists(), "predict never opened its temporary file"
    child.send_signal(sig)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 128 + sig, stderr[-3000:]
    if sig == signal.SIGTERM:
        assert stdout.strip() == f"stopped (SIGTERM): {out} was not written; run the same command again", stdout
    else:
        assert stdout == "" and stderr.strip().splitlines()[-1:] == ["error: interrupted; run the same command again"]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "preds.csv"]
    assert out.read_text() == "the old predictions\n"
