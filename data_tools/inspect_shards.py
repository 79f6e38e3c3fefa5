"""`build-shards inspect OUT [--grid PNG] [--decode]`: a finished build checked against its manifest, shard by shard
(`verify`, `check_shard`), with a summary table and a grid of sample images (`sample_grid`). Each mismatch is a
problem, never a crash: exit status 0 when there is none, 1 otherwise. See docs/build_shards.md#inspect.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image, ImageDraw
from rich.console import Console
from rich.table import Table

from data_tools.decode_check import KeyTally
from vit_mpp.data import tar_scan, urls
from vit_mpp.data.image_formats import IMAGE_EXTENSIONS, image_member
from vit_mpp.data.labels import BadLabel, cls_label, sample_label
from vit_mpp.data.manifest import check_manifest, manifest_file, read_manifest, shard_base, shard_url
from vit_mpp.errors import UserError

THUMB = 96
_THUMB_MEMBERS = frozenset((*IMAGE_EXTENSIONS, "cls"))  # a thumbnail's image and its label


class _Hashing(io.RawIOBase):
    """A stream that hashes and counts what is read through it."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self.stream, self.sha256, self.size = stream, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.stream.read(len(buffer))
        self.sha256.update(data)
        self.size += len(data)
        buffer[: len(data)] = data
        return len(data)


class ShardEntry(NamedTuple):
    """One shard as its manifest lists it: name, samples, and (when recorded) bytes and sha256."""

    name: str
    count: int
    size: int | None
    digest: str | None


def check_shard(location: str, entry: ShardEntry, num_classes: int, seen: set[str], decode: bool = False) -> list[str]:
    """Problems of one shard against its manifest entry; `seen` collects keys across shards. With `decode`, every
    sample's image is decoded too (the image members of one sample at a time are held)."""
    name, count, size, digest = entry
    problems: list[str] = []
    keys: list[str] = []
    bad_labels: list[str] = []
    undecodable = KeyTally()
    try:
        stream = urls.open_url(shard_url(location, name))
    except FileNotFoundError:
        return [f"{name}: missing"]
    except OSError as e:
        return [f"{name}: cannot be opened ({type(e).__name__}: {e.strerror or e})"]
    hashing = _Hashing(stream)
    wanted = frozenset(("cls", *(IMAGE_EXTENSIONS if decode else ())))  # the bytes read: one sample's at a time
    try:
        with stream:
            try:  # samples as training reads them (vit_mpp/data/tar_scan.py), so the counts compare
                for sample in tar_scan.samples(tar_scan.TarReader(hashing), wanted):
                    keys.append(sample.key)
                    ext = image_member(sample.data) if decode else None
                    if ext is not None:
                        undecodable.check(sample.key, sample.data[ext])
                    try:
                        label = cls_label(sample.data.get("cls"))
                    except BadLabel as e:
                        bad_labels.append(f"{sample.key} ({e})")
                        continue
                    if label >= num_classes:
                        bad_labels.append(f"{sample.key} ({label} not in 0..{num_classes - 1})" if num_classes else
                                          f"{sample.key} ({label}: the manifest lists no classes)")
            except tar_scan.TarDamaged as e:
                problems.append(f"{name}: {e}")
            while hashing.read(1 << 20):  # the rest of the file (tar end blocks, padding) for size and sha256
                pass
    except OSError as e:
        problems.append(f"{name}: read failed ({type(e).__name__}: {e})")
    if size is not None and hashing.size != size:
        problems.append(f"{name}: {hashing.size} bytes, manifest says {size}")
    if digest is not None and hashing.sha256.hexdigest() != digest:
        problems.append(f"{name}: sha256 differs from the manifest")
    if len(keys) != count:
        problems.append(f"{name}: {len(keys)} samples, manifest says {count}")
    if bad_labels:
        problems.append(f"{name}: {len(bad_labels)} bad label(s) for num_classes {num_classes}, e.g. "
                        f"{', '.join(bad_labels[:3])}")
    if undecodable.count:
        problems.append(f"{name}: undecodable image(s) in {undecodable.describe()}")
    repeated = seen.intersection(keys)
    if repeated or len(set(keys)) != len(keys):
        problems.append(f"{name}: repeated keys, e.g. {sorted(repeated)[:3] or keys[:1]}")
    seen.update(keys)
    return problems


def verify(location: str, info: dict, decode: bool = False) -> list[str]:
    """Problems found in every shard of every split (see `check_shard`); `location` is where the shard names are
    relative to (`vit_mpp.data.manifest.shard_base`)."""
    problems: list[str] = []
    num_classes = int(info.get("num_classes", 0) or 0)
    for split in info["splits"].values():
        n = len(split["filenames"])
        sizes = split.get("shard_bytes", [None] * n)
        hashes = split.get("shard_sha256", [None] * n)
        seen: set[str] = set()
        for entry in zip(split["filenames"], split["shard_lengths"], sizes, hashes):
            problems += check_shard(location, ShardEntry(*entry), num_classes, seen, decode)
    return problems


