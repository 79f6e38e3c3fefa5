"""Build webdataset shards and their manifest from images, on one machine or many; resume; merge; inspect.

    build-shards SOURCE OUT [--val-fraction 0.1 | --existing-splits] [--shard-size 1000] [--shard-bytes 0]
                 [--max-side 512] [--resize-side longer] [--workers N] [--seed 0] [--overwrite]
                 [--num-parts N --part I] [--executor local|ray] [--dry-run]
    build-shards merge OUT
    build-shards inspect OUT [--grid samples.png] [--no-verify]

SOURCE is a class-folder tree, a plain tree of images (`--source-kind unlabelled`), a CSV/JSONL list of paths
(local or an fsspec URL), or a Hugging Face dataset (`--streaming`: read from its parquet files without a full
download); see data_tools/sources.py. OUT is a folder or an fsspec URL (`s3://bucket/shards`). It receives
`train-000000.tar ...`, `val-000000.tar ...` (named by range), `_info.json` (the manifest and commit point; timm's
`wds/` schema, extended), `failures.jsonl` (inputs not used, with reasons) and `_journal*.jsonl` (finished ranges,
for resuming). Re-running the same command after an interruption finishes the build; docs/build_shards.md has the
details.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from data_tools.executors import BuildStopped, LocalExecutor, RayExecutor, require_ray
from data_tools.images import EncodeSettings
from data_tools.journal import Journal, fingerprint, intact, is_journal, journal_name, last_is_whole, read_journals
from data_tools.merge import FAILURES_NAME, LISTING_FAILURES_NAME, finalize, summary
from data_tools.plan import Layout, Parts, RangeRef, SplitPlan, iter_ranges, num_ranges, plan_splits
from data_tools.shard_ranges import RangeTask, WorkContext
from data_tools.sources import KINDS, UNLABELLED_ROWS, Source, SourceError, SourceSpec, open_source
from data_tools.store import LocalStore, OutputError, RemoteStore, open_store
from vit_mpp import __version__, urls
from vit_mpp.cli import run_main
from vit_mpp.errors import UserError
from vit_mpp.manifest import MANIFEST_NAME

EXECUTORS = ("local", "ray")
ONE_MACHINE = Parts(0, 1)


class UsageError(UserError):
    """A bad command line (unknown flag, bad value); one line."""


class Interrupted(BuildStopped):
    """Ctrl-C (SIGINT) or SIGTERM: the build stopped; finished shards are kept."""

    status = 130


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a one-line `error: ...` (exit 2) like every other user mistake."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


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
    p = Parser(prog="build-shards", description=__doc__.split("\n\n")[0],
               epilog="`build-shards merge --help` and `build-shards inspect --help` describe the other commands; "
                      "docs/build_shards.md has the details.", formatter_class=HelpFormatter)
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
        (args.num_parts < 1, "--num-parts must be >= 1"),
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


# ---------------------------------------------------------------- progress

class SpeedColumn(ProgressColumn):
    """Images per second."""

    def render(self, task) -> Text:
        return Text(f"{task.speed or 0:,.0f} img/s")


def progress_bar() -> Progress:
    """Rate and ETA while it runs, in a terminal; nothing in logs (the closing lines give the totals)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    SpeedColumn(), TimeRemainingColumn(), refresh_per_second=4, transient=True,
                    disable=not sys.stdout.isatty())


# ---------------------------------------------------------------- planning

def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def list_source(spec: SourceSpec, workdir: Path, seed: int) -> Source:
    """List SOURCE into a catalog under `workdir`, with a progress bar for lists (bytes read, rate, ETA)."""
    start = time.perf_counter()
    size = 0
    if urls.is_local(spec.path) and os.path.isfile(spec.path):
        size = os.path.getsize(spec.path)
    with progress_bar() as progress:
        bar = progress.add_task(f"listing {spec.path}", total=size or None)

        def show(rows: int, done: int) -> None:
            progress.update(bar, completed=done if size else rows, description=f"listing: {rows:,} inputs")

        source = open_source(spec, workdir, seed, show)
    failed = source.failures.count
    note = f" ({failed:,} not usable, see {FAILURES_NAME} at the end)" if failed else ""
    print(f"listed {source.num_inputs:,} inputs{note} in {time.perf_counter() - start:.1f} s")
    return source


