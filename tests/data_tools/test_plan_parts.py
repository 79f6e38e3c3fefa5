"""A list SOURCE of many files (a folder or a pattern of CSV, JSONL and Parquet lists), planned part by part with
--plan-parts: each part lists only its own files; parts + merge are byte for byte the one-machine build of the same
plan; every row's split is its own; mistakes are one `error:` line."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data_tools.builder.plan_parts import assign_files
from data_tools.builder.sources import lists
from data_tools.builder.sources.list_files import ListFile, resolve_list_files
from data_tools.cli import main as build_main
from tests.helpers.build import one_line_error, result_files, write_list
from tests.helpers.shards import image_bytes

FILES = 6  # list files, of different sizes (so the plan balances bytes, not counts)


def write_images(root: Path, count: int, seed: int = 0) -> list[str]:
    """`count` small JPEGs under root/img/; their paths relative to root."""
    rng = np.random.default_rng(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        (root / "img" / f"{i:03d}.jpg").write_bytes(image_bytes(rng))
        paths.append(f"img/{i:03d}.jpg")
    return paths


@pytest.fixture
def data(tmp_path) -> Path:
    """tmp/data: 60 images in img/ and six list files part-0..5 (CSV, JSONL, Parquet) of 3 to 18 rows with integer
    labels; part-2.csv also has a row naming a missing file and a row without a path."""
    root = tmp_path / "data"
    paths = write_images(root, 60)
    start = 0
    for k, n in enumerate([3, 18, 7, 12, 5, 15]):
        rows = [{"path": p, "label": i % 3} for i, p in enumerate(paths[start:start + n])]
        start += n
        if k == 2:
            rows += [{"path": "img/missing.jpg", "label": 1}, {"path": "", "label": 0}]
        write_list(root / f"part-{k}.{['csv', 'jsonl', 'parquet'][k % 3]}", rows)
    return root


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The names of the list files build-shards reads rows from, in order (every read goes through list_file)."""
    names: list[str] = []
    real = lists.list_file

    def counting(file, *args, **kwargs):
        names.append(file.name)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(lists, "list_file", counting)
    return names


def sources_by_split(out: Path) -> dict[str, set[str]]:
    """Split -> the `source` of every sample in its shards."""
    info = json.loads((out / "_info.json").read_text())
    found: dict[str, set[str]] = {}
    for split, entry in info["splits"].items():
        for name in entry["filenames"]:
            with tarfile.open(out / name) as tar:
                found.setdefault(split, set()).update(
                    json.loads(tar.extractfile(m).read())["source"] for m in tar if m.name.endswith(".json"))
    return found


@pytest.mark.parametrize("plan, parts", [(3, 3), (4, 2)])
def test_each_part_lists_only_its_files_and_parts_plus_merge_are_the_one_machine_build(data, tmp_path, opened,
                                                                                      plan, parts):
    source = str(data / "part-*")  # a pattern; rows are relative to their file's folder
    common = ["--shard-size", "4", "--max-side", "16", "--workers", "2", "--seed", "5", "--plan-parts", str(plan)]
    build_main([source, str(tmp_path / "one"), *common])
    assert sorted(opened) == sorted(p.name for p in data.glob("part-*"))  # one machine: every file, once
    expected = assign_files(resolve_list_files(source).files, plan)
    for part in reversed(range(parts)):  # any order, as a scheduler runs them
        opened.clear()
        build_main([source, str(tmp_path / "parts"), *common, "--num-parts", str(parts), "--part", str(part)])
        own = [f.name for g in range(plan) if g % parts == part for f in expected[g]]
        assert opened == own  # this part read its own files and no other
        journal = tmp_path / "parts" / f"_journal-part-{part:05d}-of-{parts:05d}.jsonl"
        groups = json.loads(journal.read_text().splitlines()[0])["groups"]
        assert sorted(int(g) for g in groups) == [g for g in range(plan) if g % parts == part]
        assert [n for g in groups.values() for n in g["files"]] == own
    assert not (tmp_path / "parts" / "_info.json").exists()
    build_main(["merge", str(tmp_path / "parts")])
    one, merged = result_files(tmp_path / "one"), result_files(tmp_path / "parts")
    assert one == merged and len(one) > plan + 2
    info = json.loads(one["_info.json"])
    assert info["plan_parts"] == plan and info["source"]["files"] == FILES and info["source"]["num_inputs"] == 61
    assert info["num_classes"] == 3 and info["class_names"] == ["0", "1", "2"]
    assert info["failure_reasons"] == {"bad_row": 1, "unreadable": 1}
    assert sum(e["num_samples"] for e in info["splits"].values()) == 60
    names = [n for e in info["splits"].values() for n in e["filenames"]]
    assert all(n.split("-")[1].startswith("p") for n in names)  # shards carry their plan part


