"""Build webdataset shards and their manifest from a folder of images.

    build-shards SOURCE OUT_DIR [--val-fraction 0.1] [--shard-size 1000] [--max-side 512] [--seed 0]

SOURCE is a folder with one sub-folder per class. OUT_DIR receives `train-000000.tar ...`, `val-000000.tar ...`,
`_info.json` (the manifest; timm's `wds/` schema, extended) and `failures.jsonl` (inputs skipped, with reasons).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from common.manifest import MANIFEST_NAME, write_manifest
from data_tools.images import BadImage, EncodeSettings, prepare_image
from data_tools.sources import Item, image_folder
from data_tools.writer import ShardWriter

TOOL_VERSION = "0.1.0"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="build-shards", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("source", help="folder with one sub-folder of images per class")
    p.add_argument("out_dir", help="output folder for the shards and _info.json")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction of images held out for the val split")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    p.add_argument("--max-side", type=int, default=512,
                   help="re-encode images whose longer side exceeds this (0: never)")
    p.add_argument("--min-side", type=int, default=8, help="skip images whose shorter side is below this")
    p.add_argument("--quality", type=int, default=90, help="JPEG/WebP quality when re-encoding")
    p.add_argument("--format", choices=["jpg", "png", "webp"], default="jpg", help="format when re-encoding")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle before sharding")
    p.add_argument("--overwrite", action="store_true", help="replace an existing build in OUT_DIR")
    return p.parse_args(argv)


def write_split(name: str, items: list[Item], out_dir: Path, shard_size: int, settings: EncodeSettings,
                failures: list[dict], progress: Progress, task) -> dict:
    """Write one split's shards; returns its manifest entry."""
    filenames, lengths, sizes, hashes = [], [], [], []
    for shard_index, start in enumerate(range(0, len(items), shard_size)):
        filename = f"{name}-{shard_index:06d}.tar"
        writer = ShardWriter(out_dir / filename)
        for offset, item in enumerate(items[start:start + shard_size]):
            try:
                data, ext, w, h = prepare_image(item.read(), settings)
            except (BadImage, OSError) as e:
                failures.append({"source": item.source_id, "split": name, "reason": str(e)})
                progress.advance(task)
                continue
            key = f"{name}_{start + offset:08d}"
            meta = {"source": item.source_id, "label": item.label, "width": w, "height": h}
            files = {ext: data}
            if item.label >= 0:
                files["cls"] = str(item.label).encode()
            files["json"] = json.dumps(meta, sort_keys=True).encode()
            writer.write(key, files)
            progress.advance(task)
        count, size, digest = writer.close()
        filenames.append(filename)
        lengths.append(count)
        sizes.append(size)
        hashes.append(digest)
    return {"name": name, "num_samples": sum(lengths), "filenames": filenames, "shard_lengths": lengths,
            "shard_bytes": sizes, "shard_sha256": hashes}


def build(args: argparse.Namespace) -> dict:
    out_dir = Path(args.out_dir)
    if (out_dir / MANIFEST_NAME).exists() and not args.overwrite:
        raise FileExistsError(f"{out_dir} already holds a build ({MANIFEST_NAME}); pass --overwrite to replace it")
    items, classes = image_folder(args.source)
    if not items:
        raise ValueError(f"no images found under {args.source}")
    random.Random(args.seed).shuffle(items)
    n_val = int(round(len(items) * args.val_fraction))
    splits = {"train": items[n_val:], "val": items[:n_val]}
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = EncodeSettings(max_side=args.max_side, min_side=args.min_side, quality=args.quality,
                              format=args.format)
    failures: list[dict] = []
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn())
    with Progress(*columns, transient=not sys.stderr.isatty()) as progress:
        task = progress.add_task("building shards", total=len(items))
        entries = {name: write_split(name, split_items, out_dir, args.shard_size, settings, failures, progress, task)
                   for name, split_items in splits.items() if split_items}
    elapsed = time.perf_counter() - start
    with open(out_dir / "failures.jsonl", "w") as f:
        for rec in failures:
            f.write(json.dumps(rec) + "\n")
    info = {
        "name": Path(args.source).name,
        "splits": entries,
        "num_classes": len(classes),
        "class_names": classes,
        "source": {"kind": "image_folder", "path": str(args.source), "num_inputs": len(items)},
        "seed": args.seed,
        "encoder": {"max_side": args.max_side, "min_side": args.min_side, "quality": args.quality,
                    "format": args.format},
        "num_failures": len(failures),
        "tool_version": TOOL_VERSION,
    }
    write_manifest(out_dir, info)  # the commit point: a build without it is incomplete
    written = sum(e["num_samples"] for e in entries.values())
    shards = sum(len(e["filenames"]) for e in entries.values())
    per_split = ", ".join(f"{k}: {v['num_samples']}" for k, v in entries.items())
    print(f"wrote {written} samples in {shards} shards to {out_dir} ({per_split}); skipped {len(failures)}; "
          f"{written / max(elapsed, 1e-9):.0f} img/s")
    return info


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        build(args)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