class Plan:
    """What every machine computes the same: splits, sizes, the fingerprint and the manifest's fixed fields."""

    def __init__(self, source: Source, spec: SourceSpec, layout: Layout, encode: EncodeSettings) -> None:
        self.source, self.layout = source, layout
        order = sorted(source.catalog.split_names) if source.kind == "list" else list(source.catalog.split_names)
        splits = plan_splits(source.catalog, layout, ordered=source.ordered)
        if layout.existing_splits:
            splits.sort(key=lambda s: order.index(s.name))
        self.splits: dict[str, SplitPlan] = {s.name: s for s in splits}
        if not self.splits:
            raise SourceError(f"no images found in {spec.path}")
        self.sizes = {name: s.size for name, s in self.splits.items()}
        self.base = {"name": Path(str(spec.path).rstrip("/")).name, "num_classes": len(source.class_names),
                     "class_names": source.class_names, "source": source.describe(), **layout.to_dict(),
                     "encoder": encode.to_dict(), "num_unlabelled": source.num_unlabelled,
                     "tool_version": __version__}
        self.fingerprint = fingerprint(source.catalog.digest,
                                       {**self.base, "unlabelled_rows": spec.unlabelled_rows})

    def ranges(self, parts: Parts) -> list[RangeRef]:
        return [r for r in iter_ranges(self.sizes, self.layout.shard_size) if parts.owns(r.number)]

    def task(self, r: RangeRef) -> RangeTask:
        rows = self.splits[r.split].catalog_rows(r.start, r.end)
        return RangeTask(r.split, r.index, r.start, self.source.items(rows), self.layout.shard_bytes)

    def header(self, parts: Parts, listing: dict) -> dict:
        return {"type": "build", "fingerprint": self.fingerprint, "part": parts.index, "num_parts": parts.count,
                "splits": self.sizes, "manifest": self.base, "listing_failures": listing}


def describe_plan(plan: Plan, parts: Parts) -> str:
    """The --dry-run report."""
    per_split = ", ".join(f"{name} {size:,} inputs in {num_ranges(size, plan.layout.shard_size):,} ranges"
                          for name, size in plan.sizes.items())
    mine = plan.ranges(parts)
    part = f"part {parts.index} of {parts.count}: " if parts.count > 1 else ""
    return (f"plan: {per_split}; {part}{len(mine):,} ranges, {sum(r.end - r.start for r in mine):,} inputs; "
            f"fingerprint {plan.fingerprint[:16]}")


# ---------------------------------------------------------------- OUT's state

SHARD_NAME = re.compile(r"^[A-Za-z0-9_]+-\d{6,}(-\d{4,})?\.tar(\.tmp)?$")  # ours, or of build-shards 0.3


def our_files(sizes: dict[str, int]) -> list[str]:
    """Files of a build in OUT (what --overwrite deletes on one machine): shards and their temporaries, journals,
    reports. Other files (a user's own tars in the same folder) are never touched."""
    names = {MANIFEST_NAME, FAILURES_NAME, LISTING_FAILURES_NAME}
    return sorted(n for n in sizes if SHARD_NAME.match(n) or n.removesuffix(".tmp") in names
                  or is_journal(n.removesuffix(".tmp")))


def prepare_out(store: LocalStore | RemoteStore, plan: Plan, parts: Parts, overwrite: bool,
                ) -> tuple[dict | None, dict[str, int]]:
    """Check what OUT holds; with `overwrite`, delete what this run replaces. Returns (the manifest when OUT already
    holds this very build, the listing of OUT)."""
    sizes = store.list_sizes()
    journals = read_journals(store, sizes)
    foreign = [n for n, (h, _) in journals.items() if h is None or h["fingerprint"] != plan.fingerprint]
    if overwrite:
        if parts.count == 1:
            store.delete(our_files(sizes))
        else:
            store.delete([n for n in (MANIFEST_NAME, FAILURES_NAME, journal_name(parts), *foreign) if n in sizes])
        return None, store.list_sizes()
    if MANIFEST_NAME in sizes:
        try:
            info = json.loads(store.read_text(MANIFEST_NAME) or "")
        except json.JSONDecodeError:
            info = {}
        if isinstance(info, dict) and info.get("fingerprint") == plan.fingerprint:
            return info, sizes
        raise OutputError(f"{store} holds a finished build of other inputs or settings; pass --overwrite to "
                          "replace it")
    if foreign:
        raise OutputError(f"{store} holds (part of) a build of other inputs or settings ({foreign[0]}); pass "
                          "--overwrite to replace it")
    if not journals and [n for n in sizes if SHARD_NAME.match(n) or n == FAILURES_NAME]:
        raise OutputError(f"{store} holds files of another build; pass --overwrite to replace them")
    return None, sizes


# ---------------------------------------------------------------- building

