"""build-shards: every source kind, corrupt inputs skipped and reported, kill -9 then resume, byte-reproducible
builds whatever the worker count, and shards that webdataset, timm and HF datasets all read."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_tools import scratch
from data_tools.builder import shard_ranges
from data_tools.builder.shard_layout import split_ranges
from data_tools.cli import main as build_main
from tests.helpers.build import make_tree, samples
from tests.helpers.processes import REPO, run_module, subprocess_env
from tests.helpers.shards import image_bytes


def build(src, out, *args: str) -> dict:
    build_main([str(src), str(out), "--workers", "2", *args])
    return json.loads((Path(out) / "_info.json").read_text())


def all_samples(out: Path) -> list[dict]:
    info = json.loads((out / "_info.json").read_text())
    return [x for split in info["splits"] for x in samples(out, split)]


def failures(out: Path) -> dict[str, str]:
    return {r["source"]: r["reason"] for r in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))}


# ---------------------------------------------------------------- sources

def test_unlabelled_folder_is_recursive_without_cls(tmp_path):
    files = make_tree(tmp_path / "src", {"a": 3, "a/deeper": 2, "b/c/d": 4})
    info = build(tmp_path / "src", tmp_path / "out", "--source-kind", "unlabelled", "--val-fraction", "0")
    got = samples(tmp_path / "out", "train")
    assert info["num_classes"] == 0 and info["source"]["kind"] == "unlabelled"
    assert sorted(json.loads(s["json"])["source"] for s in got) == sorted(files)
    assert all("cls" not in s and json.loads(s["json"])["label"] == -1 for s in got)
    assert all(s["jpg"] == files[json.loads(s["json"])["source"]] for s in got)


def test_existing_split_folders(tmp_path):
    make_tree(tmp_path / "src", {"train/cat": 5, "train/dog": 4, "val/cat": 2, "val/dog": 3, "val/emu": 1})
    info = build(tmp_path / "src", tmp_path / "out", "--existing-splits")
    assert info["class_names"] == ["cat", "dog", "emu"]
    assert {k: v["num_samples"] for k, v in info["splits"].items()} == {"train": 9, "val": 6}
    for split in ("train", "val"):
        for s in samples(tmp_path / "out", split):
            source = json.loads(s["json"])["source"]
            assert source.startswith(f"{split}/") and source.split("/")[1] == info["class_names"][int(s["cls"])]


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_path_list_with_labels_and_splits(tmp_path, fmt):
    files = make_tree(tmp_path / "imgs", {"x": 6})
    rows = [{"path": f"imgs/{p}", "label": ["zebra", "ant"][i % 2], "split": ["train", "test"][i % 3 == 0]}
            for i, p in enumerate(sorted(files))]
    lst = tmp_path / f"list.{fmt}"
    if fmt == "csv":
        lst.write_text("path,label,split\n" + "".join(f"{r['path']},{r['label']},{r['split']}\n" for r in rows))
    elif fmt == "jsonl":
        lst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), lst)
    info = build(lst, tmp_path / "out", "--existing-splits")
    assert info["source"]["kind"] == "list" and info["class_names"] == ["ant", "zebra"]
    assert {k: v["num_samples"] for k, v in info["splits"].items()} == {"test": 2, "train": 4}
    expected = {r["path"]: (r["label"], r["split"]) for r in rows}
    for split in ("train", "test"):
        for s in samples(tmp_path / "out", split):
            source = json.loads(s["json"])["source"]
            assert expected[source] == (info["class_names"][int(s["cls"])], split)
            assert s["jpg"] == (tmp_path / source).read_bytes()


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep the Arrow caches that `datasets.load_dataset` writes inside the test's folder."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def hf_dataset(files: dict[str, bytes]):
    import datasets

    names = sorted({p.split("/")[0] for p in files})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in files.values()],
         "label": [names.index(p.split("/")[0]) for p in files]}, features=features)


def check_original_bytes(out: Path, files: dict[str, bytes], split: str = "train") -> None:
    """Every sample's image is one of the originals, byte for byte, with the label of its class."""
    by_bytes = {b: p.split("/")[0] for p, b in files.items()}
    info = json.loads((out / "_info.json").read_text())
    got = samples(out, split)
    assert len(got) == info["splits"][split]["num_samples"] > 0
    for s in got:
        assert by_bytes[s["jpg"]] == info["class_names"][int(s["cls"])]


