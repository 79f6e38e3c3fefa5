"""The shard stream's failure modes and sources: bad-sample rate, fewer shards than workers, shards over http
(bad samples under the rate: tests/vit_mpp/test_stream.py; broken shards: tests/vit_mpp/test_stream_faults.py)."""

from __future__ import annotations

import collections
import tarfile
import tracemalloc

import numpy as np
import pytest

from tests.helpers.loaders import split_loader
from tests.helpers.servers import FaultyHandler, serve_directory, serve_faulty
from tests.helpers.shards import add, bad_shard_set, jpeg, write_shard_set
from vit_mpp.config.sections import DataConfig
from vit_mpp.data import shard_reader
from vit_mpp.data.manifest import ManifestError, load_split
from vit_mpp.data.shard_reader import DataError
from vit_mpp.processes.exits import run_main


@pytest.fixture
def served(tmp_path):
    """A shard set served over http from 127.0.0.1; yields (url, local dir)."""
    shards = write_shard_set(tmp_path / "s", {"train": [5, 3, 4], "val": [3]}, size=8)
    with serve_directory(shards) as url:
        yield url, shards


def test_http_shards_through_the_manifest(served):
    url, _ = served
    split, info = load_split(url, "train")
    assert split.urls[0] == f"{url}/train-000000.tar" and info["num_classes"] == 3
    _, loader = split_loader(split, DataConfig(num_workers=0, shuffle_buffer=1), 8, 3)
    keys = [k for _, b in zip(range(4), loader) for k in b["key"]]
    assert collections.Counter(keys) == collections.Counter(f"train_{i:06d}" for i in range(12))


def test_http_manifest_missing_is_a_clear_error(served):
    url, _ = served
    with pytest.raises(ManifestError, match="HTTP 404"):
        load_split(url + "/nowhere", "train")


def test_too_many_bad_samples_stop_the_run_with_one_line(tmp_path, capsys):
    shards = bad_shard_set(tmp_path / "bad", good=180, bad=20)  # 10% bad
    split, _ = load_split(shards, "train")
    data = DataConfig(num_workers=1, shuffle_buffer=1, max_bad_fraction=0.05, persistent_workers=False)

    def main(argv):
        _, loader = split_loader(split, data, 8, 4)
        for _ in zip(range(100), loader):
            pass

    with pytest.raises(SystemExit) as exit_info:
        run_main(main, [])  # the DataError is raised in the worker process and re-raised here
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "samples undecodable in set 'train' (split 'train'" in lines[0]
    assert "above data.max_bad_fraction=0.05" in lines[0]


def test_fewer_shards_than_workers_in_one_process(tmp_path, capsys):
    shards = write_shard_set(tmp_path / "s", {"train": [20]}, size=8)
    split, _ = load_split(shards, "train")
    _, loader = split_loader(split, DataConfig(num_workers=2, shuffle_buffer=1), 8, 5)
    assert "shards are read by several workers" in capsys.readouterr().err
    keys = [k for _, b in zip(range(4), loader) for k in b["key"]]
    assert sorted(keys) == [f"train_{i:06d}" for i in range(20)]


@pytest.fixture
def flaky(tmp_path):
    with serve_faulty(write_shard_set(tmp_path / "s", {"train": [40]}, size=32)) as url:
        yield url


def test_a_remote_shard_cut_mid_stream_is_reopened_and_read_on(flaky):
    FaultyHandler.faults["/train-000000.tar"] = ("cut", 2)
    samples = list(shard_reader.read_segment(shard_reader.Segment(f"{flaky}/train-000000.tar", 5, 40, 40), wait_s=0))
    assert [s["__key__"] for s in samples] == [f"train_{i:06d}" for i in range(5, 40)]  # each once, in order
    assert FaultyHandler.requests == ["/train-000000.tar"] * 3


def test_a_remote_shard_that_keeps_breaking_is_a_data_error(flaky):
    FaultyHandler.faults["/train-000000.tar"] = ("cut", 99)
    with pytest.raises(DataError, match=r"the stream broke after sample \d+ of 40 \(3 attempts\)"):
        segment = shard_reader.Segment(f"{flaky}/train-000000.tar", 0, 40, 40)
        list(shard_reader.read_segment(segment, retries=2, wait_s=0))
    assert len(FaultyHandler.requests) == 3


def test_members_the_stream_does_not_use_are_passed_over_not_held(tmp_path):
    # Shards others wrote hold more than an image and a label (an embedding, a video beside the frame). They were
    # read into memory with every sample, and kept in the shuffle buffer: a big member per sample could exhaust it.
    rng = np.random.default_rng(0)
    big = bytes(8 << 20)  # 8 MiB per sample, 48 MiB in the shard
    with tarfile.open(tmp_path / "0.tar", "w") as tar:
        for key in ("a", "b", "c", "d", "e", "f"):
            add(tar, f"{key}.JPG", jpeg(rng))
            add(tar, f"{key}.cls", b"1")
            add(tar, f"{key}.npy", big)
            add(tar, f"{key}.txt", b"a caption")
        add(tar, "g.txt", b"a caption, no image")  # still a sample: counted, and reported as one without an image
    seg = shard_reader.Segment(str(tmp_path / "0.tar"), 0, 7, 7)
    tracemalloc.start()
    samples = list(shard_reader.read_segment(seg))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [s["__key__"] for s in samples] == list("abcdefg")
    assert all(s["jpg"][:2] == b"\xff\xd8" and s["cls"] == b"1" and "npy" not in s and "txt" not in s
               for s in samples[:6])
    assert set(samples[6]) == {"__key__", "__url__"}
    assert peak < 6 << 20, peak  # not one 8 MiB member was held (the reader reads 1 MiB chunks)
