"""A manifest for webdataset tars that already exist (img2dataset output, timm's `*-wds` sets, your own), so they
train without being written again: `build-shards index LOCATION [LOCATION ...]` (`index`). The LOCATIONs are listed
(find_tars.py), every shard is read once by `--workers` (count_shard.py), and every problem is one line before
anything is written. See docs/build_shards.md#indexing-shards-you-already-have.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import time
import urllib.error
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from data_tools.decode_check import KeyTally
from data_tools.indexer.count_shard import DAMAGED, ShardIndex, index_shard, init_worker
from data_tools.indexer.find_tars import (
    IndexInputError,
    Placement,
    ShardRef,
    folder_of,
    list_shards,
    place_manifest,
    split_names,
)
from data_tools.stops import STOP_SIGNALS, Interrupted, WorkerDied
from data_tools.store import open_store
from vit_mpp import __version__
from vit_mpp.data import urls
from vit_mpp.data.image_formats import IMAGE_EXTENSIONS
from vit_mpp.data.manifest import manifest_file, write_manifest_url
from vit_mpp.data.urls import ReadPolicy
from vit_mpp.errors import UserError
from vit_mpp.processes.signal_handlers import deferred
from vit_mpp.progress import progress
from vit_mpp.tools.args import check_writable_place

POOLS = ("auto", "process", "thread")  # auto: processes (parsing and --verify's decoding hold the GIL)

SHOWN = 10  # problem lines printed per kind; the manifest has them all


class ShardProblem(UserError):
    """A shard that cannot be indexed (damaged, missing, unreadable); one line naming it."""


@dataclass(frozen=True)
class IndexOptions:
    """The options of `build-shards index` other than LOCATIONs, splits and --out."""

    workers: int = 4
    pool: str = "auto"  # POOLS
    verify: bool = False
    skip_bad: bool = False
    overwrite: bool = False
    read: ReadPolicy = ReadPolicy()


def check_output(place: Placement, overwrite: bool) -> None:
    """Refuse, before any shard is read, an output that cannot be written or whose `_info.json` this would replace
    without being an index manifest itself (a build-shards manifest, timm's own) unless --overwrite."""
    target = manifest_file(place.out)
    local = urls.is_local(place.out)
    if local:
        check_writable_place("--out", Path(place.out), Path(place.out).parent if place.out.endswith(".json")
                             else Path(place.out))
    try:
        text = urls.read_url(target).decode("utf-8")
    except (FileNotFoundError, NotADirectoryError):
        text = None
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise IndexInputError(f"cannot read {target}: HTTP {e.code} {e.reason}") from None
        text = None
    except OSError as e:
        raise IndexInputError(f"cannot read {target}: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError:
        text = ""
    if text is not None and not overwrite and not _is_index(text):
        raise IndexInputError(f"{target} exists and was not written by `build-shards index`: --overwrite replaces "
                              "it, or --out DIR writes the new manifest elsewhere")
    if not local:  # a probe object, deleted at once: the only way to know that a bucket is writable
        open_store(folder_of(place.out) if place.out.endswith(".json") else place.out).check()


def _is_index(text: str) -> bool:
    try:
        info = json.loads(text)
    except ValueError:
        return False
    return isinstance(info, dict) and info.get("indexed") is True


def _context() -> Any:
    """fork where there is one (workers start in milliseconds, as data_tools/builder/executors.py's), else spawn."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _pool(options: IndexOptions, workers: int, counter: Any, stop: Any) -> Executor:
    """Worker processes (parsing and --verify's decoding on every core), or threads (reads release the GIL)."""
    if options.pool == "thread":
        return ThreadPoolExecutor(workers, initializer=init_worker, initargs=(counter, stop, False))
    return ProcessPoolExecutor(workers, mp_context=_context(), initializer=init_worker, initargs=(counter, stop, True))


def _refuse(result: ShardIndex) -> ShardProblem:
    if result.problem == DAMAGED:
        return ShardProblem(f"shard {result.url}: {result.reason}; nothing was written (--skip-bad leaves damaged "
                            "shards out and records them in the manifest)")
    what = "missing" if result.problem == "missing" else "cannot be read"
    return ShardProblem(f"shard {result.url} {what}: {result.reason}; nothing was written")


def read_shards(shards: list[ShardRef], options: IndexOptions, show: Callable[[int, int, int], None],
                ) -> list[ShardIndex]:
    """Every shard's `ShardIndex`, in `shards` order, read by the workers; the first shard that cannot be used (a
    damaged one only without --skip-bad) stops the others and is raised as one line."""
    counter, stop = _context().Value("q", 0), _context().Value("b", 0)  # bytes read; set: workers stop
    workers = max(1, min(options.workers, len(shards)))
    results: dict[str, ShardIndex] = {}
    todo = iter(shards)
    pending: dict[Future, ShardRef] = {}
    try:
        with deferred(STOP_SIGNALS) as run_pending:  # Ctrl-C raises at run_pending(), not in wait()'s lock
            pool = _pool(options, workers, counter, stop)
            try:
                while True:
                    while len(pending) < 2 * workers and (ref := next(todo, None)) is not None:
                        pending[pool.submit(index_shard, ref.url, options.verify, options.read)] = ref
                    if not pending:
                        break
                    done, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                    run_pending()
                    for future in done:
                        ref, result = pending.pop(future), future.result()
                        if result.problem and not (options.skip_bad and result.problem == DAMAGED):
                            raise _refuse(result)
                        results[ref.url] = result
                    show(len(results), len(shards), counter.value)
            except BrokenProcessPool:
                run_pending()  # its workers ended by the stop signal this process was sent too: the stop is told
                raise WorkerDied("a worker process died while reading shards (killed for memory, or a crash in an "
                                 "image decoder); nothing was written") from None
            finally:
                stop.value = 1  # running reads stop at their next chunk (or deadline), not at the end of the shard
                pool.shutdown(wait=True, cancel_futures=True)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; nothing was written") from None
    return [results[s.url] for s in shards]


def _problems(place: Placement, refs: list[ShardRef], results: list[ShardIndex], attr: str) -> list[dict]:
    out = []
    for ref, r in zip(refs, results):
        tally: KeyTally | None = getattr(r, attr)
        if tally is not None and tally.count:
            out.append({"shard": place.names[ref.url], "count": tally.count, "keys": tally.keys,
                        **({"reason": tally.reason} if tally.reason else {})})
    return out


def split_entry(name: str, place: Placement, refs: list[ShardRef], results: list[ShardIndex], verify: bool) -> dict:
    """One split of the manifest: timm's fields, then per-shard bytes, image extensions and problem samples."""
    images: Counter = sum((r.images for r in results), Counter())
    entry: dict[str, Any] = {
        "name": name, "num_samples": sum(r.samples for r in results),
        "filenames": [place.names[ref.url] for ref in refs], "shard_lengths": [r.samples for r in results],
        "shard_bytes": [r.bytes for r in results],
        "image_extensions": {e: images[e] for e in IMAGE_EXTENSIONS if images[e]},
        "num_without_image": sum(r.no_image.count for r in results),
        "without_image": _problems(place, refs, results, "no_image"),
    }
    if verify:
        entry["num_undecodable"] = sum(r.undecodable.count for r in results if r.undecodable is not None)
        entry["undecodable"] = _problems(place, refs, results, "undecodable")
    bad_labels = _problems(place, refs, results, "bad_label")
    if bad_labels:
        entry["num_bad_labels"], entry["bad_labels"] = sum(p["count"] for p in bad_labels), bad_labels
    return entry


def build_manifest(locations: list[str], location_splits: list[str], shards: list[ShardRef],
                   results: list[ShardIndex], place: Placement, options: IndexOptions) -> dict:
    """The manifest: timm's `name` and `splits`, classes when labelled, where the shards are, what was left out."""
    splits: dict[str, Any] = {}
    good = [(ref, r) for ref, r in zip(shards, results) if not r.problem]
    for name in dict.fromkeys(s.split for s in shards):
        refs = [ref for ref, _ in good if ref.split == name]
        if not refs:
            raise ShardProblem(f"split '{name}': every shard is damaged; nothing was written")
        splits[name] = split_entry(name, place, refs, [r for ref, r in good if ref.split == name], options.verify)
        if not splits[name]["num_samples"]:
            raise ShardProblem(f"split '{name}': its {len(refs)} shard(s) hold no samples; nothing was written")
    info: dict[str, Any] = {"name": os.path.basename(folder_of(shards[0].url)) or "shards", "splits": splits}
    labelled = [r for _, r in good if r.labelled]
    if labelled:
        top = max(r.label_max for r in labelled)
        # no class_names: labels are all the shards hold, and names "0" .. "K-1" would say nothing (and run to
        # millions of strings for one stray large label); everything that shows names falls back to the index
        info.update(num_classes=top + 1, label_range=[min(r.label_min for r in labelled), top],
                    num_unlabelled=sum(r.samples - r.labelled for _, r in good))
        for name, entry in splits.items():  # per split too: fine-tuning checks the splits it reads before it starts
            entry["num_unlabelled"] = sum(r.samples - r.labelled for ref, r in good if ref.split == name)
    if place.location is not None:
        info["location"] = place.location
    info["indexed"] = True
    info["source"] = {"kind": "index", "location": locations, "split": location_splits, "verified": options.verify}
    bad = [{"split": ref.split, "shard": ref.url, "reason": r.reason} for ref, r in zip(shards, results) if r.problem]
    info["num_bad_shards"], info["bad_shards"] = len(bad), bad
    info["tool_version"] = __version__
    return info


def _lines(label: str, entries: list[tuple[str, str]]) -> list[str]:
    """`label: shard: what` lines, the first SHOWN of them and a count of the rest."""
    lines = [f"{label}: {shard}: {what}" for shard, what in entries[:SHOWN]]
    if len(entries) > SHOWN:
        lines.append(f"{label}: ... and {len(entries) - SHOWN} more shard(s), listed in the manifest")
    return lines


def report(info: dict, shards: list[ShardRef], results: list[ShardIndex]) -> list[str]:
    """What a user must see: shards left out, samples without an image, undecodable images, bad labels."""
    lines = _lines("left out", [(ref.url, r.reason) for ref, r in zip(shards, results) if r.problem])
    for attr, label in (("no_image", "no image"), ("undecodable", "undecodable"), ("bad_label", "bad label")):
        lines += _lines(label, [(ref.url, getattr(r, attr).describe()) for ref, r in zip(shards, results)
                                if getattr(r, attr) is not None and getattr(r, attr).count])
    if info.get("num_unlabelled"):
        lines.append(f"warning: {info['num_unlabelled']:,} sample(s) have no label (.cls) while others do: "
                     "fine-tuning refuses the splits that hold them; pretraining does not read labels")
    return lines


def summary(info: dict, seconds: float, workers: int, pool: str, read_bytes: int) -> str:
    """The closing line: shards, samples, images by extension, labels, what was left out, throughput."""
    splits = info["splits"].values()
    shards = sum(len(s["filenames"]) for s in splits)
    images: Counter = sum((Counter(s["image_extensions"]) for s in splits), Counter())
    per_split = ", ".join(f"{s['name']} {s['num_samples']:,}" for s in splits)
    labels = (f"labelled, {info['num_classes']} classes ({info['label_range'][0]}..{info['label_range'][1]})"
              if "num_classes" in info else "unlabelled")
    without = sum(s["num_without_image"] for s in splits)
    undecodable = sum(s.get("num_undecodable", 0) for s in splits)
    checked = f", {undecodable:,} undecodable" if "num_undecodable" in next(iter(splits)) else ""
    rate = f"{read_bytes / 1e6 / max(seconds, 1e-9):,.1f} MB/s, {shards / max(seconds, 1e-9):,.1f} shards/s"
    return (f"indexed {shards:,} shards: {sum(s['num_samples'] for s in splits):,} samples ({per_split}); images "
            f"{', '.join(f'{e} {n:,}' for e, n in images.items()) or 'none'}; {without:,} without image{checked}; "
            f"{labels}; {info['num_bad_shards']} bad shard(s) left out; {read_bytes / 1e6:,.1f} MB in "
            f"{seconds:.1f} s ({rate}, {workers} {pool} worker(s))")


def index(locations: list[str], splits: list[str] | None, out: str | None, options: IndexOptions,
          amend: Callable[[dict], None] | None = None) -> dict:
    """`build-shards index`: list, check the output, read every shard, then write the manifest; returns it.
    `amend` adds to the manifest before it is written (`build-shards subset`: where the subset comes from)."""
    start = time.perf_counter()
    location_splits = split_names(locations, splits)
    shards = list_shards(locations, splits, options.read.timeout, options.read.retries)
    place = place_manifest(shards, out)
    check_output(place, options.overwrite)
    options = replace(options, pool="process" if options.pool == "auto" else options.pool)
    sized = all(s.size is not None for s in shards)  # a listing gives sizes; a remote pattern does not
    with progress(f"indexing {len(shards):,} shards", sum(s.size or 0 for s in shards) if sized else None,
                  "bytes") as shown:

        def show(done: int, total: int, read: int) -> None:
            estimate = read / done * total if done and not sized else None  # the total extrapolated, for the ETA
            shown.update(completed=read, description=f"indexing: {done:,}/{total:,} shards", total=estimate)

        results = read_shards(shards, options, show)
    info = build_manifest(locations, location_splits, shards, results, place, options)
    for line in report(info, shards, results):
        print(line, flush=True)
    written = copy.deepcopy(info)
    if amend is not None:
        amend(written)  # the summary below says what was indexed
    if urls.is_local(place.out):
        os.makedirs(os.path.dirname(manifest_file(place.out)), exist_ok=True)
    write_manifest_url(place.out, written)
    read_bytes = sum(r.bytes for r in results)
    print(summary(info, time.perf_counter() - start, max(1, min(options.workers, len(shards))), options.pool,
                  read_bytes))
    print(f"manifest: {manifest_file(place.out)}" + (f" (shards in {place.location})" if place.location else ""))
    return written
