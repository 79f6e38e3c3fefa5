"""The layout of a build (`ShardLayout`): how the catalog's inputs are shuffled, split (`SplitOrder`, `HashSplit`) and
cut into shard ranges. Every machine computes the same layout from the same catalog and options, so parts
(`Parts`: part I of N builds the ranges numbered I modulo N) need no coordination.
See docs/build_shards.md#planning-in-bounded-memory.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data_tools.builder.catalog import EXCLUDED, Catalog
from data_tools.builder.shuffle import Shuffle

# Inputs per range when --shard-size is 0 (shards limited by --shard-bytes only): ranges are what workers share.
BYTES_ONLY_RANGE = 10_000


@dataclass(frozen=True)
class ShardLayout:
    """How inputs become shards: the seeded shuffle, the split, and the shard limits."""

    seed: int = 0
    val_fraction: float | None = 0.1  # None: the source's own splits are kept (--existing-splits)
    shard_size: int = 1000  # inputs per shard at most (0: by --shard-bytes only)
    shard_bytes: int = 0  # also start a new shard once one holds this many bytes (0: no limit)
    plan_parts: int = 0  # > 0: the list files are dealt into this many plan parts, each planned on its own

    @property
    def existing_splits(self) -> bool:
        return self.val_fraction is None

    def to_dict(self) -> dict:
        """The manifest's layout fields (`plan_parts` only when the build has them: older manifests stay as they
        were)."""
        return {"seed": self.seed, "val_fraction": self.val_fraction, "existing_splits": self.existing_splits,
                "shard_size": self.shard_size, "shard_bytes": self.shard_bytes,
                **({"plan_parts": self.plan_parts} if self.plan_parts else {})}


@dataclass(frozen=True)
class Parts:
    """This machine builds part `index` of `count`: the ranges whose global index is `index` modulo `count`."""

    index: int = 0
    count: int = 1

    def owns(self, global_range: int) -> bool:
        return global_range % self.count == self.index


ONE_MACHINE = Parts(0, 1)


@dataclass(frozen=True)
class SplitOrder:
    """One split: `size` positions; position p is catalog row `rows[shuffle(offset + p)]` (each step optional)."""

    name: str
    size: int
    offset: int = 0
    shuffle: Shuffle | None = None  # None: catalog order (sources that come already ordered)
    rows: np.ndarray | None = None  # None: the shuffled sequence indexes the catalog directly

    def catalog_rows(self, start: int, end: int) -> np.ndarray:
        """Catalog rows of positions [start, end) of this split."""
        x = np.arange(self.offset + start, self.offset + end, dtype=np.int64)
        if self.shuffle is not None:
            x = self.shuffle(x)
        return self.rows[x] if self.rows is not None else x


def split_catalog(catalog: Catalog, layout: ShardLayout, ordered: bool = False) -> list[SplitOrder]:
    """The splits, in manifest order: train then val (by --val-fraction, from one seeded shuffle of every input),
    or the source's own splits in their listing order, each shuffled with the seed and its name. `ordered`: the
    catalog already is in its final order (streaming sources shuffle their files while listing)."""
    splits = []
    if layout.val_fraction is not None:
        included = catalog.splits != EXCLUDED
        rows = None if included.all() else np.flatnonzero(included)
        n = len(catalog) if rows is None else len(rows)
        shuffle = None if ordered else Shuffle(n, f"{layout.seed}")
        n_val = int(round(n * layout.val_fraction))
        splits = [SplitOrder("train", n - n_val, n_val, shuffle, rows), SplitOrder("val", n_val, 0, shuffle, rows)]
    else:
        for code, name in enumerate(catalog.split_names):
            rows = np.flatnonzero(catalog.splits == code)
            shuffle = None if ordered else Shuffle(len(rows), f"{layout.seed}/{name}")
            splits.append(SplitOrder(name, len(rows), 0, shuffle, rows))
    return [s for s in splits if s.size > 0]


class HashSplit:
    """--val-fraction in a build with plan parts: an input goes to val (split code 1) when a keyed hash of its id
    falls below the fraction, else to train (0). Decided row by row, so it depends on neither the file plan nor the
    machine: the same rows are val whatever --plan-parts, and a path listed twice never lands in both splits. The
    val share is the fraction up to sampling noise (not exactly round(n * F), as one shuffle of all inputs gives)."""

    NAMES = ("train", "val")

    def __init__(self, seed: int, fraction: float) -> None:
        self.base = hashlib.blake2b(digest_size=8, key=f"build-shards val/{seed}".encode())
        self.threshold = int(fraction * 2**64)  # exact: a float times a power of two

    def __call__(self, source_id: str) -> int:
        digest = self.base.copy()  # a copy of the keyed state: a third cheaper than keying every row
        digest.update(source_id.encode("utf-8", "surrogateescape"))
        return 1 if int.from_bytes(digest.digest(), "little") < self.threshold else 0


def split_plan_part(catalog: Catalog, layout: ShardLayout, group: int) -> list[SplitOrder]:
    """The splits of plan part `group` (--plan-parts), in the catalog's split order: each split's rows (its code,
    set per row while listing: train or val by a hash of the input's id, or the list's own split) shuffled with the
    seed, the plan part and the split's name. Empty splits are left out."""
    splits = []
    for code, name in enumerate(catalog.split_names):
        rows = np.flatnonzero(catalog.splits == code)
        if len(rows):
            splits.append(SplitOrder(name, len(rows), 0, Shuffle(len(rows), f"{layout.seed}/p{group}/{name}"), rows))
    return splits