class Committer:
    """Publishes the shards of finished ranges and journals each range once all of its shards are published: at
    once for a local OUT (a rename), in background threads for a remote one (uploads)."""

    def __init__(self, store: LocalStore | RemoteStore, journal: Journal, threads: int,
                 on_commit: Callable[[dict], None]) -> None:
        self.store, self.journal, self.on_commit = store, journal, on_commit
        self.pending: dict[Future, dict] = {}
        self.limit = 2 * threads  # uploads in flight at most (each in its own thread)

    def _publish(self, record: dict) -> None:
        for shard in record["shards"]:
            if "tmp" in shard:
                self.store.publish(shard["tmp"], shard["filename"])

    def _commit(self, record: dict) -> None:
        for shard in record["shards"]:
            shard.pop("tmp", None)
        self.journal.append(record)
        self.on_commit(record)

    def add(self, record: dict) -> None:
        if self.store.local or not any("tmp" in s for s in record["shards"]):
            self._publish(record)
            self._commit(record)
            return
        future: Future = Future()

        def upload() -> None:
            try:
                self._publish(record)
                future.set_result(None)
            except BaseException as e:  # handed to poll()
                future.set_exception(e)

        # A daemon thread: after Ctrl-C or an error the process exits at once; an upload cut short is not journaled.
        threading.Thread(target=upload, daemon=True, name="upload").start()
        self.pending[future] = record

    def room(self) -> bool:
        return len(self.pending) < self.limit

    def poll(self, timeout: float = 0.0) -> None:
        """Journal the ranges whose uploads finished; an upload that failed every attempt stops the build."""
        if not self.pending:
            return
        done, _ = wait(self.pending, timeout=timeout, return_when=FIRST_COMPLETED)
        for future in done:
            record = self.pending.pop(future)
            try:
                future.result()
            except OSError as e:
                names = ", ".join(s["filename"] for s in record["shards"])
                raise BuildStopped(f"uploading {names} to {self.store} failed after {urls.RETRIES + 1} attempts: "
                                   f"{' '.join(str(e).split())}. Finished shards are kept: re-run the same command "
                                   "to continue") from None
            self._commit(record)

    def drain(self) -> None:
        while self.pending:
            self.poll(timeout=0.25)



def run_ranges(plan: Plan, store: LocalStore | RemoteStore, todo: list[RangeRef], journal: Journal,
               encode: EncodeSettings, workers: int, executor: str, resumed: int, total: int) -> tuple[int, float]:
    """Write the ranges `todo`, journaling each as it completes; returns (workers used, seconds)."""
    ctx = WorkContext(plan.source.reader, encode)
    workers = max(1, min(workers, len(todo)))
    finished = [0]
    start = time.perf_counter()
    runner = RayExecutor(ctx, store) if executor == "ray" else LocalExecutor(ctx, store.staging(), workers)
    committer = Committer(store, journal, workers, lambda rec: finished.__setitem__(0, finished[0] + 1))
    tasks = (plan.task(r) for r in todo)
    try:
        with runner, progress_bar() as progress:
            bar = progress.add_task("building shards", total=total, completed=resumed)

            def idle() -> None:
                committer.poll()
                progress.update(bar, completed=resumed + runner.processed())

            for record in runner.results(tasks, committer.room, idle):
                committer.add(record)
            committer.drain()
            idle()
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted after {finished[0]:,} of the {len(todo):,} ranges left to write; finished "
                          "ranges are kept: re-run the same command to resume") from None
    finally:
        try:
            journal.flush()  # remote OUT: what finished is journaled even when the build stops
        except OSError:
            if sys.exc_info()[0] is None:
                raise
    return workers, time.perf_counter() - start


def build(source: SourceSpec, out: str, layout: Layout, encode: EncodeSettings, workers: int, *,
          executor: str = "local", parts: Parts = ONE_MACHINE, overwrite: bool = False, dry_run: bool = False,
          ) -> dict | None:
    """Build (or finish building) OUT from SOURCE, or this machine's part of it. Returns the manifest; None for a
    part of a build still waiting for others (or a dry run)."""
    store = open_store(out)
    if urls.is_local(source.path) and os.path.isdir(source.path) and store.local and _inside(out, source.path):
        raise OutputError(f"OUT {out} is inside SOURCE {source.path}: its files would become inputs of the next "
                          "run; choose an output folder outside SOURCE")
    if layout.existing_splits != source.existing_splits:
        raise ValueError("Layout.val_fraction is None exactly when SourceSpec.existing_splits is set")
    if executor == "ray":
        require_ray()  # before anything is written
    if not dry_run:
        store.check()
    with tempfile.TemporaryDirectory(prefix="build-shards-") as workdir:
        try:
            listed = list_source(source, Path(workdir), layout.seed)
            plan = Plan(listed, source, layout, encode)
        except UserError:
            store.undo_check()  # a mistake in SOURCE or the options: OUT is left as it was
            raise
        try:
            if dry_run:
                print(describe_plan(plan, parts))
                return None
            return _build(plan, store, encode, workers, executor, parts, overwrite)
        finally:
            listed.close()
            store.cleanup()


