"""build-shards in tests: a class-folder tree of JPEGs to build from, and a build read back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from data_tools.cli import main as build_main
from tests.helpers.shards import image_bytes
from vit_mpp.data.manifest import load_split


def make_tree(root: Path, layout: dict[str, int], seed: int = 0, size: int = 24) -> dict[str, bytes]:
    """Writes `count` JPEGs under each relative folder of `layout`; returns relative path -> bytes."""
    rng = np.random.default_rng(seed)
    files = {}
    for folder, count in layout.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            rel = f"{folder}/img{i:03d}.jpg"
            files[rel] = image_bytes(rng, size, size - 4)
            (root / rel).write_bytes(files[rel])
    return files


def write_list(path: Path, rows: list[dict]) -> Path:
    """A list file in the format its suffix names (.csv, .jsonl, .parquet); a missing or None value is empty."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in columns}), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        cell = lambda v: "" if v is None else str(v)  # noqa: E731
        path.write_text(",".join(columns) + "\n" + "".join(",".join(cell(r.get(k)) for k in columns) + "\n"
                                                            for r in rows))
    return path


def samples(out: Path, split: str) -> list[dict]:
    """Every sample of `split`, read with plain webdataset through the manifest."""
    s, _ = load_split(out, split)
    return list(wds.WebDataset(s.urls, shardshuffle=False, empty_check=False))


def result_files(out: Path) -> dict[str, bytes]:
    """What a build delivers: shards, manifest, failures (journals are its working state)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())
            if p.suffix == ".tar" or p.name in ("_info.json", "failures.jsonl")}


def one_line_error(capsys, *argv: str) -> str:
    """Run build-shards in-process; it must exit with status 2 and print exactly one `error:` line."""
    with pytest.raises(SystemExit) as exit_info:
        build_main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]