def test_hf_save_to_disk_keeps_original_bytes(tmp_path, hf_cache):
    import datasets

    files = make_tree(tmp_path / "src", {"cat": 4, "dog": 5})
    ds = hf_dataset(files)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "hf"))
    info = build(tmp_path / "hf", tmp_path / "out", "--existing-splits")
    assert info["source"]["loader"] == "save_to_disk" and info["class_names"] == ["cat", "dog"]
    assert {k: v["num_samples"] for k, v in info["splits"].items()} == {"train": 9, "test": 3}
    check_original_bytes(tmp_path / "out", files, "train")
    check_original_bytes(tmp_path / "out", files, "test")


def test_hf_parquet_with_val_fraction(tmp_path, hf_cache):
    files = make_tree(tmp_path / "src", {"cat": 6, "dog": 4})
    hf_dataset(files).to_parquet(str(tmp_path / "data.parquet"))
    info = build(tmp_path / "data.parquet", tmp_path / "out", "--val-fraction", "0.2")
    assert info["source"]["loader"] == "parquet"
    assert {k: v["num_samples"] for k, v in info["splits"].items()} == {"train": 8, "val": 2}
    check_original_bytes(tmp_path / "out", files, "train")


def test_hf_imagefolder(tmp_path, hf_cache):
    files = make_tree(tmp_path / "src", {"cat": 3, "dog": 3})
    info = build(tmp_path / "src", tmp_path / "out", "--source-kind", "hf", "--val-fraction", "0")
    assert info["source"]["loader"] == "imagefolder" and info["class_names"] == ["cat", "dog"]
    check_original_bytes(tmp_path / "out", files)