def _build(plan: Plan, store: LocalStore | RemoteStore, encode: EncodeSettings, workers: int, executor: str,
           parts: Parts, overwrite: bool) -> dict | None:
    complete, sizes = prepare_out(store, plan, parts, overwrite)
    if complete is not None:
        print(f"{store} is already complete ({MANIFEST_NAME}); pass --overwrite to build it again")
        return complete
    name = journal_name(parts)
    journals = {} if overwrite else read_journals(store, sizes)
    own = [r for r in journals.get(name, (None, []))[1] if intact(r, sizes)]
    if own and not last_is_whole(store, own[-1]):
        own.pop()
    done = {(r["split"], r["range"]) for r in own}
    for journal_file, (_, records) in journals.items():
        if journal_file != name:
            done |= {(r["split"], r["range"]) for r in records if intact(r, sizes)}
    mine = plan.ranges(parts)
    todo = [r for r in mine if (r.split, r.index) not in done]
    failures = plan.source.failures.path.read_text(encoding="utf-8")
    listing = {"count": plan.source.failures.count, "sha256": plan.source.failures.hash.hexdigest()}
    journal = Journal(store, name)
    journal.start(plan.header(parts, listing), own)
    if parts.index == 0:
        store.write_text(LISTING_FAILURES_NAME, failures)
    total = sum(r.end - r.start for r in mine)
    resumed = total - sum(r.end - r.start for r in todo)
    if resumed:
        print(f"resuming: {resumed:,} of {total:,} inputs{' of this part' if parts.count > 1 else ''} are in "
              f"{len(mine) - len(todo):,} finished ranges")
    if executor == "local" and 1 < len(todo) < 2 * workers and total - resumed >= 5000:
        print(f"note: {len(todo)} shards to write with {workers} workers; a smaller --shard-size gives the "
              "workers more equal shares")
    if todo:
        used, elapsed = run_ranges(plan, store, todo, journal, encode, workers, executor, resumed, total)
        rate = (total - resumed) / max(elapsed, 1e-9)
        who = f"{used} worker(s)" if executor == "local" else "Ray"
        print(f"throughput: {rate:,.0f} img/s with {who} ({rate / max(used, 1):,.0f} img/s per worker), "
              f"{elapsed:.1f} s")
    if parts.count > 1:
        print(f"part {parts.index} of {parts.count} is done: {len(mine):,} ranges, {total:,} inputs; run "
              f"`build-shards merge {store.url}` once every part is done")
        return None
    info = finalize(store, plan.fingerprint)
    print(summary(info, store.url))
    return info


# ---------------------------------------------------------------- command line

def _main(argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "inspect":
        from data_tools.inspect_shards import main as inspect_main

        status = inspect_main(argv[1:])
        if status:
            sys.exit(status)
        return
    if argv and argv[0] == "merge":
        from data_tools.merge import main as merge_main

        merge_main(argv[1:])
        return
    args = parse_args(argv)
    spec = SourceSpec(args.source, args.source_kind, args.existing_splits, args.split, args.image_column,
                      args.label_column, args.streaming, args.unlabelled_rows, args.allow_outside_paths)
    val_fraction = None if args.existing_splits else (0.1 if args.val_fraction is None else args.val_fraction)
    layout = Layout(args.seed, val_fraction, args.shard_size, args.shard_bytes)
    encode = EncodeSettings(max_side=args.max_side, min_side=args.min_side, quality=args.quality, format=args.format,
                            resize_side=args.resize_side, max_pixels=args.max_pixels)
    build(spec, args.out_dir, layout, encode, args.workers, executor=args.executor,
          parts=Parts(args.part, args.num_parts), overwrite=args.overwrite, dry_run=args.dry_run)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler preempting the job) stops the build as Ctrl-C does


def main(argv: list[str] | None = None) -> None:
    """`build-shards`: user mistakes end in one line and exit status 2 (vit_mpp.cli.run_main); a build that stops
    for another reason (a worker died, an upload kept failing: 1; Ctrl-C or SIGTERM: 130) in one line too, saying
    that re-running the same command resumes it. Anything else is a bug and keeps its traceback."""
    previous = signal.signal(signal.SIGTERM, _terminate) if _in_main_thread() else None
    try:
        run_main(_main, argv)
    except KeyboardInterrupt:
        print("error: interrupted; finished shards are kept: re-run the same command to resume", file=sys.stderr)
        sys.exit(Interrupted.status)
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
