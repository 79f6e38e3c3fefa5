"""Build webdataset shards and their manifest from images; resume an interrupted build; inspect a finished one.

    build-shards SOURCE OUT_DIR [--val-fraction 0.1 | --existing-splits] [--shard-size 1000] [--shard-bytes 0]
                 [--max-side 512] [--resize-side longer] [--workers N] [--seed 0] [--overwrite]
    build-shards inspect OUT_DIR [--grid samples.png] [--no-verify]

SOURCE is a class-folder tree, a plain tree of images (`--source-kind unlabelled`), a CSV/JSONL list of paths,
or a Hugging Face dataset (see data_tools/sources.py). OUT_DIR receives `train-000000.tar ...`,
`val-000000.tar ...`, `_info.json` (the manifest and commit point; timm's `wds/` schema, extended),
`failures.jsonl` (inputs skipped, with reasons) and `_journal.jsonl` (finished shards, for resuming).
Re-running the same command after an interruption finishes the build; docs/build_shards.md has the details.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

from common.errors import UserError
from common.manifest import MANIFEST_NAME, write_manifest
from data_tools.images import EncodeSettings
from data_tools.journal import JOURNAL_NAME, Journal, fingerprint, verified_records
from data_tools.shard_ranges import RangeTask, init_worker, plan_ranges, whole_ranges, write_range
from data_tools.sources import KINDS, Item, Source, SourceError, open_source

TOOL_VERSION = "0.3.0"
FAILURES_NAME = "failures.jsonl"


def default_workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 8))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="build-shards", description=__doc__.split("\n\n")[0],
                                epilog="`build-shards inspect OUT_DIR --help` describes the inspect command.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("source", help="class-folder tree, image tree, .csv/.jsonl list, or Hugging Face dataset")
    p.add_argument("out_dir", help="output folder for the shards and _info.json")
    p.add_argument("--source-kind", choices=KINDS, default="auto",
                   help="auto: .csv/.jsonl -> list; save_to_disk folder, parquet, or a hub name (owner/name) "
                        "-> hf; other folders -> folder (one sub-folder per class)")
    p.add_argument("--existing-splits", action="store_true",
                   help="use the source's own splits (sub-folders of SOURCE, the list's 'split' column, or the HF "
                        "dataset's splits) instead of --val-fraction")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction of images held out for the val split")
    p.add_argument("--split", default=None,
                   help="HF split(s) to read, comma-separated (default: train; all with --existing-splits)")
    p.add_argument("--image-column", default="", help="HF image column (default: 'image' or the first Image column)")
    p.add_argument("--label-column", default="label", help="HF label column ('' for unlabelled)")
    p.add_argument("--shard-size", type=int, default=1000,
                   help="inputs per shard at most; shards of a split are balanced by count (0: no count limit, "
                        "shards of up to 10000 inputs cut by --shard-bytes)")
    p.add_argument("--shard-bytes", type=int, default=0,
                   help="also split a shard once it holds this many bytes (0: no limit)")
    p.add_argument("--max-side", type=int, default=512,
                   help="resize images whose --resize-side side exceeds this (0: never)")
    p.add_argument("--resize-side", choices=["longer", "shorter"], default="longer",
                   help="which side --max-side limits")
    p.add_argument("--min-side", type=int, default=8, help="skip images whose shorter side is below this")
    p.add_argument("--max-pixels", type=int, default=100_000_000,
                   help="skip images with more pixels than this (decompression bombs)")
    p.add_argument("--quality", type=int, default=90, help="JPEG/WebP quality when re-encoding")
    p.add_argument("--format", choices=["jpg", "png", "webp"], default="jpg", help="format when re-encoding")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle before sharding")
    p.add_argument("--workers", type=int, default=default_workers(), help="processes; each writes whole shards")
    p.add_argument("--overwrite", action="store_true", help="delete an existing or unfinished build in OUT_DIR first")
    args = p.parse_args(argv)
    if args.shard_size < 0 or args.shard_bytes < 0 or (args.shard_size == 0 and args.shard_bytes == 0):
        p.error("--shard-size and --shard-bytes must be >= 0, and one of them > 0")
    if not 0 <= args.val_fraction < 1:
        p.error("--val-fraction must be in [0, 1)")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


# ---------------------------------------------------------------- planning, journal, resume

def plan_splits(source: Source, val_fraction: float, seed: int) -> dict[str, list[Item]]:
    """Seeded global shuffle, then the split: by --val-fraction, or the source's own splits (each shuffled)."""
    if "" in source.splits:
        items = list(source.splits[""])
        random.Random(seed).shuffle(items)
        n_val = int(round(len(items) * val_fraction))
        splits = {"train": items[n_val:], "val": items[:n_val]}
    else:
        splits = {}
        for name, split_items in source.splits.items():
            items = list(split_items)
            random.Random(f"{seed}/{name}").shuffle(items)
            splits[name] = items
    return {k: v for k, v in splits.items() if v}


