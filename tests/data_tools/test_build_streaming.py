"""build-shards --streaming: a Hugging Face dataset read from its parquet files where they are (here local files
with small row groups, as the Hub serves them), in an order fixed by the files and the seed; nothing is converted
to a local Arrow copy; the same bytes with any number of workers or parts."""

from __future__ import annotations

import json
import random

import pytest

from data_tools.cli import main as build_main
from tests.helpers.build import one_line_error, result_files, samples
from tests.helpers.shards import image_bytes

ROWS = {"train": [7, 5, 6], "test": [5]}  # rows per parquet file
NAMES = ["cat", "dog", "emu"]


@pytest.fixture
def parquet_dataset(tmp_path, monkeypatch):
    """A dataset folder of parquet files named as the Hub names them (split-NNNNN-of-NNNNN.parquet), with row groups
    of 3 rows; returns (folder, {(split, file name, row): (image bytes, label)})."""
    import datasets
    import numpy as np

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    folder = tmp_path / "dataset" / "data"
    folder.mkdir(parents=True)
    expected = {}
    for split, counts in ROWS.items():
        for i, n in enumerate(counts):
            name = f"{split}-{i:05d}-of-{len(counts):05d}.parquet"
            images = [image_bytes(rng, 20 + k, 16) for k in range(n)]
            labels = [int(v) for v in rng.integers(0, len(NAMES), n)]
            ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in images], "label": labels},
                                            features=features)
            ds.to_parquet(str(folder / name), batch_size=3)
            expected.update({(split, name, r): (images[r], labels[r]) for r in range(n)})
    return tmp_path / "dataset", expected


def expected_order(split: str, seed: int) -> list[str]:
    """Files shuffled with the seed, rows in file order: the documented order of a streaming source."""
    files = [f"{split}-{i:05d}-of-{len(ROWS[split]):05d}.parquet" for i in range(len(ROWS[split]))]
    random.Random(f"{seed}/{split}").shuffle(files)
    return [f"{split}/{name}/{row}" for name, n in zip(files, [ROWS[split][int(f.split("-")[1])] for f in files])
            for row in range(n)]


def test_streaming_parquet_keeps_bytes_labels_and_the_seeded_file_order(parquet_dataset, tmp_path):
    folder, expected = parquet_dataset
    build_main([str(folder), str(tmp_path / "out"), "--streaming", "--existing-splits", "--shard-size", "4",
                "--workers", "2", "--seed", "3"])
    info = json.loads((tmp_path / "out" / "_info.json").read_text())
    assert info["class_names"] == NAMES and info["source"]["loader"] == "parquet-stream"
    assert {k: v["num_samples"] for k, v in info["splits"].items()} == {"test": 5, "train": 18}
    for split in ("train", "test"):
        got = samples(tmp_path / "out", split)
        sources = [json.loads(s["json"])["source"] for s in got]
        assert sources == expected_order(split, 3)
        for s, source in zip(got, sources):
            name, row = source.split("/")[1], int(source.split("/")[2])
            assert (s["jpg"], int(s["cls"])) == expected[(split, name, row)]
    assert not list((tmp_path / "hf_cache").rglob("*.arrow"))  # streamed: no local Arrow copy of the dataset


def test_streaming_is_the_same_with_any_workers_or_parts_and_follows_the_seed(parquet_dataset, tmp_path):
    folder, _ = parquet_dataset
    common = [str(folder), "--streaming", "--shard-size", "5", "--val-fraction", "0.2"]
    build_main([common[0], str(tmp_path / "w1"), *common[1:], "--workers", "1"])
    build_main([common[0], str(tmp_path / "w2"), *common[1:], "--workers", "2"])
    for part in ("1", "0"):
        build_main([common[0], str(tmp_path / "parts"), *common[1:], "--num-parts", "2", "--part", part])
    build_main(["merge", str(tmp_path / "parts")])
    assert result_files(tmp_path / "w1") == result_files(tmp_path / "w2") == result_files(tmp_path / "parts")
    assert expected_order("train", 0) != expected_order("train", 1)
    build_main([common[0], str(tmp_path / "seed1"), *common[1:], "--seed", "1"])
    val, train = ([json.loads(s["json"])["source"] for s in samples(tmp_path / "seed1", split)]
                  for split in ("val", "train"))
    assert val + train == expected_order("train", 1)  # val: the first round(18 * 0.2) inputs of the seeded order
    assert len(val) == 4


def test_streaming_null_labels_are_refused_or_skipped(tmp_path, capsys, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    import numpy as np

    rng = np.random.default_rng(1)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": image_bytes(rng), "path": None} for _ in range(6)],
                                     "label": [0, 1, None, 2, None, 1]}, features=features)
    ds.to_parquet(str(tmp_path / "data.parquet"))
    capsys.readouterr()
    message = one_line_error(capsys, str(tmp_path / "data.parquet"), str(tmp_path / "out"), "--streaming")
    assert "2 of 6 inputs" in message and "--unlabelled-rows" in message
    build_main([str(tmp_path / "data.parquet"), str(tmp_path / "out"), "--streaming", "--unlabelled-rows", "skip",
                "--val-fraction", "0"])
    failures = [json.loads(x) for x in (tmp_path / "out" / "failures.jsonl").read_text().splitlines()]
    assert [(f["source"], f["reason"]) for f in failures] == [("train/data.parquet/2", "unlabelled"),
                                                              ("train/data.parquet/4", "unlabelled")]
    assert json.loads((tmp_path / "out" / "_info.json").read_text())["splits"]["train"]["num_samples"] == 4