def test_a_repeated_row_is_found_in_its_plan_part_and_parts_plus_merge_stay_the_one_machine_build(data, tmp_path,
                                                                                                 capsys):
    first = json.loads((data / "part-1.jsonl").read_text().splitlines()[0])
    with open(data / "part-1.jsonl", "a") as f:  # the first row again, spelled otherwise
        f.write(json.dumps({"path": "./" + first["path"], "label": first["label"]}) + "\n")
    source = str(data / "part-*")
    common = ["--shard-size", "4", "--max-side", "16", "--seed", "5", "--plan-parts", "3"]
    message = one_line_error(capsys, source, str(tmp_path / "refused"), *common)
    assert "error: 1 of the " in message and " (plan part " in message
    assert f"(first: {'./' + first['path']!r})" in message
    build_main([source, str(tmp_path / "one"), *common, "--repeated-rows", "skip"])
    for part in range(3):
        build_main([source, str(tmp_path / "parts"), *common, "--repeated-rows", "skip", "--num-parts", "3",
                    "--part", str(part)])
    build_main(["merge", str(tmp_path / "parts")])
    one = result_files(tmp_path / "one")
    assert one == result_files(tmp_path / "parts")
    info = json.loads(one["_info.json"])
    assert info["failure_reasons"] == {"bad_row": 1, "repeated": 1, "unreadable": 1}
    assert sum(e["num_samples"] for e in info["splits"].values()) == 60  # each image once
    assert "num_repeated" not in info["source"]
    build_main([source, str(tmp_path / "keep"), *common, "--repeated-rows", "keep"])
    info = json.loads((tmp_path / "keep" / "_info.json").read_text())
    assert info["source"]["num_repeated"] == 1 and sum(e["num_samples"] for e in info["splits"].values()) == 61


def test_files_are_dealt_by_size_and_every_row_keeps_its_split_whatever_the_plan(data, tmp_path):
    files = [ListFile(f"x/{n}", n, size) for n, size in [("a", 50), ("b", 40), ("c", 30), ("d", 20), ("e", 10)]]
    assert [[f.name for f in g] for g in assign_files(files, 2)] == [["a", "d", "e"], ["b", "c"]]  # 80 / 70 bytes
    common = ["--shard-size", "5", "--max-side", "16", "--workers", "1", "--val-fraction", "0.3"]
    for plan in ("2", "5"):
        build_main([str(data / "part-*"), str(tmp_path / plan), *common, "--plan-parts", plan])
    two, five = sources_by_split(tmp_path / "2"), sources_by_split(tmp_path / "5")
    assert two == five and 8 <= len(two["val"]) <= 28  # per row: 30% of 60 up to sampling noise
    build_main([str(data / "part-*"), str(tmp_path / "seed"), *common, "--plan-parts", "2", "--seed", "1"])
    assert sources_by_split(tmp_path / "seed")["val"] != two["val"]


def test_a_folder_of_lists_with_labels_in_one_part_only(tmp_path, capsys):
    lists_dir = tmp_path / "lists"
    paths = write_images(lists_dir, 8)  # the images in a sub-folder of the lists' folder: passed over
    write_list(lists_dir / "a.csv", [{"path": p, "label": 1} for p in paths[:4]])
    write_list(lists_dir / "b.csv", [{"path": p} for p in paths[4:]])
    (lists_dir / "_SUCCESS").write_text("")  # what Spark leaves beside its files: passed over
    common = ["--source-kind", "list", "--plan-parts", "2", "--shard-size", "2", "--workers", "1"]
    message = one_line_error(capsys, str(lists_dir), str(tmp_path / "one"), *common)
    assert "4 of 8 inputs" in message and "--unlabelled-rows" in message  # one machine sees both: before writing
    assert not (tmp_path / "one").exists()
    for part in ("0", "1"):  # each part alone sees nothing wrong: merge does
        build_main([str(lists_dir), str(tmp_path / "parts"), *common, "--num-parts", "2", "--part", part])
    capsys.readouterr()
    assert "have no label" in one_line_error(capsys, "merge", str(tmp_path / "parts"))
    for part in ("0", "1"):
        build_main([str(lists_dir), str(tmp_path / "keep"), *common, "--unlabelled-rows", "keep", "--num-parts", "2",
                    "--part", part])
    build_main(["merge", str(tmp_path / "keep")])
    info = json.loads((tmp_path / "keep" / "_info.json").read_text())
    assert info["num_classes"] == 2 and info["num_unlabelled"] == 4
    assert sum(split.get("num_unlabelled", 0) for split in info["splits"].values()) == 4  # summed over the parts


def test_merge_names_the_part_that_has_not_run(data, tmp_path, capsys):
    common = ["--plan-parts", "3", "--num-parts", "3", "--shard-size", "4", "--workers", "1"]
    for part in ("0", "2"):
        build_main([str(data / "part-*"), str(tmp_path / "out"), *common, "--part", part])
    capsys.readouterr()
    assert "part 1 of 3 has not run" in one_line_error(capsys, "merge", str(tmp_path / "out"))
    build_main([str(data / "part-*"), str(tmp_path / "out"), *common, "--part", "1"])
    journal = tmp_path / "out" / "_journal-part-00001-of-00003.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n")  # part 1 stopped before its last range
    capsys.readouterr()
    assert "part 1 of 3 is incomplete" in one_line_error(capsys, "merge", str(tmp_path / "out"))
    build_main([str(data / "part-*"), str(tmp_path / "out"), *common, "--part", "1"])  # resumes: one range
    build_main(["merge", str(tmp_path / "out")])
    build_main([str(data / "part-*"), str(tmp_path / "one"), *common[:2], "--shard-size", "4", "--workers", "1"])
    assert result_files(tmp_path / "out") == result_files(tmp_path / "one")