def our_files(out_dir: Path) -> list[Path]:
    """Files a build writes into OUT_DIR (what --overwrite deletes): shards, temporaries, journal, reports."""
    names = {MANIFEST_NAME, JOURNAL_NAME, FAILURES_NAME, MANIFEST_NAME + ".tmp", JOURNAL_NAME + ".tmp",
             FAILURES_NAME + ".tmp"}
    return sorted(p for p in out_dir.iterdir()
                  if p.is_file() and (p.name in names or p.name.endswith((".tar", ".tar.tmp"))))


# ---------------------------------------------------------------- building

class SpeedColumn(ProgressColumn):
    """Images per second."""

    def render(self, task) -> Text:
        return Text(f"{task.speed or 0:,.0f} img/s")


def ranges_to_write(splits: dict[str, list[Item]], done: dict[str, list[dict]], shard_size: int,
                    ) -> list[tuple[str, int, int]]:
    """(split, start, end) of the ranges still to write, split by split; `done` (per split, the journal's records)
    is cut back to whole ranges, in place."""
    todo = []
    for name, items in splits.items():
        ranges = plan_ranges(len(items), shard_size)
        done[name] = whole_ranges(done[name], ranges)
        covered = done[name][-1]["end"] if done[name] else 0
        todo += [(name, a, b) for a, b in ranges if a >= covered]
    return todo


class WorkerDied(RuntimeError):
    """A worker process ended abruptly (killed, out of memory, a crash in a decoder)."""


def written_in_order(pool: ProcessPoolExecutor, tasks: Iterator[RangeTask], window: int,
                     idle: Callable[[], None]) -> Iterator[list[dict]]:
    """`write_range` results for `tasks`, in task order (shard names and the journal follow the ranges).

    At most `window` ranges are submitted ahead, so only a few ranges' item lists are copied and pickled at a
    time; `idle` runs every quarter second while the next result is awaited. A worker that dies raises
    `WorkerDied` instead of leaving the build waiting forever (what multiprocessing.Pool does).
    """
    tasks = iter(tasks)
    pending: collections.deque[tuple[RangeTask, Future]] = collections.deque()
    while True:
        while len(pending) < window and (task := next(tasks, None)) is not None:
            pending.append((task, pool.submit(write_range, task)))
        if not pending:
            return
        task, future = pending[0]
        try:
            while True:
                try:
                    parts = future.result(timeout=0.25)
                    break
                except FuturesTimeout:
                    idle()
        except BrokenProcessPool:
            raise WorkerDied(
                f"a worker process died while writing one of {len(pending)} ranges in flight (the first: "
                f"{task.split} inputs {task.start}-{task.end - 1}); killed for memory, or a crash in an image decoder. "
                "Finished shards are kept: re-run the same command to continue") from None
        pending.popleft()
        yield parts


def commit_range(parts: list[dict], records: list[dict], out_dir: Path, journal: Journal) -> None:
    """Give a finished range's tars their final names (next in the split's numbering) and journal them."""
    index = sum(1 for r in records if r["filename"] is not None)
    committed = []
    for part in parts:
        tmp, filename = part.pop("tmp"), None
        if tmp is not None:  # None: every input of this part failed, so no (empty) shard
            filename = f"{part['split']}-{index:06d}.tar"
            os.replace(out_dir / tmp, out_dir / filename)
            index += 1
        committed.append({**part, "filename": filename})
    journal.append(committed)
    records += committed


def split_entry(name: str, records: list[dict]) -> dict:
    """The manifest's entry for one split (timm's schema plus shard_bytes and shard_sha256)."""
    shards = [r for r in records if r["filename"] is not None]
    return {"name": name, "num_samples": sum(r["count"] for r in shards), "filenames": [r["filename"] for r in shards],
            "shard_lengths": [r["count"] for r in shards], "shard_bytes": [r["bytes"] for r in shards],
            "shard_sha256": [r["sha256"] for r in shards]}