def num_ranges(total: int, shard_size: int) -> int:
    """How many ranges `total` inputs are cut into."""
    return math.ceil(total / (shard_size or BYTES_ONLY_RANGE)) if total > 0 else 0


def range_bounds(total: int, shard_size: int, k: int) -> tuple[int, int]:
    """[start, end) of range k: ranges are as few as `shard_size` allows and balanced by count (2500 inputs by 1000
    -> 834, 833, 833), so the ranges of a split differ by at most one input."""
    n = num_ranges(total, shard_size)
    base, extra = divmod(total, n)
    start = k * base + min(k, extra)
    return start, start + base + (1 if k < extra else 0)


def split_ranges(total: int, shard_size: int) -> list[tuple[int, int]]:
    """Every [start, end) range of a split of `total` inputs."""
    return [range_bounds(total, shard_size, k) for k in range(num_ranges(total, shard_size))]


@dataclass(frozen=True)
class RangeRef:
    """Range `index` of `split` (positions [start, end)); `number` counts ranges over all splits in order. In a
    build with plan parts (--plan-parts), `group` is the plan part whose split it is a range of."""

    split: str
    index: int
    start: int
    end: int
    number: int
    group: int | None = None

    @property
    def key(self) -> tuple[int | None, str, int]:
        """What identifies the range in journals: (plan part or None, split, index)."""
        return self.group, self.split, self.index


def iter_ranges(sizes: dict[str, int], shard_size: int, group: int | None = None) -> Iterator[RangeRef]:
    """Every range of every split (sizes in manifest order), numbered across splits; computed, never stored."""
    number = 0
    for name, size in sizes.items():
        for k in range(num_ranges(size, shard_size)):
            yield RangeRef(name, k, *range_bounds(size, shard_size, k), number, group)
            number += 1


def shard_name(split: str, index: int, piece: int | None = None, group: int | None = None) -> str:
    """A shard's file name, from its split and range (and its piece of the range, with --shard-bytes; and its plan
    part, with --plan-parts: `train-p00003-000042.tar`): every machine names its shards without knowing what the
    others wrote."""
    stem = f"{split}-{index:06d}" if group is None else f"{split}-p{group:05d}-{index:06d}"
    return f"{stem}.tar" if piece is None else f"{stem}-{piece:04d}.tar"


def sample_key(split: str, position: int, group: int | None = None) -> str:
    """A sample's key: its split and position in the shuffled split (`train_000000042`), and its plan part when the
    build has them (`train_p00003_000000042`: positions restart in each plan part). No dots: webdataset splits keys
    from extensions at the first dot."""
    return f"{split}_{position:09d}" if group is None else f"{split}_p{group:05d}_{position:09d}"