def test_a_bad_file_is_one_line_and_only_its_part_meets_it(data, tmp_path, capsys):
    (data / "part-9.parquet").write_bytes(b"this is no parquet file")
    common = ["--plan-parts", "2", "--shard-size", "4", "--workers", "1"]
    message = one_line_error(capsys, str(data / "part-*"), str(tmp_path / "one"), *common)
    assert "part-9.parquet is not a parquet list" in message
    owner = next(g for g, files in enumerate(assign_files(resolve_list_files(str(data / "part-*")).files, 2))
                 if "part-9.parquet" in [f.name for f in files])
    build_main([str(data / "part-*"), str(tmp_path / "parts"), *common, "--num-parts", "2", "--part",
                str(1 - owner)])  # the other part never opens it
    capsys.readouterr()
    assert "not a parquet list" in one_line_error(capsys, str(data / "part-*"), str(tmp_path / "parts"), *common,
                                                  "--num-parts", "2", "--part", str(owner))
    (data / "part-9.parquet").unlink()
    (data / "notes.txt").write_text("not a list")
    message = one_line_error(capsys, str(data), str(tmp_path / "x"), "--source-kind", "list", *common)
    assert "notes.txt is not a list file" in message


@pytest.mark.parametrize("case, message", [
    ("empty", "no list files"),
    ("names", "labels that are names"),
    ("too_many_parts", "--num-parts 3 is more than --plan-parts 2"),
    ("too_few_files", "--plan-parts 7 is more than the 6 list file(s)"),
    ("not_a_list", "--plan-parts plans a list SOURCE"),
])
def test_planning_mistakes_are_one_line(data, tmp_path, capsys, case, message):
    source, args = str(data / "part-*"), ["--plan-parts", "2"]
    if case == "empty":
        (tmp_path / "empty").mkdir()
        source, args = str(tmp_path / "empty"), ["--source-kind", "list", *args]
    elif case == "names":
        write_list(data / "part-1.jsonl", [{"path": "img/000.jpg", "label": "cat"}])
    elif case == "too_many_parts":
        args += ["--num-parts", "3", "--part", "0"]
    elif case == "too_few_files":
        args = ["--plan-parts", "7"]
    elif case == "not_a_list":
        source = str(data / "img")
    assert message in one_line_error(capsys, source, str(tmp_path / "out"), *args)
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_folder_of_lists_without_plan_parts_is_one_list(data, tmp_path, capsys):
    """Without --plan-parts, the files of a folder are one list (every part lists them all, one global shuffle)."""
    common = ["--source-kind", "list", "--shard-size", "4", "--workers", "1"]  # data/img/ is passed over
    build_main([str(data), str(tmp_path / "one"), *common])
    info = json.loads((tmp_path / "one" / "_info.json").read_text())
    assert info["source"]["files"] == FILES and "plan_parts" not in info
    assert sum(e["num_samples"] for e in info["splits"].values()) == 60
    assert [n.split("-")[0] for e in info["splits"].values() for n in e["filenames"]][:1] == ["train"]
    build_main([str(data), str(tmp_path / "parts"), *common, "--num-parts", "2", "--part", "0"])
    assert "--plan-parts N gives each part only its own files" in capsys.readouterr().out


def test_remote_folders_and_patterns_of_lists(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ("b.csv", "a.parquet", "_SUCCESS", "sub/c.jsonl"):
        fs.pipe(f"/lists-test/{name}", b"path\nx.jpg\n")
    folder = resolve_list_files("memory://lists-test")
    assert [f.name for f in folder.files] == ["a.parquet", "b.csv"] and folder.root == "memory://lists-test"
    assert [f.size for f in folder.files] == [11, 11] and not folder.single
    pattern = resolve_list_files("memory://lists-test/*/*.jsonl")
    assert [(f.name, f.prefix) for f in pattern.files] == [("sub/c.jsonl", "sub/")]
    fs.rm("/lists-test", recursive=True)


def test_a_path_with_glob_characters_that_exists_is_not_a_pattern(tmp_path):
    folder = tmp_path / "lists[2024]"
    folder.mkdir()
    (folder / "a.csv").write_text("path\nx.jpg\n")
    assert [f.name for f in resolve_list_files(str(folder)).files] == ["a.csv"]
    assert resolve_list_files(str(folder / "a.csv")).single
    assert [f.name for f in resolve_list_files(str(tmp_path / "*" / "a.csv")).files] == ["lists[2024]/a.csv"]
