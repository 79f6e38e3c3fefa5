"""Building shards: list SOURCE into a catalog, plan it, check what OUT holds, write this machine's ranges with an
executor while the committer publishes and journals each one, and (on one machine) merge. `build` is the whole of
`build-shards SOURCE OUT` (the command line is data_tools/cli.py); re-running the same command after an
interruption resumes from the journal. See docs/build_shards.md#one-machine.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from data_tools.builder.build_plan import BuildPlan
from data_tools.builder.committer import Committer
from data_tools.builder.executors import LocalExecutor, RayExecutor, require_ray
from data_tools.builder.journal import Journal, intact, journal_name, last_is_whole, read_journals
from data_tools.builder.merge import FAILURES_NAME, check_written, conclude, finalize
from data_tools.builder.out_state import prepare_out
from data_tools.builder.plan_parts import PlannedBuild
from data_tools.builder.shard_layout import ONE_MACHINE, Parts, RangeRef, ShardLayout
from data_tools.builder.shard_ranges import WorkContext
from data_tools.builder.sources.base import Source, SourceSpec
from data_tools.builder.sources.registry import open_source
from data_tools.scratch import scratch, sweep_stale
from data_tools.stops import STOP_SIGNALS, Interrupted
from data_tools.store import LocalStore, OutputError, RemoteStore, open_store
from vit_mpp.data import urls
from vit_mpp.data.image_prep import EncodeSettings
from vit_mpp.data.manifest import MANIFEST_NAME
from vit_mpp.errors import UserError
from vit_mpp.processes.signal_handlers import deferred
from vit_mpp.progress import progress
from vit_mpp.tools.args import folder_role

SETTLE_S = 60.0  # a build stopping on an error waits this long for the shards being published to be journaled


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def list_source(spec: SourceSpec, workdir: Path, seed: int) -> Source:
    """List SOURCE into a catalog under `workdir`, with a progress bar for lists (bytes read, rate, ETA)."""
    start = time.perf_counter()
    size = 0
    if urls.is_local(spec.path) and os.path.isfile(spec.path):
        size = os.path.getsize(spec.path)
    with progress(f"listing {spec.path}", size or None, "bytes" if size else "inputs") as shown:

        def show(rows: int, done: int) -> None:
            shown.update(completed=done if size else rows, description=f"listing: {rows:,} inputs")

        source = open_source(spec, workdir, seed, show)
    note = listing_note(source.failures.count, source.num_repeated)
    print(f"listed {source.num_inputs:,} inputs{note} in {time.perf_counter() - start:.1f} s")
    return source


def listing_note(failed: int, repeated: int) -> str:
    """What the `listed ...` line adds: inputs not usable, and rows kept although they repeat a path."""
    notes = [f"{failed:,} not usable, see {FAILURES_NAME} at the end"] if failed else []
    if repeated:
        notes.append(f"{repeated:,} repeating an earlier row's path, kept by --repeated-rows keep")
    return f" ({'; '.join(notes)})" if notes else ""


def list_plan_parts(spec: SourceSpec, layout: ShardLayout, encode: EncodeSettings, parts: Parts,
                    workdir: Path) -> PlannedBuild:
    """List the plan parts this part owns (--plan-parts) and plan them, with a progress bar."""
    start = time.perf_counter()
    with progress(f"listing {spec.path}", None, "inputs") as shown:

        def show(rows: int, done: int) -> None:
            shown.update(completed=rows, description=f"listing: {rows:,} inputs")

        plan = PlannedBuild(spec, layout, encode, parts, workdir, show)
    note = listing_note(plan.listing_failure_count, sum(p.source.num_repeated for p in plan.owned.values()))
    files = sum(len(plan.files[g]) for g in plan.owned)
    print(f"listed {plan.num_inputs:,} inputs{note} from {files:,} of {sum(map(len, plan.files)):,} list files "
          f"({len(plan.owned)} of {layout.plan_parts} plan parts) in {time.perf_counter() - start:.1f} s")
    return plan


def make_plan(spec: SourceSpec, layout: ShardLayout, encode: EncodeSettings, parts: Parts,
              workdir: Path) -> BuildPlan | PlannedBuild:
    """List SOURCE (all of it, or with --plan-parts the plan parts this part owns) and plan the build."""
    if layout.plan_parts:
        return list_plan_parts(spec, layout, encode, parts, workdir)
    listed = list_source(spec, workdir, layout.seed)
    try:
        plan = BuildPlan(listed, spec, layout, encode)
    except BaseException:
        listed.close()
        raise
    if parts.count > 1 and listed.kind == "list" and listed.details.get("files", 1) > 1:
        print(f"note: every part lists all {listed.details['files']:,} list files; --plan-parts N gives each part "
              "only its own files (see docs/build_shards.md)")
    return plan


@dataclass(frozen=True)
class BuildOptions:
    """How a build runs (the command line's): its workers, who runs the ranges, this machine's part, and whether OUT
    may be built again."""

    workers: int = 1
    executor: str = "local"  # or "ray"
    parts: Parts = ONE_MACHINE
    overwrite: bool = False
    dry_run: bool = False


@dataclass
class Build:
    """A build in flight: its plan, where it writes, how images are encoded, and its options."""

    plan: BuildPlan | PlannedBuild
    store: LocalStore | RemoteStore
    encode: EncodeSettings
    options: BuildOptions


def run_ranges(b: Build, todo: list[RangeRef], journal: Journal, resumed: int, total: int) -> tuple[int, float]:
    """Write the ranges `todo`, journaling each as it completes; returns (workers used, seconds)."""
    plan, store, encode, executor = b.plan, b.store, b.encode, b.options.executor
    ctx = WorkContext(plan.reader, encode)
    workers = max(1, min(b.options.workers, len(todo)))
    finished = [0]
    start = time.perf_counter()
    runner = RayExecutor(ctx, store) if executor == "ray" else LocalExecutor(ctx, store.staging(), workers)
    committer = Committer(store, journal, workers, lambda rec: finished.__setitem__(0, finished[0] + 1))
    tasks = (plan.task(r) for r in todo)
    try:  # Ctrl-C and SIGTERM raise at run_pending(), between waits, not inside a wait's lock
        with deferred(STOP_SIGNALS) as run_pending, runner, \
                progress("building shards", total, "images", completed=resumed) as shown:

            def idle(timeout: float = 0.0) -> None:
                run_pending()
                committer.poll(timeout)
                shown.update(completed=resumed + runner.processed())

            try:
                for record in runner.results(tasks, committer.room, idle):
                    committer.add(record)
            except Exception:
                committer.settle(SETTLE_S)
                run_pending()  # workers ended by the stop signal this process was sent too: the stop is told
                raise
            while committer.pending:  # the last publications
                idle(0.25)
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


def build(source: SourceSpec, out: str, layout: ShardLayout, encode: EncodeSettings,
          options: BuildOptions) -> dict | None:
    """Build (or finish building) OUT from SOURCE, or this machine's part of it. Returns the manifest; None for a
    part of a build still waiting for others (or a dry run)."""
    store = open_store(out)
    if urls.is_local(source.path) and os.path.isdir(source.path) and store.local and _inside(out, source.path):
        raise OutputError(f"OUT {out} is inside SOURCE {source.path}: its files would become inputs of the next "
                          "run; choose an output folder outside SOURCE")
    if store.local and (role := folder_role(store.path, shards=False)):  # shards among a model's or a run's files
        raise OutputError(f"OUT {out} is {role}: give the shards a folder of their own")
    if layout.existing_splits != source.existing_splits:
        raise ValueError("ShardLayout.val_fraction is None exactly when SourceSpec.existing_splits is set")
    parts, dry_run = options.parts, options.dry_run
    if options.executor == "ray":
        require_ray()  # before anything is written
    if not dry_run:
        store.check()
    removed, size = (0, 0) if dry_run else sweep_stale()
    if removed:
        print(f"removed {removed} scratch folder(s) of killed builds from {tempfile.gettempdir()} "
              f"({size / 1e6:,.1f} MB)")
    with scratch("work") as workdir:
        try:
            plan = make_plan(source, layout, encode, parts, workdir)
        except UserError:
            store.undo_check()  # a mistake in SOURCE or the options: OUT is left as it was
            raise
        try:
            if dry_run:
                print(plan.describe(parts))
                return None
            return _build(Build(plan, store, encode, options))
        finally:
            plan.close()
            store.cleanup()


def _key(record: dict) -> tuple[int | None, str, int]:
    """A journaled range's (plan part or None, split, range), as RangeRef.key."""
    return record.get("group"), record["split"], record["range"]


def _build(b: Build) -> dict | None:
    plan, store, parts, overwrite = b.plan, b.store, b.options.parts, b.options.overwrite
    workers, executor = b.options.workers, b.options.executor
    complete, sizes = prepare_out(store, plan.fingerprint, parts, overwrite)
    if complete is not None:
        print(f"{store} is already complete ({MANIFEST_NAME}); pass --overwrite to build it again")
        check_written(complete, store.url)
        return complete
    name = journal_name(parts)
    journals = {} if overwrite else read_journals(store, sizes)
    header, records = journals.get(name, (None, []))
    own = [r for r in records if intact(r, sizes) and plan.accepts(header, r)]
    if own and not last_is_whole(store, own[-1]):
        own.pop()
    done = {_key(r) for r in own}
    for journal_file, (header, records) in journals.items():
        if journal_file != name:
            done |= {_key(r) for r in records if intact(r, sizes) and plan.accepts(header, r)}
    mine = plan.ranges(parts)
    todo = [r for r in mine if r.key not in done]
    journal = Journal(store, name)
    journal.start(plan.header(parts), own)
    for listing_name, text in plan.listing_failures(parts).items():
        store.write_text(listing_name, text)
    total = sum(r.end - r.start for r in mine)
    resumed = total - sum(r.end - r.start for r in todo)
    if resumed:
        print(f"resuming: {resumed:,} of {total:,} inputs{' of this part' if parts.count > 1 else ''} are in "
              f"{len(mine) - len(todo):,} finished ranges")
    if executor == "local" and 1 < len(todo) < 2 * workers and total - resumed >= 5000:
        print(f"note: {len(todo)} shards to write with {workers} workers; a smaller --shard-size gives the "
              "workers more equal shares")
    if todo:
        used, elapsed = run_ranges(b, todo, journal, resumed, total)
        rate = (total - resumed) / max(elapsed, 1e-9)
        who = f"{used} worker(s)" if executor == "local" else "Ray"
        print(f"throughput: {rate:,.0f} img/s with {who} ({rate / max(used, 1):,.0f} img/s per worker), "
              f"{elapsed:.1f} s")
    if parts.count > 1:
        print(f"part {parts.index} of {parts.count} is done: {len(mine):,} ranges, {total:,} inputs; run "
              f"`build-shards merge {store.url}` once every part is done")
        return None
    info = finalize(store, plan.fingerprint)
    conclude(info, store.url)
    return info

