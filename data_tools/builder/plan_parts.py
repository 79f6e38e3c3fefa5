"""Builds planned part by part (`--plan-parts G`): the files of a list SOURCE are dealt into G plan parts by size
(`assign_files`), and each plan part is listed and planned on its own, as a small build (`list_plan_part`), so that
every machine lists only its own files. See docs/build_shards.md#lists-of-many-files-plan-parts.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_tools.builder.catalog import EXCLUDED, CatalogWriter
from data_tools.builder.journal import fingerprint
from data_tools.builder.merge import listing_failures_name, unlabelled_mix
from data_tools.builder.shard_layout import (
    HashSplit,
    Parts,
    RangeRef,
    ShardLayout,
    SplitOrder,
    iter_ranges,
    split_plan_part,
)
from data_tools.builder.shard_ranges import RangeTask
from data_tools.builder.sources.base import (
    FailureLog,
    FileReader,
    LabelTable,
    Progress,
    Source,
    SourceError,
    SourceSpec,
    apply_repeated_rows,
    apply_unlabelled_rows,
)
from data_tools.builder.sources.list_files import ListFile, resolve_list_files, source_name
from data_tools.builder.sources.lists import ListedInto, list_rows
from data_tools.builder.sources.registry import detect_kind
from vit_mpp import __version__
from vit_mpp.data.image_prep import EncodeSettings


def assign_files(files: list[ListFile], count: int) -> list[list[ListFile]]:
    """The files of each of `count` plan parts, balanced by bytes (largest first, each to the part with the fewest
    bytes so far, then the fewest files, then the lowest number), each part's files in name order. Depends on names
    and sizes only."""
    lightest = [(0, 0, g) for g in range(count)]  # (bytes, files, part): a heap, so 100,000 files plan at once
    groups: list[list[ListFile]] = [[] for _ in range(count)]
    for file in sorted(files, key=lambda f: (-f.size, f.name)):
        size, n, g = heapq.heappop(lightest)
        groups[g].append(file)
        heapq.heappush(lightest, (size + file.size, n + 1, g))
    return [sorted(g, key=lambda f: f.name) for g in groups]


@dataclass(frozen=True)
class PartFiles:
    """The list files of plan part `index`, and the reader of the inputs they name."""

    index: int
    files: list[ListFile]
    reader: FileReader


@dataclass
class PlanPart:
    """One listed plan part: its files, catalog (in `source`), splits, and the record of it for the journal."""

    index: int
    source: Source
    splits: dict[str, SplitOrder]
    info: dict


def list_plan_part(spec: SourceSpec, layout: ShardLayout, files: PartFiles, workdir: Path,
                   progress: Progress) -> PlanPart:
    """List plan part `files.index` (its `files.files`, read by `files.reader`) into its own catalog under `workdir`
    and plan its splits."""
    index, reader = files.index, files.reader
    folder = Path(workdir) / f"p{index:05d}"
    folder.mkdir()
    writer = CatalogWriter(folder, None if layout.existing_splits else list(HashSplit.NAMES), check_repeats=True)
    failures = FailureLog(folder / "listing_failures.jsonl")
    labels = LabelTable()
    split_of = None if layout.val_fraction is None else HashSplit(layout.seed, layout.val_fraction)
    list_rows(files.files, spec, ListedInto(writer, failures, labels, progress, split_of))
    if not labels.intlike:
        raise SourceError(f"--plan-parts: plan part {index} of {spec.path} has labels that are names (e.g. "
                          f"{next(k for k in labels.codes if not k.isdigit())!r}); with plan parts labels must be "
                          "class indices (integers), since names are numbered in their order over every file, which "
                          "no part reads; map them to indices, or build without --plan-parts")
    label_map, class_names = labels.finish()
    catalog = writer.finish(label_map)
    failures.file.flush()
    source = Source("list", f"{spec.path} (plan part {index})", catalog, class_names, reader, failures)
    apply_repeated_rows(source, spec.repeated_rows)
    apply_unlabelled_rows(source, spec.unlabelled_rows, every_row=spec.unlabelled_rows == "skip")
    failures.close()
    splits = {s.name: s for s in split_plan_part(catalog, layout, index)}
    included = catalog.splits != EXCLUDED
    labelled = included & (catalog.labels >= 0)
    info = {"files": [f.name for f in files.files], "digest": catalog.digest,
            "splits": {name: s.size for name, s in splits.items()}, "num_inputs": int(np.count_nonzero(included)),
            "num_labelled": int(np.count_nonzero(labelled)), "num_repeated": source.num_repeated,
            "max_label": int(catalog.labels.max(where=labelled, initial=-1)),  # no copy of the labels
            "listing_failures": {"count": failures.count, "sha256": failures.hash.hexdigest()}}
    return PlanPart(index, source, splits, info)


class PlannedBuild:
    """The plan of a build with plan parts, as this machine sees it: the file plan of every part (names and sizes),
    and the catalogs and splits of the plan parts it owns. Offers what BuildPlan offers to the build."""

    def __init__(self, spec: SourceSpec, layout: ShardLayout, encode: EncodeSettings, parts: Parts, workdir: Path,
                 progress: Progress = lambda rows, done: None) -> None:
        self.layout, self.unlabelled_rows = layout, spec.unlabelled_rows
        count = layout.plan_parts
        if spec.streaming or spec.kind not in ("auto", "list") or (spec.kind == "auto" and
                                                                  detect_kind(spec.path) != "list"):
            raise SourceError("--plan-parts plans a list SOURCE (a folder or pattern of list files; --source-kind "
                              f"list for a folder that also holds sub-folders); {spec.path} is not one")
        if parts.count > count:
            idle = f"part {count}" if parts.count == count + 1 else f"parts {count} to {parts.count - 1}"
            raise SourceError(f"--num-parts {parts.count} is more than --plan-parts {count}: {idle} would have no "
                              "files")
        listed = resolve_list_files(spec.path)
        if count > len(listed.files):
            raise SourceError(f"--plan-parts {count} is more than the {len(listed.files)} list file(s) of {spec.path}")
        self.files = assign_files(listed.files, count)
        self.reader = FileReader(listed.root)
        self.base = {"name": source_name(spec.path), "num_classes": 0, "class_names": [],
                     "source": {"kind": "list", "path": spec.path, "num_inputs": 0, "files": len(listed.files)},
                     **layout.to_dict(), "encoder": encode.to_dict(), "num_unlabelled": 0,
                     "tool_version": __version__}  # the zeros: summed over the plan parts by merge
        plan = json.dumps([[f.name, f.size] for f in listed.files]).encode()
        self.fingerprint = fingerprint(hashlib.sha256(plan).hexdigest(), {**self.base, **spec.row_rules()})
        self.owned: dict[int, PlanPart] = {}
        for g in (g for g in range(count) if parts.owns(g)):
            self.owned[g] = list_plan_part(spec, layout, PartFiles(g, self.files[g], self.reader), workdir, progress)
        problem = unlabelled_mix([p.info for p in self.owned.values()], spec.unlabelled_rows, spec.path)
        if problem:  # plan parts with labels beside plan parts without: found here when one machine lists both
            raise SourceError(problem)
        if parts.count == 1 and not self.num_inputs:
            raise SourceError(f"no images found in {spec.path}")

    @property
    def num_inputs(self) -> int:
        """Inputs listed into a split by the plan parts listed here."""
        return sum(p.info["num_inputs"] for p in self.owned.values())

    @property
    def listing_failure_count(self) -> int:
        """Inputs met and not used while listing the plan parts listed here."""
        return sum(p.source.failures.count for p in self.owned.values())

    def ranges(self, parts: Parts) -> list[RangeRef]:
        """The ranges of the plan parts that part `parts` owns (all of them listed here), in order."""
        return [r for g, p in self.owned.items() if parts.owns(g)
                for r in iter_ranges(p.info["splits"], self.layout.shard_size, g)]

    def task(self, r: RangeRef) -> RangeTask:
        """What a worker needs to write range `r` of its plan part: its items, read from that catalog now."""
        part = self.owned[r.group]
        rows = part.splits[r.split].catalog_rows(r.start, r.end)
        return RangeTask(r.split, r.index, r.start, part.source.items(rows), self.layout.shard_bytes, r.group)

    def header(self, parts: Parts) -> dict:
        """The first line of this part's journal: the build, and each plan part it listed."""
        return {"type": "build", "fingerprint": self.fingerprint, "part": parts.index, "num_parts": parts.count,
                "plan_parts": self.layout.plan_parts, "unlabelled_rows": self.unlabelled_rows,
                "manifest": self.base, "groups": {str(g): p.info for g, p in self.owned.items()}}

    def listing_failures(self, parts: Parts) -> dict[str, str]:
        """The listing failures of each plan part this part lists, to be written to OUT (merge joins them)."""
        return {listing_failures_name(g): p.source.failures.path.read_text(encoding="utf-8")
                for g, p in self.owned.items()}

    def accepts(self, header: dict | None, record: dict) -> bool:
        """Whether a journaled range counts for this build: it was written from the same listing of its plan part
        (same names and sizes are in the fingerprint; this checks the rows themselves)."""
        group = record.get("group")
        info = (header or {}).get("groups", {}).get(str(group))
        return group in self.owned and info is not None and info["digest"] == self.owned[group].info["digest"]

    def describe(self, parts: Parts) -> str:
        """The --dry-run report."""
        mine = self.ranges(parts)
        splits: dict[str, int] = {}
        for p in self.owned.values():
            for name, size in p.info["splits"].items():
                splits[name] = splits.get(name, 0) + size
        per_split = ", ".join(f"{name} {size:,} inputs" for name, size in splits.items())
        files = sum(len(self.files[g]) for g in self.owned)
        nbytes = sum(f.size for g in self.owned for f in self.files[g])
        part = f"part {parts.index} of {parts.count}" if parts.count > 1 else "this machine"
        return (f"plan: {sum(map(len, self.files)):,} list files in {self.layout.plan_parts} plan parts; {part} "
                f"lists {files:,} files ({nbytes / 2**20:,.1f} MiB) in {len(self.owned)} plan part(s): {per_split}; "
                f"{len(mine):,} ranges of up to {self.layout.shard_size or 'any number of'} inputs; fingerprint "
                f"{self.fingerprint[:16]}")

    def close(self) -> None:
        """Close the plan parts' catalogs."""
        for p in self.owned.values():
            p.source.close()