def test_hub_name_without_network_is_one_line_error(tmp_path):
    env = {**subprocess_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "data_tools.cli", "someone/no-such-dataset",
                             str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: could not load Hugging Face dataset 'someone/no-such-dataset'")
    result = run_module("data_tools.cli", str(tmp_path / "missing" / "folder"), str(tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.strip() == f"error: source not found: {tmp_path}/missing/folder"


# ---------------------------------------------------------------- image handling

def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


BOMB = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
        + png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + png_chunk(b"IEND", b""))


def test_corrupt_inputs_are_skipped_and_reported(tmp_path):
    rng = np.random.default_rng(1)
    good = make_tree(tmp_path / "src", {"a": 5, "b": 5})
    jpeg, png = image_bytes(rng, 64, 48), image_bytes(rng, 64, 48, "PNG")
    bad = {
        "a/empty.jpg": (b"", "empty"),
        "a/truncated.jpg": (jpeg[: len(jpeg) // 2], "truncated"),
        "a/random.jpg": (rng.bytes(2000), "undecodable"),
        "a/text.jpg": (b"this is a text file, not an image\n" * 20, "undecodable"),
        "b/tiny.png": (image_bytes(rng, 4, 4, "PNG"), "too_small"),
        "b/bomb.png": (BOMB, "decompression_bomb"),
        "b/header_only.png": (b"\x89PNG\r\n\x1a\n", "undecodable"),
        "b/garbage_header.gif": (b"GIF89a" + rng.bytes(300), "undecodable"),
        "b/truncated.png": (png[: len(png) // 2], "truncated"),
        "b/jpeg_marker_only.jpg": (b"\xff\xd8\xff\xe0" + rng.bytes(50), "undecodable"),
    }
    for rel, (data, _) in bad.items():
        (tmp_path / "src" / rel).write_bytes(data)
    info = build(tmp_path / "src", tmp_path / "out", "--val-fraction", "0.2", "--shard-size", "4")
    assert failures(tmp_path / "out") == {rel: reason for rel, (_, reason) in bad.items()}
    assert info["num_failures"] == len(bad) and sum(info["failure_reasons"].values()) == len(bad)
    got = all_samples(tmp_path / "out")
    assert sorted(json.loads(s["json"])["source"] for s in got) == sorted(good)
    assert all(s["jpg"] == good[json.loads(s["json"])["source"]] for s in got)


def test_modes_become_rgb_and_big_images_are_resized(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    Image.new("RGBA", (20, 10), (255, 0, 0, 0)).save(src / "transparent.png")  # alpha 0 -> white
    Image.new("LA", (20, 10), (0, 255)).save(src / "la.png")
    Image.new("CMYK", (20, 10), (0, 255, 255, 0)).save(src / "cmyk.jpg")  # red in CMYK
    Image.new("RGB", (20, 10), (0, 0, 255)).convert("P").save(src / "palette.png")
    Image.fromarray(np.full((10, 20), 65535, dtype=np.uint16)).save(src / "sixteen.png")  # 16-bit white
    rotated = Image.new("RGB", (20, 10), (0, 200, 0))
    exif = rotated.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    rotated.save(src / "rotated.jpg", exif=exif)
    Image.new("RGB", (300, 100), (10, 200, 30)).save(src / "wide.png")
    build(tmp_path / "src", tmp_path / "out", "--val-fraction", "0", "--max-side", "64")
    got = {json.loads(s["json"])["source"]: s for s in samples(tmp_path / "out", "train")}
    decoded = {k: Image.open(io.BytesIO(s["jpg"])) for k, s in got.items()}
    assert all(img.mode == "RGB" and img.format == "JPEG" for img in decoded.values())
    center = {k: np.asarray(img)[img.height // 2, img.width // 2].astype(int) for k, img in decoded.items()}
    assert (center["a/transparent.png"] > 240).all() and (center["a/sixteen.png"] > 240).all()
    assert center["a/cmyk.jpg"][0] > 200 and center["a/cmyk.jpg"][1:].max() < 60
    assert center["a/palette.png"][2] > 200 and center["a/la.png"].max() < 20
    assert decoded["a/rotated.jpg"].size == (10, 20)
    assert decoded["a/wide.png"].size == (64, 21)
    build(tmp_path / "src", tmp_path / "short", "--val-fraction", "0", "--max-side", "50", "--resize-side",
          "shorter", "--format", "webp")
    wide = next(s for s in samples(tmp_path / "short", "train") if json.loads(s["json"])["source"] == "a/wide.png")
    assert Image.open(io.BytesIO(wide["webp"])).size == (150, 50)


# ---------------------------------------------------------------- layout, reproducibility, resume

def test_balanced_shards_and_byte_limit(tmp_path):
    make_tree(tmp_path / "src", {"a": 25})
    info = build(tmp_path / "src", tmp_path / "out", "--val-fraction", "0", "--shard-size", "10")
    assert info["splits"]["train"]["shard_lengths"] == [9, 8, 8]
    assert info["splits"]["train"]["filenames"] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    per_sample = max(info["splits"]["train"]["shard_bytes"]) / 9
    info = build(tmp_path / "src", tmp_path / "bytes", "--val-fraction", "0", "--shard-bytes",
                 str(int(per_sample * 4)))
    split = info["splits"]["train"]
    assert sum(split["shard_lengths"]) == 25 and len(split["filenames"]) >= 5
    assert max(split["shard_bytes"]) <= per_sample * 4 + 2 * per_sample + 10240


def test_ranges_are_balanced_and_fixed_before_reading():
    assert split_ranges(2500, 1000) == [(0, 834), (834, 1667), (1667, 2500)]
    assert split_ranges(7, 0) == [(0, 7)] and split_ranges(0, 10) == []
    assert split_ranges(25_000, 0) == [(0, 8334), (8334, 16667), (16667, 25000)]  # bytes-only: 10000 at most


def test_a_torn_journal_line_is_ignored_and_its_range_written_again(tmp_path):
    # A range and all its --shard-bytes pieces are one journal line: a kill mid-write leaves a torn last line,
    # which the resume ignores (the range is written again), never half a range.
    make_tree(tmp_path / "src", {"a": 30})
    args = ["--val-fraction", "0", "--shard-size", "10", "--shard-bytes", "3000"]
    build(tmp_path / "src", tmp_path / "clean", *args)
    build(tmp_path / "src", tmp_path / "out", *args)
    journal = tmp_path / "out" / "_journal.jsonl"
    lines = journal.read_text().splitlines()
    assert len(lines) == 4 and all(len(json.loads(x).get("shards", [1, 1])) > 1 for x in lines)  # pieces per range
    journal.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    (tmp_path / "out" / "_info.json").unlink()
    result = run_module("data_tools.cli", str(tmp_path / "src"), str(tmp_path / "out"), *args)
    assert result.returncode == 0 and "resuming: 20 of 30" in result.stdout, result.stdout + result.stderr
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "clean")


def test_same_seed_same_bytes_whatever_the_workers(tmp_path):
    make_tree(tmp_path / "src", {"a": 12, "b": 12}, size=40)
    runs = {}
    for name, workers, seed in [("w1", "1", "3"), ("w2", "2", "3"), ("other_seed", "2", "4")]:
        build_main([str(tmp_path / "src"), str(tmp_path / name), "--workers", workers, "--seed", seed,
                    "--shard-size", "5", "--max-side", "32"])  # 40 > 32: every image is re-encoded
        runs[name] = shard_bytes(tmp_path / name)
    assert runs["w1"] == runs["w2"]
    assert runs["w1"] != runs["other_seed"]
    info1, info2 = (json.loads((tmp_path / n / "_info.json").read_text()) for n in ("w1", "w2"))
    assert info1["splits"] == info2["splits"]


def test_rerun_is_a_noop_other_settings_need_overwrite(tmp_path):
    make_tree(tmp_path / "src", {"a": 6})
    build(tmp_path / "src", tmp_path / "out")
    before = shard_bytes(tmp_path / "out")
    result = run_module("data_tools.cli", str(tmp_path / "src"), str(tmp_path / "out"))
    assert result.returncode == 0 and "already complete" in result.stdout
    result = run_module("data_tools.cli", str(tmp_path / "src"), str(tmp_path / "out"), "--seed", "1")
    assert result.returncode == 2 and "--overwrite" in result.stderr
    build(tmp_path / "src", tmp_path / "out", "--seed", "1", "--overwrite")
    assert shard_bytes(tmp_path / "out") != before


@pytest.mark.parametrize("limits", [["--shard-size", "8"], ["--shard-size", "8", "--shard-bytes", "6000"]],
                         ids=["count", "count_and_bytes"])
def test_kill_9_at_a_random_moment_then_rerun_finishes_the_build(tmp_path, limits):
    seed = int(time.time())  # a different moment each run; printed on failure to replay it
    rng = np.random.default_rng(seed)
    files = make_tree(tmp_path / "src", {"a": 200, "b": 200}, size=64)
    (tmp_path / "src" / "a" / "broken.jpg").write_bytes(b"not an image")
    args = [str(tmp_path / "src"), str(tmp_path / "out"), *limits, "--max-side", "40", "--workers", "2"]
    journal = tmp_path / "out" / "_journal.jsonl"
    env = {**subprocess_env(), "TMPDIR": str(tmp_path / "tmp")}  # to see the scratch folders killed builds leave
    (tmp_path / "tmp").mkdir()
    target = 1  # journal lines (header + one per range); the build writes 50 ranges
    for _ in range(2):  # two interruptions, each at a random shard and a random moment within it
        target += int(rng.integers(2, 16))
        proc = subprocess.Popen([sys.executable, "-m", "data_tools.cli", *args], env=env,
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline and (
                not journal.exists() or len(journal.read_text().splitlines()) < target):
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.02))
        proc.kill()  # SIGKILL (nothing, if the build already ended: the assertion below says so)
        proc.wait()
    assert not (tmp_path / "out" / "_info.json").exists(), f"the build finished before it was interrupted (seed {seed})"
    assert len(list((tmp_path / "tmp").iterdir())) == 1  # a killed build's catalog is left behind (the second build
    # removed the first's) ...
    result = subprocess.run([sys.executable, "-m", "data_tools.cli", *args], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "resuming" in result.stdout, f"seed {seed}: {result.stderr}"
    assert "removed 1 scratch folder(s) of killed builds" in result.stdout  # ... and removed by the next build
    assert list((tmp_path / "tmp").iterdir()) == []
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert failures(tmp_path / "out") == {"a/broken.jpg": "undecodable"}
    got = all_samples(tmp_path / "out")
    keys = [s["__key__"] for s in got]
    assert len(keys) == len(set(keys)) == len(files) == sum(v["num_samples"] for v in info["splits"].values())
    assert sorted(json.loads(s["json"])["source"] for s in got) == sorted(files)
    assert not list((tmp_path / "out").glob("*.tmp"))
    build_main([*args[:1], str(tmp_path / "clean"), *args[2:]])  # an uninterrupted build: the very same bytes
    assert shard_bytes(tmp_path / "clean") == shard_bytes(tmp_path / "out")


def test_a_worker_that_dies_stops_the_build_with_an_error_instead_of_a_hang(tmp_path, monkeypatch, capsys):
    # A decoder crash or the OOM killer takes a worker down mid-range; multiprocessing.Pool would wait forever.
    files = make_tree(tmp_path / "src", {"a": 30, "b": 30})
    fatal = files["b/img007.jpg"]
    real_prepare = shard_ranges.prepare_image

    def prepare_or_die(data, settings):
        if data == fatal:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_prepare(data, settings)

    monkeypatch.setattr(shard_ranges, "prepare_image", prepare_or_die)  # forked workers inherit it
    args = [str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "2", "--shard-size", "5"]
    def hung(*_):
        raise TimeoutError("the build hung after its worker died")

    previous = signal.signal(signal.SIGALRM, hung)  # a hang fails this test instead of blocking the suite
    signal.alarm(120)
    try:
        with pytest.raises(SystemExit) as exit_info:
            build_main(args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: a worker process died") and "re-run the same command" in err
    assert not (tmp_path / "out" / "_info.json").exists()

    monkeypatch.setattr(shard_ranges, "prepare_image", real_prepare)  # the cause is gone: the re-run finishes
    build_main(args)
    assert sorted(json.loads(s["json"])["source"] for s in all_samples(tmp_path / "out")) == sorted(files)


# ---------------------------------------------------------------- readers and inspect

def test_timm_and_hf_datasets_read_our_shards(demo_shards, tmp_path):
    import datasets
    from timm.data import create_dataset

    info = json.loads((demo_shards / "_info.json").read_text())
    ds = create_dataset("wds/demo", root=str(demo_shards), split="train", is_training=False)
    got = list(ds)
    assert len(got) == info["splits"]["train"]["num_samples"]
    assert all(isinstance(img, Image.Image) and 0 <= target < info["num_classes"] for img, target in got)
    files = [str(demo_shards / f) for f in info["splits"]["val"]["filenames"]]
    hf = datasets.load_dataset("webdataset", data_files={"val": files}, split="val", cache_dir=str(tmp_path))
    assert len(hf) == info["splits"]["val"]["num_samples"]
    assert sorted(int(c) for c in hf["cls"]) == sorted(int(s["cls"]) for s in samples(demo_shards, "val"))


def test_inspect_verifies_and_draws_a_grid(tmp_path):
    make_tree(tmp_path / "src", {"a": 5, "b": 5})
    build(tmp_path / "src", tmp_path / "out", "--shard-size", "3")
    result = run_module("data_tools.cli", "inspect", str(tmp_path / "out"), "--grid", str(tmp_path / "g.png"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified" in result.stdout and Image.open(tmp_path / "g.png").width > 0
    shard = tmp_path / "out" / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF  # flip a byte inside the first sample's image
    shard.write_bytes(bytes(data))
    result = run_module("data_tools.cli", "inspect", str(tmp_path / "out"), "--grid", str(tmp_path / "g.png"))
    assert result.returncode == 1 and "sha256" in result.stdout


def test_only_the_scratch_folders_of_builds_no_longer_running_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = "from data_tools.scratch import make_scratch; import sys, time; print(make_scratch('work'), flush=True); "
    env = {**subprocess_env(), "TMPDIR": str(tmp_path)}
    dead = subprocess.run([sys.executable, "-c", code + "sys.exit(0)"], env=env, cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()  # exits without removing its folder, as if killed
    running = subprocess.Popen([sys.executable, "-c", code + "time.sleep(60)"], env=env, cwd=REPO, text=True,
                               stdout=subprocess.PIPE)
    try:
        alive = running.stdout.readline().strip()
        (Path(dead) / "catalog_ids.bin").write_bytes(b"x" * 1000)
        older = tmp_path / "build-shards-abc123"  # an older version's folder, without a lock file: left alone
        older.mkdir()
        with scratch.scratch("work") as mine:
            assert scratch.sweep_stale() == (1, 1000)
            assert not Path(dead).exists() and Path(alive).is_dir() and older.is_dir() and mine.is_dir()
        assert not mine.exists()
    finally:
        running.kill()
        running.wait()
    assert scratch.sweep_stale() == (1, 0) and not Path(alive).exists()  # its process is gone now


def test_build_shards_does_not_import_torch():
    # torch is 2 s of start-up and 600 MB a process: every worker forked from a main process holding it took
    # 10 ms to fork and as long to join, on every build. build-shards needs none of it.
    code = ("import sys, data_tools.cli, data_tools.builder.build_shards, data_tools.indexer.index_tars, "
            "data_tools.inspect_shards; "
            "print(sorted(m for m in ('torch', 'timm', 'safetensors') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
