"""Beside img2dataset: a folder written by img2dataset's own writer (`WebDatasetSampleWriter`: a tar, a parquet of
every row, failed rows in the parquet only) is indexed and trained on, whatever webdataset it was written with (CI
runs this file again in a second environment with webdataset 0.2 and img2dataset installed: .ci/run); and what
timm's and Hugging Face's readers make of such shards and of ours, as docs/build_shards.md says."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from data_tools.cli import main as build_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.runs import read_metrics
from tests.helpers.shards import img2dataset_folder, jpeg


def img2dataset_writer() -> ModuleType:
    """img2dataset's writer module, loaded on its own (the package's __init__ imports its downloader: opencv, fire,
    wandb, which the writer does not need); the test is skipped where img2dataset is not installed."""
    spec = importlib.util.find_spec("img2dataset")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("img2dataset is not installed (CI's webdataset 0.2 environment has it)")
    path = Path(next(iter(spec.submodule_search_locations))) / "writer.py"
    module_spec = importlib.util.spec_from_file_location("img2dataset_writer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def write_as_img2dataset(root: Path, lengths: list[int]) -> Path:
    """What `img2dataset --output_format webdataset` writes: per shard `NNNNN.tar` (`KEY.jpg`, `.txt`, `.json`) and
    `NNNNN.parquet`, with one failed download per shard (a parquet row, no tar member)."""
    import pyarrow as pa

    writer = img2dataset_writer()
    schema = pa.schema([pa.field(k, pa.string()) for k in ("url", "key", "status", "error_message")])
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for shard, n in enumerate(lengths):
        sink = writer.WebDatasetSampleWriter(shard, str(root), True, 5, schema, "jpg")
        for i in range(n + 1):
            key = f"{shard:05d}{i:04d}"
            ok = i < n
            meta = {"url": f"https://example.com/{key}.jpg", "key": key, "status": "success" if ok else "failed",
                    "error_message": None if ok else "404"}
            sink.write(jpeg(rng) if ok else None, key, f"a caption for {key}", meta)
        sink.close()
    return root


def test_a_folder_img2dataset_wrote_is_indexed_and_trained_on(tmp_path):
    import webdataset

    folder = write_as_img2dataset(tmp_path / "laion", [7, 5])
    assert sorted(p.name for p in folder.iterdir()) == ["00000.parquet", "00000.tar", "00001.parquet", "00001.tar"]
    build_main(["index", str(folder)])
    train = json.loads((folder / "_info.json").read_text())["splits"]["train"]
    assert train["shard_lengths"] == [7, 5] and train["image_extensions"] == {"jpg": 12}  # failed rows: no sample
    run_dir = tmp_path / "run"
    pretrain_main(["--config", "configs/pretrain/tiny.yaml", f"data.shards={folder}", "data.val_split=",
                   "train.steps=3", "train.log_every=1", "data.num_workers=0", f"train.run_dir={run_dir}"])
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "export" / "model.safetensors").is_file()
    logging.getLogger(__name__).info("webdataset %s", webdataset.__version__)


@pytest.fixture(scope="module")
def theirs(tmp_path_factory) -> Path:
    """An img2dataset folder as it lies on disk: tars, their parquet files and stats, indexed in place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = img2dataset_folder(tmp_path_factory.mktemp("theirs"), [5, 4])
    for shard in range(2):
        pq.write_table(pa.table({"key": [f"{shard:05d}{i:04d}" for i in range(5)], "status": ["success"] * 5}),
                       folder / f"{shard:05d}.parquet")
        (folder / f"{shard:05d}_stats.json").write_text(json.dumps({"count": 5}))
    build_main(["index", str(folder)])
    return folder


def test_timm_reads_unlabelled_shards_only_with_a_target_key(theirs):
    # timm's wds reader takes each sample's label from `.cls` (KeyError, logged and skipped: 0 samples) or from a
    # field of the json sidecar named by target_key, which any integer field serves for unlabelled images
    import timm.data

    logging.getLogger("timm").setLevel(logging.ERROR)
    assert sum(1 for _ in timm.data.create_dataset("wds/theirs", root=str(theirs), split="train")) == 0
    assert sum(1 for _ in timm.data.create_dataset("wds/theirs", root=str(theirs), split="train",
                                                   target_key="key")) == 9


def test_hugging_face_reads_their_tars_by_pattern_and_ours_by_folder(theirs, demo_shards, tmp_path):
    datasets = pytest.importorskip("datasets")

    cache = str(tmp_path / "hf")
    with pytest.raises(Exception, match="header"):  # tarfile's ReadError: the parquet files are read as tars
        datasets.load_dataset("webdataset", data_dir=str(theirs), split="train", cache_dir=cache)
    tars = datasets.load_dataset("webdataset", data_files={"train": str(theirs / "*.tar")}, split="train",
                                 cache_dir=cache)
    assert len(tars) == 9 and {"jpg", "txt", "json"} <= set(tars.column_names)
    ours = datasets.load_dataset("webdataset", data_dir=str(demo_shards), cache_dir=cache)
    info = json.loads((demo_shards / "_info.json").read_text())["splits"]
    assert {k: len(v) for k, v in ours.items()} == {"train": info["train"]["num_samples"],
                                                   "validation": info["val"]["num_samples"]}