def build(args: argparse.Namespace) -> dict:
    """Build (or finish building) OUT_DIR from SOURCE; returns the manifest."""
    out_dir = Path(args.out_dir)
    if args.overwrite and out_dir.is_dir():
        for path in our_files(out_dir):
            path.unlink()
    split_arg = args.split if args.split is not None else ("" if args.existing_splits else "train")
    source = open_source(args.source, args.source_kind, existing_splits=args.existing_splits, split=split_arg,
                         image_column=args.image_column, label_column=args.label_column or None)
    splits = plan_splits(source, args.val_fraction, args.seed)
    if not splits:
        raise SourceError(f"no images found in {args.source}")
    settings = EncodeSettings(max_side=args.max_side, min_side=args.min_side, quality=args.quality,
                              format=args.format, resize_side=args.resize_side, max_pixels=args.max_pixels)
    layout = {"seed": args.seed, "val_fraction": None if args.existing_splits else args.val_fraction,
              "existing_splits": args.existing_splits, "shard_size": args.shard_size,
              "shard_bytes": args.shard_bytes}
    build_id = fingerprint(source, splits, {**layout, "encoder": settings.to_dict()})

    out_dir.mkdir(parents=True, exist_ok=True)
    journal = Journal(out_dir)
    previous, records = journal.read()
    if previous is not None and previous != build_id:
        raise FileExistsError(f"{out_dir} holds a build of other inputs or settings; pass --overwrite to replace it")
    if previous is None and [p for p in our_files(out_dir) if not p.name.endswith(".tmp")]:
        raise FileExistsError(f"{out_dir} holds files of another build; pass --overwrite to replace them")
    if previous == build_id and (out_dir / MANIFEST_NAME).exists():
        print(f"{out_dir} is already complete ({MANIFEST_NAME}); pass --overwrite to build it again")
        return json.loads((out_dir / MANIFEST_NAME).read_text())
    done: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in verified_records(out_dir, records):
        done[rec["split"]].append(rec)
    todo = ranges_to_write(splits, done, args.shard_size)
    records = [r for name in splits for r in done[name]]
    journal.start(build_id, records)
    for tmp in out_dir.glob("*.tar.tmp"):  # shards that were being written when the last run stopped
        tmp.unlink()
    total = sum(len(v) for v in splits.values())
    resumed = sum(r["end"] - r["start"] for r in records)
    if resumed:
        print(f"resuming: {resumed} of {total} inputs are in {sum(r['filename'] is not None for r in records)} "
              "finished shards")
    if 1 < len(todo) < 2 * args.workers and total - resumed >= 5000:
        print(f"note: {len(todo)} shards to write with {args.workers} workers; a smaller --shard-size gives the "
              "workers more equal shares")

    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), SpeedColumn(),
               TimeRemainingColumn())
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    processed = ctx.Value("q", 0)  # inputs processed by the workers, for the progress bar
    workers = max(1, min(args.workers, len(todo)))
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker,
                               initargs=(source.reader, settings, out_dir, processed, os.getpid()))
    try:
        pool.submit(os.getpid).result()  # fork the workers now, before the progress bar starts its thread
        with Progress(*columns, refresh_per_second=4, transient=not sys.stderr.isatty()) as progress:
            bar = progress.add_task("building shards", total=total, completed=resumed)

            def show_progress() -> None:
                progress.update(bar, completed=resumed + processed.value)

            tasks = (RangeTask(name, a, splits[name][a:b], args.shard_bytes) for name, a, b in todo)
            for parts in written_in_order(pool, tasks, window=2 * workers, idle=show_progress):
                commit_range(parts, done[parts[0]["split"]], out_dir, journal)
            show_progress()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on an error or Ctrl-C: no new ranges, running ones end
    all_records = {name: done[name] for name in splits}
    elapsed = time.perf_counter() - start

    failures = [f for recs in all_records.values() for r in recs for f in r["failures"]]
    tmp = out_dir / (FAILURES_NAME + ".tmp")
    with open(tmp, "w") as f:
        for rec in failures:
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, out_dir / FAILURES_NAME)
    entries = {name: split_entry(name, recs) for name, recs in all_records.items()}
    info = {
        "name": Path(str(args.source).rstrip("/")).name,
        "splits": entries,
        "num_classes": len(source.class_names),
        "class_names": source.class_names,
        "source": source.describe(),
        **layout,
        "encoder": settings.to_dict(),
        "num_failures": len(failures),
        "failure_reasons": dict(sorted(collections.Counter(f["reason"] for f in failures).items())),
        "tool_version": TOOL_VERSION,
    }
    write_manifest(out_dir, info)  # the commit point: a build without it is incomplete
    written = sum(e["num_samples"] for e in entries.values())
    shards = sum(len(e["filenames"]) for e in entries.values())
    per_split = ", ".join(f"{k}: {v['num_samples']}" for k, v in entries.items())
    reasons = ", ".join(f"{k} {v}" for k, v in info["failure_reasons"].items())
    rate = (total - resumed) / max(elapsed, 1e-9)
    print(f"wrote {written} samples in {shards} shards to {out_dir} ({per_split}); "
          f"skipped {len(failures)}{f' ({reasons}; see {FAILURES_NAME})' if failures else ''}")
    print(f"throughput: {rate:,.0f} img/s with {workers} worker(s) ({rate / workers:,.0f} img/s per worker)"
          f", {elapsed:.1f} s")
    return info


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "inspect":
            from data_tools.inspect_shards import main as inspect_main

            sys.exit(inspect_main(argv[1:]))
        build(parse_args(argv))
    except (FileNotFoundError, FileExistsError, ValueError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except WorkerDied as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
