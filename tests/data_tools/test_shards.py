"""build-shards: every image comes back, with its label, readable by plain webdataset."""

from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from data_tools.builder.writer import ShardWriter
from tests.helpers.build import samples as read_all


def test_round_trip_every_image_with_its_label(demo_folder, demo_shards):
    info = json.loads((demo_shards / "_info.json").read_text())
    classes = info["class_names"]
    assert classes == sorted(p.name for p in demo_folder.iterdir())
    samples = read_all(demo_shards, "train") + read_all(demo_shards, "val")
    sources = {}
    for s in samples:
        assert "." not in s["__key__"]
        meta = json.loads(s["json"])
        label = int(s["cls"])
        assert meta["label"] == label
        original = demo_folder / meta["source"]
        assert original.parent.name == classes[label]  # the label is the image's class folder
        assert s["jpg"] == original.read_bytes()  # small valid JPEGs are stored as they were, not re-encoded
        sources[meta["source"]] = label
    expected = {str(p.relative_to(demo_folder)) for p in demo_folder.rglob("*.jpg")}
    assert set(sources) == expected and len(samples) == len(expected)  # each image exactly once
    for split in ("train", "val"):
        entry = info["splits"][split]
        assert entry["num_samples"] == len(read_all(demo_shards, split)) == sum(entry["shard_lengths"])
        assert len(entry["filenames"]) == len(entry["shard_sha256"]) == len(entry["shard_bytes"])


def test_large_images_are_resized_and_broken_ones_reported(tmp_path):
    from data_tools.cli import main

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    Image.new("RGB", (300, 100), (10, 200, 30)).save(src / "a" / "big.png")
    (src / "a" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    out = tmp_path / "out"
    main([str(src), str(out), "--val-fraction", "0", "--max-side", "64"])
    (sample,) = read_all(out, "train")
    img = Image.open(io.BytesIO(sample["jpg"]))
    assert img.size == (64, 21) and img.format == "JPEG"
    (failure,) = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert failure["source"] == "a/broken.jpg" and "undecodable" in failure["reason"]


def _tarfile_reference(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    """What the writer wrote with the standard library before it wrote tars itself: the bytes it must still write."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "", ""
                tar.addfile(info, io.BytesIO(data))


def test_shard_writer_writes_what_tarfile_writes(tmp_path):
    rng = random.Random(0)
    sizes = [0, 1, 511, 512, 513, 10_239, 10_240, 70_000]  # around block and record boundaries
    samples = [(f"train_{i:09d}", {"jpg": rng.randbytes(n), "cls": str(i % 7).encode(), "json": b"{}"})
               for i, n in enumerate(sizes)]
    for count in (0, 1, len(samples)):  # an empty archive, one sample, all
        writer = ShardWriter(tmp_path / f"ours{count}.tar")
        for key, files in samples[:count]:
            writer.write(key, files)
        n, size, digest = writer.close()
        _tarfile_reference(tmp_path / f"ref{count}.tar", samples[:count])
        ours, ref = (tmp_path / f"ours{count}.tar").read_bytes(), (tmp_path / f"ref{count}.tar").read_bytes()
        assert ours == ref and (n, size, digest) == (count, len(ref), hashlib.sha256(ref).hexdigest())
    with tarfile.open(tmp_path / f"ours{len(samples)}.tar") as tar:
        assert [m.name for m in tar.getmembers()][:3] == ["train_000000000.jpg", "train_000000000.cls",
                                                          "train_000000000.json"]
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        ShardWriter(tmp_path / "long.tar").write("k" * 100, {"jpg": b""})
