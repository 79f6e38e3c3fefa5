"""Check a finished build and look at it: summary table, counts and sha256 verified, a grid of sample images.

    build-shards inspect OUT_DIR [--grid OUT_DIR/_samples.png] [--samples 32] [--no-verify]

Exit status 0 when every shard matches the manifest (size, sha256, sample count, unique keys), 1 otherwise.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

from PIL import Image, ImageDraw
from rich.console import Console
from rich.table import Table

from common.manifest import read_manifest
from data_tools.writer import file_sha256

IMAGE_EXTS = ("jpg", "png", "webp")
THUMB = 96


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="build-shards inspect", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out_dir", help="a build-shards output folder")
    p.add_argument("--grid", default=None, help="PNG grid of sample images (default: OUT_DIR/_samples.png)")
    p.add_argument("--samples", type=int, default=32, help="images in the grid")
    p.add_argument("--no-verify", action="store_true", help="skip reading every shard (sha256, counts, keys)")
    return p.parse_args(argv)


def shard_keys(path: Path) -> list[str]:
    """Sample keys of a tar in order, each once (a sample's files are adjacent)."""
    keys: list[str] = []
    with tarfile.open(path) as tar:
        for member in tar:
            key = member.name.split(".", 1)[0]
            if not keys or keys[-1] != key:
                keys.append(key)
    return keys


def verify(out_dir: Path, info: dict) -> list[str]:
    """Problems found: missing shards, size, sha256 or sample count differing from the manifest, repeated keys."""
    problems, seen = [], set()
    for split in info["splits"].values():
        sizes = split.get("shard_bytes", [None] * len(split["filenames"]))
        hashes = split.get("shard_sha256", [None] * len(split["filenames"]))
        for name, n, size, digest in zip(split["filenames"], split["shard_lengths"], sizes, hashes):
            path = out_dir / name
            if not path.exists():
                problems.append(f"{name}: missing")
                continue
            if size is not None and path.stat().st_size != size:
                problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {size}")
            if digest is not None and file_sha256(path) != digest:
                problems.append(f"{name}: sha256 differs from the manifest")
            keys = shard_keys(path)
            if len(keys) != n:
                problems.append(f"{name}: {len(keys)} samples, manifest says {n}")
            repeated = seen.intersection(keys)
            if repeated or len(set(keys)) != len(keys):
                problems.append(f"{name}: repeated keys, e.g. {sorted(repeated)[:3]}")
            seen.update(keys)
    return problems


def sample_grid(out_dir: Path, info: dict, count: int, path: Path) -> int:
    """Write a PNG grid of the first `count` samples of the first split, each with its label; returns how many."""
    split = next(iter(info["splits"].values()))
    names = info.get("class_names") or []
    tiles: list[tuple[Image.Image, str]] = []
    for filename in split["filenames"]:
        samples: dict[str, dict[str, bytes]] = {}
        with tarfile.open(out_dir / filename) as tar:
            for member in tar:
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
        for key, files in samples.items():
            ext = next((e for e in IMAGE_EXTS if e in files), None)
            if ext is None:
                continue
            img = Image.open(io.BytesIO(files[ext])).convert("RGB")
            img.thumbnail((THUMB, THUMB))
            label = int(files["cls"]) if "cls" in files else json.loads(files.get("json", b"{}")).get("label", -1)
            text = f"{label} {names[label]}" if 0 <= label < len(names) else ("unlabelled" if label < 0 else str(label))
            tiles.append((img, f"{key}\n{text}"[:40]))
            if len(tiles) >= count:
                break
        if len(tiles) >= count:
            break
    cols = min(8, max(1, len(tiles)))
    rows = max(1, -(-len(tiles) // cols))
    cell_h = THUMB + 28
    grid = Image.new("RGB", (cols * THUMB, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, (img, text) in enumerate(tiles):
        x, y = (i % cols) * THUMB, (i // cols) * cell_h
        grid.paste(img, (x + (THUMB - img.width) // 2, y + (THUMB - img.height) // 2))
        draw.multiline_text((x + 2, y + THUMB + 1), text, fill=(0, 0, 0))
    grid.save(path)
    return len(tiles)


def main(argv: list[str]) -> int:
    """Print the summary, verify, write the grid; returns the exit status."""
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    info = read_manifest(out_dir)
    console = Console()
    table = Table(title=f"{out_dir} ({info.get('tool_version', '?')})")
    for column in ("split", "samples", "shards", "min/max per shard", "MiB"):
        table.add_column(column, justify="right" if column != "split" else "left")
    for name, split in info["splits"].items():
        lengths = split["shard_lengths"] or [0]
        mib = sum(split.get("shard_bytes", [])) / 2**20
        table.add_row(name, f"{split['num_samples']:,}", str(len(split["filenames"])),
                      f"{min(lengths)}/{max(lengths)}", f"{mib:,.1f}")
    console.print(table)
    console.print(f"classes: {info.get('num_classes', 0)}; source: {info.get('source', {}).get('kind', '?')} "
                  f"{info.get('source', {}).get('path', '')}; seed {info.get('seed')}; "
                  f"failures: {info.get('num_failures', 0)} "
                  f"{', '.join(f'{k} {v}' for k, v in info.get('failure_reasons', {}).items())}")
    status = 0
    if not args.no_verify:
        problems = verify(out_dir, info)
        for problem in problems:
            console.print(f"[red]problem:[/red] {problem}")
        console.print("verified: every shard matches the manifest" if not problems else f"{len(problems)} problem(s)")
        status = 1 if problems else 0
    grid = Path(args.grid) if args.grid else out_dir / "_samples.png"
    shown = sample_grid(out_dir, info, args.samples, grid)
    console.print(f"wrote a grid of {shown} samples to {grid}")
    return status