def _thumbnails(location: str, info: dict, count: int) -> list[tuple[Image.Image, str]]:
    """Up to `count` (thumbnail, caption) from the first split's readable shards; damaged ones are passed over."""
    split = next(iter(info["splits"].values()))
    names = info.get("class_names") or []
    tiles: list[tuple[Image.Image, str]] = []
    for filename in split["filenames"]:
        samples: dict[str, dict[str, bytes]] = {}
        try:
            with urls.open_url(shard_url(location, filename)) as stream:
                for sample in tar_scan.samples(tar_scan.TarReader(stream), _THUMB_MEMBERS):
                    samples[sample.key] = sample.data
                    if len(samples) > count:
                        break
        except (tar_scan.TarDamaged, OSError):
            pass
        for key, files in samples.items():
            ext = image_member(files)
            try:
                img = Image.open(io.BytesIO(files[ext])).convert("RGB") if ext else None
            except (OSError, ValueError, SyntaxError):
                continue
            label = sample_label(files)
            if img is None:
                continue
            img.thumbnail((THUMB, THUMB))
            text = f"{label} {names[label]}" if 0 <= label < len(names) else ("unlabelled" if label < 0 else str(label))
            tiles.append((img, f"{key}\n{text}"[:40]))
            if len(tiles) >= count:
                return tiles
    return tiles


def sample_grid(location: str, info: dict, count: int, path: Path) -> int:
    """Write a PNG grid of the first `count` samples of the first split, each with its label; returns how many."""
    tiles = _thumbnails(location, info, count)
    cols = min(8, max(1, len(tiles)))
    rows = max(1, -(-len(tiles) // cols))
    cell_h = THUMB + 28
    grid = Image.new("RGB", (cols * THUMB, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, (img, text) in enumerate(tiles):
        x, y = (i % cols) * THUMB, (i // cols) * cell_h
        grid.paste(img, (x + (THUMB - img.width) // 2, y + (THUMB - img.height) // 2))
        draw.multiline_text((x + 2, y + THUMB + 1), text, fill=(0, 0, 0))
    try:
        grid.save(path)
    except OSError as e:
        raise UserError(f"cannot write the grid to {path}: {e.strerror or e}") from None
    return len(tiles)


def inspect(location: str, grid: str | None = None, samples: int = 32, verify_shards: bool = True,
            decode: bool = False) -> int:
    """Print the summary of the shard set at `location` (a folder or URL, or its manifest's `.json` file), verify
    every shard (unless not `verify_shards`; with `decode`, every image decoded too), write a grid of `samples` images
    to `grid` (default: OUT/_samples.png; none when `samples` is 0); returns the exit status."""
    info = read_manifest(location)
    check_manifest(info, manifest_file(location))
    base = shard_base(location, info)  # where the shards are: the manifest's `location` field, else its folder
    console = Console()
    table = Table(title=f"{location} ({info.get('tool_version', '?')})")
    for column in ("split", "samples", "shards", "min/max per shard", "MiB"):
        table.add_column(column, justify="right" if column != "split" else "left")
    for name, split in info["splits"].items():
        lengths = split["shard_lengths"] or [0]
        mib = sum(b for b in split.get("shard_bytes", []) if isinstance(b, int)) / 2**20
        table.add_row(name, f"{sum(split['shard_lengths']):,}", str(len(split["filenames"])),
                      f"{min(lengths)}/{max(lengths)}", f"{mib:,.1f}")
    console.print(table)
    source = info.get("source") if isinstance(info.get("source"), dict) else {}
    reasons = info.get("failure_reasons") if isinstance(info.get("failure_reasons"), dict) else {}
    where = source.get("path") or " ".join(str(x) for x in source.get("location") or [])
    seed = f"seed {info['seed']}; " if info.get("seed") is not None else ""  # an indexed set has none
    console.print(f"classes: {info.get('num_classes', 0)}; source: {source.get('kind', '?')} {where}; {seed}"
                  f"failures: {info.get('num_failures', 0)} {', '.join(f'{k} {v}' for k, v in reasons.items())}",
                  highlight=False)
    status = 0
    if verify_shards:
        problems = verify(base, info, decode)
        for problem in problems:
            console.print(f"[red]problem:[/red] {problem}", highlight=False)
        checked = "matches the manifest" + (" and every image decodes" if decode else "")
        console.print(f"verified: every shard {checked}" if not problems else f"{len(problems)} problem(s)")
        status = 1 if problems else 0
    if samples:
        default = Path(urls.local_path(base)) / "_samples.png" if urls.is_local(base) else Path("_samples.png")
        path = Path(grid) if grid else default
        shown = sample_grid(base, info, samples, path)
        console.print(f"wrote a grid of {shown} samples to {path}")
    return status
