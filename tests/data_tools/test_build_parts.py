"""build-shards on many machines: parts + merge give the very bytes of a one-machine build; merge refuses what is
missing, partial or from another build, in one line; Ray (a local instance with 2 CPUs) gives the same bytes and
resumes the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from data_tools.builder.shard_layout import range_bounds, split_ranges
from data_tools.builder.shuffle import Shuffle
from data_tools.cli import main as build_main
from tests.helpers.build import make_tree, one_line_error, result_files
from tests.helpers.processes import REPO


@pytest.fixture
def source(tmp_path) -> Path:
    """37 images in two classes, plus inputs that fail (a broken image, a text file, a dangling link)."""
    src = tmp_path / "src"
    make_tree(src, {"a": 20, "b": 17}, size=40)
    (src / "a" / "broken.jpg").write_bytes(b"not an image")
    (src / "b" / "notes.txt").write_text("not an input")
    (src / "b" / "gone.jpg").symlink_to(src / "nowhere.jpg")
    return src


@pytest.mark.parametrize("limits", [["--shard-size", "4"], ["--shard-size", "1"],
                                    ["--shard-size", "6", "--shard-bytes", "3000"]],
                         ids=["ranges_of_4", "ranges_of_1_with_gaps", "byte_pieces"])
def test_parts_then_merge_are_byte_identical_to_one_machine(source, tmp_path, limits):
    common = [*limits, "--max-side", "32", "--workers", "2", "--seed", "5"]
    build_main([str(source), str(tmp_path / "one"), *common])
    for part in (2, 0, 1):  # any order, as a scheduler runs them
        build_main([str(source), str(tmp_path / "parts"), *common, "--num-parts", "3", "--part", str(part)])
    assert not (tmp_path / "parts" / "_info.json").exists()  # parts never write the manifest
    build_main(["merge", str(tmp_path / "parts")])
    one, parts = result_files(tmp_path / "one"), result_files(tmp_path / "parts")
    assert one == parts and len(one) > 3
    info = json.loads(one["_info.json"])
    assert info["num_failures"] == 3 and info["failure_reasons"] == {"broken_link": 1, "not_an_image": 1,
                                                                      "undecodable": 1}
    if limits == ["--shard-size", "1"]:  # 38 ranges of one input; the broken image's writes no shard: a gap
        numbers = {name: [int(f.split("-")[1].split(".")[0]) for f in s["filenames"]]
                   for name, s in info["splits"].items()}
        assert sum(len(v) for v in numbers.values()) == 37 and info["source"]["num_inputs"] == 38
        ranges = {"train": 34, "val": 4}  # round(38 * 0.1) = 4 inputs in val
        assert sum(len(set(range(ranges[k])) - set(v)) for k, v in numbers.items()) == 1


def test_parts_resume_and_the_part_count_may_change(source, tmp_path):
    common = ["--shard-size", "3", "--workers", "1"]
    build_main([str(source), str(tmp_path / "one"), *common])
    # half the work as 2 parts (part 1 never runs), the rest by a one-machine run that reuses what part 0 wrote
    build_main([str(source), str(tmp_path / "out"), *common, "--num-parts", "2", "--part", "0"])
    build_main([str(source), str(tmp_path / "out"), *common])
    assert result_files(tmp_path / "out") == result_files(tmp_path / "one")


def test_merge_refuses_missing_partial_and_foreign_parts(source, tmp_path, capsys):
    out = tmp_path / "out"
    common = ["--shard-size", "3", "--workers", "1", "--num-parts", "3"]
    assert "no build-shards journal" in one_line_error(capsys, "merge", str(tmp_path / "empty"))
    for part in ("0", "2"):
        build_main([str(source), str(out), *common, "--part", part])
    capsys.readouterr()
    assert "part 1 of 3 has not run" in one_line_error(capsys, "merge", str(out))
    build_main([str(source), str(out), *common, "--part", "1"])
    journal = out / "_journal-part-00001-of-00003.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-2]) + "\n")  # part 1 stopped before its last two ranges
    capsys.readouterr()
    message = one_line_error(capsys, "merge", str(out))
    assert "part 1 of 3 is incomplete" in message and f"{len(lines) - 3} of {len(lines) - 1} ranges done" in message
    first = json.loads(lines[1])["shards"][0]["filename"]
    (out / first).unlink()  # a journaled shard that is gone does not count
    assert "first missing" in one_line_error(capsys, "merge", str(out))
    build_main([str(source), str(out), *common, "--part", "1"])  # the re-run writes what is missing
    build_main(["merge", str(out)])
    assert (out / "_info.json").exists()

    # a part built with another seed into another folder, then copied in: merge names the difference
    other = tmp_path / "other"
    build_main([str(source), str(other), *common, "--part", "1", "--seed", "7"])
    for name in ["_journal-part-00001-of-00003.jsonl"]:
        (out / name).write_bytes((other / name).read_bytes())
    (out / "_info.json").unlink()
    capsys.readouterr()
    message = one_line_error(capsys, "merge", str(out))
    assert "different builds" in message and "seed 0 vs 7" in message


def test_a_part_refuses_an_out_holding_another_build(source, tmp_path, capsys):
    out = tmp_path / "out"
    build_main([str(source), str(out), "--num-parts", "2", "--part", "0", "--seed", "1"])
    capsys.readouterr()
    message = one_line_error(capsys, str(source), str(out), "--num-parts", "2", "--part", "1", "--seed", "2")
    assert "another" in message or "other inputs or settings" in message


@pytest.mark.parametrize("flags, message", [
    (["--num-parts", "0"], "--num-parts must be >= 1"),
    (["--part", "5", "--num-parts", "3"], "--part must be in 0..2"),
    (["--part", "-1", "--num-parts", "2"], "--part must be in 0..1"),
    (["--part", "1"], "--part must be in 0..0"),
    (["--num-parts", "two"], "invalid int value"),
    (["--executor", "spark"], "invalid choice"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--shard-size", "-3"], "--shard-size and --shard-bytes"),
    (["--shard-size", "0"], "--shard-size and --shard-bytes"),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
    (["--val-fraction", "nan"], "--val-fraction must be in [0, 1)"),
    (["--val-fraction", "0.2", "--existing-splits"], "exclude each other"),
    (["--quality", "0"], "--quality must be in 1..100"),
    (["--max-side", "-1"], "--max-side must be >= 0"),
    (["--min-side", "0"], "--min-side must be >= 1"),
    (["--unlabelled-rows", "maybe"], "invalid choice"),
    (["--streaming"], "--streaming reads parquet data files"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_flag_values_are_one_line_errors_before_anything_is_written(source, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert message in one_line_error(capsys, str(source), str(out), *flags)
    assert not out.exists()


def test_dry_run_prints_the_plan_and_writes_nothing(source, tmp_path, capsys):
    build_main([str(source), str(tmp_path / "out"), "--shard-size", "4", "--num-parts", "3", "--part", "1",
                "--dry-run"])
    out = capsys.readouterr().out
    assert "plan: train 34 inputs in 9 ranges, val 4 inputs in 1 ranges; part 1 of 3: 3 ranges, 11 inputs" in out
    assert not (tmp_path / "out").exists()


def test_shuffle_is_a_bijection_and_ranges_are_arithmetic():
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        rows = Shuffle(n, "0")(np.arange(n))
        assert sorted(rows.tolist()) == list(range(n))
    assert Shuffle(1000, "0")(np.arange(1000)).tolist() != Shuffle(1000, "1")(np.arange(1000)).tolist()
    assert split_ranges(2500, 1000) == [(0, 834), (834, 1667), (1667, 2500)]
    assert range_bounds(2500, 1000, 2) == (1667, 2500)


@pytest.fixture
def local_ray(monkeypatch):
    """A local Ray instance with 2 CPUs whose workers import this checkout."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_executor_gives_the_same_bytes_and_resumes(source, tmp_path, local_ray):
    common = ["--shard-size", "4", "--max-side", "32", "--seed", "3"]
    build_main([str(source), str(tmp_path / "local"), *common, "--workers", "2"])
    build_main([str(source), str(tmp_path / "ray"), *common, "--executor", "ray"])
    assert result_files(tmp_path / "ray") == result_files(tmp_path / "local")
    # an interrupted Ray build: the manifest and the last ranges' journal lines are gone; the re-run resumes
    journal = tmp_path / "ray" / "_journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-3]) + "\n")
    (tmp_path / "ray" / "_info.json").unlink()
    build_main([str(source), str(tmp_path / "ray"), *common, "--executor", "ray"])
    assert result_files(tmp_path / "ray") == result_files(tmp_path / "local")
    # parts can run on Ray too, and merge as usual
    for part in ("0", "1"):
        build_main([str(source), str(tmp_path / "ray_parts"), *common, "--executor", "ray", "--num-parts", "2",
                    "--part", part])
    build_main(["merge", str(tmp_path / "ray_parts")])
    assert result_files(tmp_path / "ray_parts") == result_files(tmp_path / "local")
