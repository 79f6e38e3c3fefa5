"""The build plan: what every machine of a build computes the same from the listed SOURCE and the options.

The splits (each an order over catalog rows, data_tools/builder/shard_layout.py) and their sizes, the shard ranges
and which of them a part builds, the manifest's fields known before any image is read, and the fingerprint that
parts, resumes and merges must match (data_tools/builder/journal.py). Nothing here reads an image or writes to OUT.
"""

from __future__ import annotations

from data_tools.builder.journal import fingerprint
from data_tools.builder.merge import LISTING_FAILURES_NAME
from data_tools.builder.shard_layout import (
    Parts,
    RangeRef,
    ShardLayout,
    SplitOrder,
    iter_ranges,
    num_ranges,
    split_catalog,
)
from data_tools.builder.shard_ranges import RangeTask
from data_tools.builder.sources.base import Source, SourceError, SourceSpec
from data_tools.builder.sources.list_files import source_name
from vit_mpp import __version__
from vit_mpp.data.image_prep import EncodeSettings


class BuildPlan:
    """What every machine computes the same: splits, sizes, the fingerprint and the manifest's fixed fields.

    A build with plan parts has its own plan (data_tools/builder/plan_parts.py, `PlannedBuild`) offering the same
    methods: `ranges`, `task`, `header`, `listing_failures`, `accepts`, `describe`, `close`, and `fingerprint` and
    `reader`."""

    def __init__(self, source: Source, spec: SourceSpec, layout: ShardLayout, encode: EncodeSettings) -> None:
        self.source, self.layout = source, layout
        self.reader = source.reader
        order = sorted(source.catalog.split_names) if source.kind == "list" else list(source.catalog.split_names)
        splits = split_catalog(source.catalog, layout, ordered=source.ordered)
        if layout.existing_splits:
            splits.sort(key=lambda s: order.index(s.name))
        self.splits: dict[str, SplitOrder] = {s.name: s for s in splits}
        if not self.splits:
            raise SourceError(f"no images found in {spec.path}")
        self.sizes = {name: s.size for name, s in self.splits.items()}
        self.base = {"name": source_name(spec.path), "num_classes": len(source.class_names),
                     "class_names": source.class_names, "source": source.describe(), **layout.to_dict(),
                     "encoder": encode.to_dict(), "num_unlabelled": source.num_unlabelled,
                     "tool_version": __version__}
        self.fingerprint = fingerprint(source.catalog.digest, {**self.base, **spec.row_rules()})

    def ranges(self, parts: Parts) -> list[RangeRef]:
        """The ranges part `parts` builds, in order."""
        return [r for r in iter_ranges(self.sizes, self.layout.shard_size) if parts.owns(r.number)]

    def task(self, r: RangeRef) -> RangeTask:
        """What a worker needs to write range `r`: its items, read from the catalog now."""
        rows = self.splits[r.split].catalog_rows(r.start, r.end)
        return RangeTask(r.split, r.index, r.start, self.source.items(rows), self.layout.shard_bytes)

    def header(self, parts: Parts) -> dict:
        """The first line of this part's journal."""
        failures = self.source.failures
        listing = {"count": failures.count, "sha256": failures.hash.hexdigest()}
        return {"type": "build", "fingerprint": self.fingerprint, "part": parts.index, "num_parts": parts.count,
                "splits": self.sizes, "manifest": self.base, "listing_failures": listing}

    def listing_failures(self, parts: Parts) -> dict[str, str]:
        """The files with the inputs met while listing and not used that this part writes to OUT: part 0's."""
        if parts.index:
            return {}
        return {LISTING_FAILURES_NAME: self.source.failures.path.read_text(encoding="utf-8")}

    def accepts(self, header: dict | None, record: dict) -> bool:
        """Whether a journaled range of this build counts (always: the fingerprint covers every listed input)."""
        return True

    def describe(self, parts: Parts) -> str:
        """The --dry-run report."""
        per_split = ", ".join(f"{name} {size:,} inputs in {num_ranges(size, self.layout.shard_size):,} ranges"
                              for name, size in self.sizes.items())
        mine = self.ranges(parts)
        part = f"part {parts.index} of {parts.count}: " if parts.count > 1 else ""
        return (f"plan: {per_split}; {part}{len(mine):,} ranges, {sum(r.end - r.start for r in mine):,} inputs; "
                f"fingerprint {self.fingerprint[:16]}")

    def close(self) -> None:
        """Close the catalog."""
        self.source.close()
