"""The `build-shards` command line (parsing, signals, exit statuses): build webdataset shards and their manifest from
images, on one machine or many, resume, and the sub-commands `merge OUT`, `inspect OUT`, `index LOCATION ...` and
`subset SOURCE OUT`.
The build itself is data_tools/builder/build_shards.py `build`; no module of data_tools imports this one.
See docs/build_shards.md.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from PIL import Image

from data_tools import inspect_shards
from data_tools import subset as subset_shards
from data_tools.builder import merge
from data_tools.builder.build_shards import BuildOptions, build
from data_tools.builder.shard_layout import Parts, ShardLayout
from data_tools.builder.sources.base import REPEATED_ROWS, UNLABELLED_ROWS, SourceSpec
from data_tools.builder.sources.registry import KINDS
from data_tools.indexer import index_tars as index_shards
from data_tools.indexer.index_tars import IndexOptions
from data_tools.stops import BuildStopped
from data_tools.store import open_store
from vit_mpp.cli import ArgumentParser
from vit_mpp.data import urls
from vit_mpp.data.image_prep import EncodeSettings
from vit_mpp.data.urls import ReadPolicy
from vit_mpp.processes.exits import run_main
from vit_mpp.tools.args import check_out_file

EXECUTORS = ("local", "ray")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none worth showing or its help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, "") or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def default_workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 8))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="build-shards", description=__doc__.split("\n\n")[0],
                       epilog="`build-shards merge --help`, `build-shards inspect --help`, `build-shards index --help` "
                              "and `build-shards subset --help` describe the other commands; docs/build_shards.md has "
                              "the details.",
                       formatter_class=HelpFormatter)
    p.add_argument("source", help="class-folder tree, image tree, .csv/.jsonl/.parquet list of paths (a path or a "
                                  "URL), or Hugging Face dataset (save_to_disk folder, parquet, image folder, hub "
                                  "name)")
    p.add_argument("out_dir", help="output folder or fsspec URL (s3://bucket/prefix) for the shards and _info.json")
    g = p.add_argument_group("source")
    g.add_argument("--source-kind", choices=KINDS, default="auto",
                   help="auto: .csv/.jsonl, or .parquet with a 'path' column -> list; save_to_disk folder, parquet "
                        "dataset, or a hub name (owner/name) -> hf; other folders -> folder (one sub-folder per class)")
    g.add_argument("--existing-splits", action="store_true",
                   help="use the source's own splits (sub-folders of SOURCE, the list's 'split' column, or the HF "
                        "dataset's splits) instead of --val-fraction")
    g.add_argument("--val-fraction", type=float, default=None,
                   help="fraction of inputs held out for the val split (default 0.1; not with --existing-splits)")
    g.add_argument("--split", default=None,
                   help="HF split(s) to read, comma-separated (default: train; all with --existing-splits)")
    g.add_argument("--image-column", default="", help="HF image column (default: 'image', else the first Image column)")
    g.add_argument("--label-column", default="label", help="HF label column ('' for unlabelled)")
    g.add_argument("--streaming", action="store_true",
                   help="HF: read the dataset's parquet files where they are (local or on the Hub), row group by "
                        "row group, instead of loading it; files are shuffled with the seed, rows keep their order")
    g.add_argument("--unlabelled-rows", choices=UNLABELLED_ROWS, default="error",
                   help="a labelled list or HF dataset with some rows unlabelled: error (refuse), skip (leave them "
                        "out, listed in failures.jsonl) or keep (write them without .cls: for pretraining only)")
    g.add_argument("--repeated-rows", choices=REPEATED_ROWS, default="error",
                   help="list rows naming a path an earlier row names (also spelled otherwise, ./a or a//b): error "
                        "(refuse), skip (write each path once, with its first row's label; the others in "
                        "failures.jsonl) or keep (write every row; a repeated image can land in train and val)")
    g.add_argument("--allow-outside-paths", action="store_true",
                   help="let list rows name absolute paths, URLs or paths above the list's folder (refused by "
                        "default: a list reads files inside its own folder)")
    g = p.add_argument_group("layout")
    g.add_argument("--seed", type=int, default=0, help="seed of the shuffle before sharding")
    g.add_argument("--shard-size", type=int, default=1000,
                   help="inputs per shard at most; shards of a split are balanced by count (0: no count limit, "
                        "shards of up to 10000 inputs cut by --shard-bytes)")
    g.add_argument("--shard-bytes", type=int, default=0,
                   help="also split a shard once it holds this many bytes (0: no limit)")
    g = p.add_argument_group("images")
    g.add_argument("--max-side", type=int, default=512,
                   help="resize images whose --resize-side side exceeds this (0: never)")
    g.add_argument("--resize-side", choices=["longer", "shorter"], default="longer",
                   help="which side --max-side limits")
    g.add_argument("--min-side", type=int, default=8, help="skip images whose shorter side is below this")
    g.add_argument("--max-pixels", type=int, default=100_000_000,
                   help="skip images with more pixels than this (decompression bombs)")
    g.add_argument("--quality", type=int, default=90, help="JPEG/WebP quality when re-encoding (1-100)")
    g.add_argument("--format", choices=["jpg", "png", "webp"], default="jpg", help="format when re-encoding")
    g = p.add_argument_group("running")
    g.add_argument("--workers", type=int, default=default_workers(),
                   help="local executor: processes, each writing whole shards")
    g.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local: --workers processes on this machine; ray: one Ray task per shard range on the "
                        "cluster ray.init() finds (RAY_ADDRESS), needs the [ray] extra")
    g.add_argument("--num-parts", type=int, default=1,
                   help="split the build into this many parts, each run separately (any scheduler: a SLURM array, "
                        "a Kubernetes indexed Job); then `build-shards merge OUT`")
    g.add_argument("--part", type=int, default=0, help="which part this run builds: 0 to --num-parts - 1")
    g.add_argument("--plan-parts", type=int, default=0, help="a list SOURCE of many files: deal them into this many "
                   "plan parts, each planned (shuffled, split) on its own, so a part lists only its own files")
    g.add_argument("--overwrite", action="store_true",
                   help="replace another or an unfinished build in OUT (with parts: this part's files only)")
    g.add_argument("--dry-run", action="store_true", help="list and plan, print the plan, write nothing")
    args = p.parse_args(argv)
    checks = [
        (args.shard_size < 0 or args.shard_bytes < 0 or (args.shard_size == 0 and args.shard_bytes == 0),
         "--shard-size and --shard-bytes must be >= 0, and one of them > 0"),
        (args.val_fraction is not None and args.existing_splits,
         "--val-fraction and --existing-splits exclude each other"),
        (args.val_fraction is not None and not 0 <= args.val_fraction < 1, "--val-fraction must be in [0, 1)"),
        (args.workers < 1, "--workers must be >= 1"),
        (args.num_parts < 1 or args.plan_parts < 0, "--num-parts must be >= 1 and --plan-parts >= 0"),
        (not 0 <= args.part < max(args.num_parts, 1),
         f"--part must be in 0..{args.num_parts - 1} (--num-parts {args.num_parts})"),
        (args.max_side < 0, "--max-side must be >= 0"),
        (args.min_side < 1, "--min-side must be >= 1"),
        (args.max_pixels < 1, "--max-pixels must be >= 1"),
        (not 1 <= args.quality <= 100, "--quality must be in 1..100"),
    ]
    for bad, message in checks:
        if bad:
            p.error(message)
    return args


def parse_merge_args(argv: list[str]) -> argparse.Namespace:
    """`build-shards merge OUT`."""
    p = ArgumentParser(prog="build-shards merge", description=merge.__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="the OUT of the parts (a folder or a URL)")
    return p.parse_args(argv)


def parse_inspect_args(argv: list[str]) -> argparse.Namespace:
    """`build-shards inspect OUT [--grid PNG] [--samples N] [--no-verify] [--decode]`."""
    p = ArgumentParser(prog="build-shards inspect", description=inspect_shards.__doc__.split("\n\n")[0],
                       formatter_class=HelpFormatter)
    p.add_argument("out_dir", help="a build-shards output folder or URL")
    p.add_argument("--grid", default=None, help="PNG grid of sample images (default: OUT/_samples.png)")
    p.add_argument("--samples", type=int, default=32, help="images in the grid (0: no grid)")
    p.add_argument("--no-verify", action="store_true", help="skip reading every shard (sha256, counts, keys, labels)")
    p.add_argument("--decode", action="store_true",
                   help="also decode every sample's image and report undecodable ones per shard (as build-shards "
                        "index --verify)")
    args = p.parse_args(argv)
    if args.samples < 0:
        p.error("--samples must be >= 0")
    if args.decode and args.no_verify:
        p.error("--decode reads every shard: it excludes --no-verify")
    if args.grid and args.samples:  # checked now: the grid is drawn after every shard is read
        check_out_file(args.grid, "--grid")
        if Path(args.grid).suffix.lower() not in Image.registered_extensions():
            p.error(f"--grid {args.grid}: give an image file name (.png, .jpg, ...)")
    return args


def parse_index_args(argv: list[str]) -> argparse.Namespace:
    """`build-shards index LOCATION [LOCATION ...] [--split NAME ...] [--out DIR] [--verify] [--skip-bad] ...`."""
    p = ArgumentParser(prog="build-shards index", description=index_shards.__doc__.split("\n\n")[0],
                       epilog="docs/build_shards.md (Indexing shards you already have) has the details.",
                       formatter_class=HelpFormatter)
    p.add_argument("locations", nargs="+", metavar="LOCATION",
                   help="a folder of .tar shards (local, or a URL: s3://, gs://, hf://datasets/..., http(s)://), one "
                        ".tar, or a brace pattern such as 's3://bucket/laion/{00000..01023}.tar' (quote it)")
    p.add_argument("--split", action="append", default=None, metavar="NAME",
                   help="the split of the LOCATIONs: once for all (default: train), or once per LOCATION in the "
                        "same order (e.g. --split train --split val)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write _info.json into DIR (a folder or URL; or a .json file) instead of beside the shards, "
                        "with a 'location' field naming the shards' folder: for read-only or remote shards")
    p.add_argument("--verify", action="store_true",
                   help="also decode every image (PIL, in the workers) and report undecodable ones per shard")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out damaged or non-tar files, recorded in the manifest with their reason (default: "
                        "one error line, nothing written)")
    p.add_argument("--workers", type=int, default=index_workers(), help="shards read at the same time")
    p.add_argument("--pool", choices=index_shards.POOLS, default="auto",
                   help="workers as processes (parsing and --verify's decoding use every core) or threads (reads "
                        "release the GIL); 'auto' is processes")
    p.add_argument("--reader", choices=("auto", "python", "compiled"), default="auto",
                   help="no effect: shards are counted by the Python reader ('compiled', a tar walker in numba, "
                        "was removed: it was under 2x faster; docs/benchmarks.md)")
    p.add_argument("--read-timeout", type=float, default=urls.READ_TIMEOUT_S, metavar="S",
                   help="a remote read that brings no byte for this long is abandoned and retried")
    p.add_argument("--read-retries", type=int, default=urls.READ_RETRIES, metavar="N",
                   help="attempts after a remote read failed or stalled, with backoff from 1 s, before the shard is "
                        "reported")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an _info.json that build-shards index did not write (a build's, timm's own)")
    args = p.parse_args(argv)
    checks = [(args.workers < 1, "--workers must be >= 1"),
              (args.reader == "compiled", "--reader compiled: the compiled tar walker was removed (with default "
               "workers it indexed a 3.4 GB local set 1.2x faster from disk and 1.9x from the page cache: "
               "docs/benchmarks.md); leave --reader out, the Python reader counts every shard"),
              (not 0 < args.read_timeout < math.inf, "--read-timeout must be > 0 and finite"),
              (args.read_retries < 0, "--read-retries must be >= 0")]
    for bad, message in checks:
        if bad:
            p.error(message)
    return args


def index_workers() -> int:
    """Reading is I/O bound: twice the usable cores (at least 4, at most 32) keep disks and networks busy."""
    return max(4, min(32, 2 * default_workers()))


def index_main(argv: list[str]) -> dict:
    """`build-shards index`: a manifest for existing webdataset tars; returns it."""
    args = parse_index_args(argv)
    read = ReadPolicy(timeout=args.read_timeout, retries=args.read_retries)
    options = IndexOptions(workers=args.workers, pool=args.pool, verify=args.verify, skip_bad=args.skip_bad,
                           overwrite=args.overwrite, read=read)
    return index_shards.index(args.locations, args.split, args.out, options)


def parse_subset_args(argv: list[str]) -> argparse.Namespace:
    """`build-shards subset SOURCE OUT --per-class K [--seed S] [--split NAME] [--overwrite]`."""
    p = ArgumentParser(prog="build-shards subset", description=subset_shards.__doc__.split("\n\n")[0],
                       epilog="docs/build_shards.md (Subsets: a few labels of each class) has the details.",
                       formatter_class=HelpFormatter)
    p.add_argument("source", metavar="SOURCE", help="a labelled shard set (a build-shards output or an indexed one)")
    p.add_argument("out", type=Path, metavar="OUT", help="a new or empty folder for the subset's shards and manifest")
    p.add_argument("--per-class", type=int, required=True, metavar="K", help="samples drawn of each class")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed: the same seed, the same samples")
    p.add_argument("--split", default="train", metavar="NAME", help="the split drawn from (the others are named in "
                   "the new manifest where they are, not copied)")
    p.add_argument("--shard-size", type=int, default=subset_shards.SHARD_SIZE, help="samples per written shard")
    p.add_argument("--overwrite", action="store_true", help="draw again into an OUT that holds a subset")
    p.add_argument("--exclude", action="append", default=[], metavar="SUBSET",
                   help="a subset drawn before from the same SOURCE and split whose samples are not drawn again (a "
                   "validation set apart from the training labels); may be given more than once")
    p.add_argument("--read-timeout", type=float, default=urls.READ_TIMEOUT_S, metavar="S",
                   help="a remote read that brings no byte for this long is abandoned and retried")
    p.add_argument("--read-retries", type=int, default=urls.READ_RETRIES, metavar="N",
                   help="attempts after a remote read failed or stalled, with backoff from 1 s")
    args = p.parse_args(argv)
    problems = subset_shards.number_problems(args.per_class, args.seed, args.shard_size)
    problems += [message for bad, message in (
        (not 0 < args.read_timeout < math.inf, f"--read-timeout must be > 0 and finite, got {args.read_timeout}"),
        (args.read_retries < 0, f"--read-retries must be >= 0, got {args.read_retries}")) if bad]
    if problems:
        p.error(problems[0])  # one line: the first of them
    return args


def subset_main(argv: list[str]) -> dict:
    """`build-shards subset`: K labelled samples of each class as a shard set of their own; returns its manifest."""
    args = parse_subset_args(argv)
    read = ReadPolicy(timeout=args.read_timeout, retries=args.read_retries)
    options = subset_shards.SubsetOptions(args.split, args.overwrite, args.shard_size, read, tuple(args.exclude))
    return subset_shards.subset(args.source, args.out, args.per_class, args.seed, options)


def merge_main(argv: list[str]) -> dict:
    """`build-shards merge OUT`: finish a build made of parts; returns the manifest."""
    args = parse_merge_args(argv)
    info = merge.finalize(open_store(args.out_dir))
    merge.conclude(info, args.out_dir)
    return info


def inspect_main(argv: list[str]) -> int:
    """`build-shards inspect OUT`: returns the exit status (1 when a shard does not match the manifest)."""
    args = parse_inspect_args(argv)
    return inspect_shards.inspect(args.out_dir, args.grid, args.samples, verify_shards=not args.no_verify,
                                  decode=args.decode)


def _main(argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "inspect":
        status = inspect_main(argv[1:])
        if status:
            sys.exit(status)
        return
    if argv and argv[0] == "merge":
        merge_main(argv[1:])
        return
    if argv and argv[0] == "index":
        index_main(argv[1:])
        return
    if argv and argv[0] == "subset":
        subset_main(argv[1:])
        return
    args = parse_args(argv)
    spec = SourceSpec(args.source, args.source_kind, args.existing_splits, args.split, args.image_column,
                      args.label_column, args.streaming, unlabelled_rows=args.unlabelled_rows,
                      repeated_rows=args.repeated_rows, allow_outside_paths=args.allow_outside_paths)
    val_fraction = None if args.existing_splits else (0.1 if args.val_fraction is None else args.val_fraction)
    layout = ShardLayout(args.seed, val_fraction, args.shard_size, args.shard_bytes, args.plan_parts)
    encode = EncodeSettings(max_side=args.max_side, min_side=args.min_side, quality=args.quality, format=args.format,
                            resize_side=args.resize_side, max_pixels=args.max_pixels)
    build(spec, args.out_dir, layout, encode,
          BuildOptions(args.workers, args.executor, Parts(args.part, args.num_parts), args.overwrite, args.dry_run))


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler preempting the job) stops the build as Ctrl-C does


def main(argv: list[str] | None = None) -> None:
    """`build-shards`: user mistakes end in one line and exit status 2 (vit_mpp/processes/exits.py `run_main`); a
    build that stops for another reason (a worker died, an upload kept failing: 1; Ctrl-C or SIGTERM: 130) in one
    line too, saying that re-running the same command resumes it. Anything else is a bug and keeps its traceback."""
    previous = signal.signal(signal.SIGTERM, _terminate) if _in_main_thread() else None
    try:
        run_main(_main, argv, interrupted="interrupted; finished shards are kept: re-run the same command to resume")
    except BuildStopped as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.status)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    main()
