"""The layout of a build: how the catalog's inputs are shuffled, split and cut into shard ranges.

Every machine that takes part in a build computes the same layout from the same catalog and options, so parts need
no coordination:

* each split is an order over catalog rows (`SplitOrder`): train and val from one seeded shuffle of every input
  (data_tools/shuffle.py), or the source's own splits, each shuffled with the seed and its name;
* **ranges** (the unit of work and of shard names) are arithmetic: range k of a split covers fixed positions, and
  part `I` of `N` (`Parts`) builds the ranges whose global number is I modulo N.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data_tools.catalog import EXCLUDED, Catalog
from data_tools.shuffle import Shuffle

# Inputs per range when --shard-size is 0 (shards limited by --shard-bytes only): ranges are what workers share.
BYTES_ONLY_RANGE = 10_000


@dataclass(frozen=True)
class Layout:
    """How inputs become shards: the seeded shuffle, the split, and the shard limits."""

    seed: int = 0
    val_fraction: float | None = 0.1  # None: the source's own splits are kept (--existing-splits)
    shard_size: int = 1000  # inputs per shard at most (0: by --shard-bytes only)
    shard_bytes: int = 0  # also start a new shard once one holds this many bytes (0: no limit)

    @property
    def existing_splits(self) -> bool:
        return self.val_fraction is None

    def to_dict(self) -> dict:
        """The manifest's layout fields."""
        return {"seed": self.seed, "val_fraction": self.val_fraction, "existing_splits": self.existing_splits,
                "shard_size": self.shard_size, "shard_bytes": self.shard_bytes}


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


def split_catalog(catalog: Catalog, layout: Layout, ordered: bool = False) -> list[SplitOrder]:
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
    """Range `index` of `split` (positions [start, end)); `number` counts ranges over all splits in order."""

    split: str
    index: int
    start: int
    end: int
    number: int


def iter_ranges(sizes: dict[str, int], shard_size: int) -> Iterator[RangeRef]:
    """Every range of every split (sizes in manifest order), numbered across splits; computed, never stored."""
    number = 0
    for name, size in sizes.items():
        for k in range(num_ranges(size, shard_size)):
            yield RangeRef(name, k, *range_bounds(size, shard_size, k), number)
            number += 1


def shard_name(split: str, index: int, piece: int | None = None) -> str:
    """A shard's file name, from its split and range (and its piece of the range, with --shard-bytes): every
    machine names its shards without knowing what the others wrote."""
    return f"{split}-{index:06d}.tar" if piece is None else f"{split}-{index:06d}-{piece:04d}.tar"
