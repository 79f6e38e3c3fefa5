"""Planning a build before any image is read: the inputs, their shuffled order, the splits and the shard ranges.

Every machine that takes part in a build computes the same plan from the same SOURCE and options, so parts need no
coordination. Memory stays bounded for lists of many millions of inputs:

* the **catalog** holds every listed input (its id, label and split) in listing order: the ids in a spill file on
  local disk, read back by offset when a range is written; the labels, split codes and id offsets in numpy arrays
  (13 bytes per input, no Python object per input);
* the **shuffle** is a keyed bijection of 0..n-1 computed on demand (a cycle-walking Feistel network over
  integers), so neither a shuffled list nor an n-sized permutation array exists; it depends on the seed and n only,
  never on the numpy version or the machine;
* **ranges** (the unit of work and of shard names) are arithmetic: range k of a split covers fixed positions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Inputs per range when --shard-size is 0 (shards limited by --shard-bytes only): ranges are what workers share.
BYTES_ONLY_RANGE = 10_000
EXCLUDED = -1  # split code of a listed input that goes to no split (an unlabelled row left out)


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


# ---------------------------------------------------------------- the catalog of listed inputs

class Catalog:
    """Every listed input, in listing order: ids in a spill file, labels and split codes in arrays."""

    def __init__(self, path: Path, ends: np.ndarray, labels: np.ndarray, splits: np.ndarray, split_names: list[str],
                 digest: str) -> None:
        self.path, self.ends, self.labels, self.splits = path, ends, labels, splits
        self.split_names, self.digest = split_names, digest
        self._fd: int | None = None

    def __len__(self) -> int:
        return len(self.ends)

    def ids(self, rows: np.ndarray) -> list[str]:
        """The ids of catalog `rows`, in the order given (read from the spill file in offset order)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        rows = np.asarray(rows, dtype=np.int64)
        ends = self.ends[rows]
        starts = np.where(rows > 0, self.ends[np.maximum(rows - 1, 0)], 0)
        out: list[str] = [""] * len(rows)
        for i in np.argsort(starts, kind="stable"):
            data = os.pread(self._fd, int(ends[i] - starts[i]), int(starts[i]))
            out[i] = data.decode("utf-8", "surrogateescape")
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class CatalogWriter:
    """Collects listed inputs into a `Catalog`; memory per input is a few bytes in array chunks."""

    CHUNK = 1 << 16

    def __init__(self, folder: Path, split_names: list[str] | None = None) -> None:
        self.path = Path(folder) / "catalog_ids.bin"
        self.file = open(self.path, "wb", buffering=1 << 20)
        self.size = 0
        self.split_names = list(split_names or [])
        self._ends: list[int] = []
        self._labels: list[int] = []
        self._splits: list[int] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._hash = hashlib.sha256()

    def split_code(self, name: str) -> int:
        """The code of split `name`, added when first met."""
        try:
            return self.split_names.index(name)
        except ValueError:
            self.split_names.append(name)
            return len(self.split_names) - 1

    def add(self, source_id: str, label: int = -1, split: int = 0) -> None:
        data = source_id.encode("utf-8", "surrogateescape")
        self.file.write(data)
        self._hash.update(data)
        self.size += len(data)
        self._ends.append(self.size)
        self._labels.append(label)
        self._splits.append(split)
        if len(self._ends) >= self.CHUNK:
            self._flush()

    def __len__(self) -> int:
        return sum(len(c[0]) for c in self._chunks) + len(self._ends)

    def _flush(self) -> None:
        if self._ends:
            self._chunks.append((np.array(self._ends, dtype=np.int64), np.array(self._labels, dtype=np.int32),
                                 np.array(self._splits, dtype=np.int16)))
            self._ends, self._labels, self._splits = [], [], []

    def finish(self, label_map: np.ndarray | None = None) -> Catalog:
        """Close the spill file; labels added as codes become `label_map[code]`. The catalog's `digest` covers every
        id, label and split."""
        self._flush()
        self.file.close()
        ends, labels, splits = ([np.concatenate([c[k] for c in self._chunks]) if self._chunks else
                                 np.zeros(0, dtype=dt) for k, dt in enumerate((np.int64, np.int32, np.int16))])
        self._chunks = []
        if label_map is not None:
            labelled = labels >= 0
            labels[labelled] = label_map[labels[labelled]]
        for array in (ends, labels, splits):
            self._hash.update(array.astype(array.dtype.newbyteorder("<")).tobytes())
        self._hash.update(json.dumps(self.split_names).encode())
        return Catalog(self.path, ends, labels, splits, self.split_names, self._hash.hexdigest())


# ---------------------------------------------------------------- the shuffle

def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit mixing function (splitmix64's finaliser) of x and a round key; uint64 arithmetic wraps."""
    x = x ^ key
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Shuffle:
    """A seeded bijection of positions 0..n-1 onto rows 0..n-1, computed for any positions on demand.

    A balanced Feistel network permutes 0..2^(2h)-1 (the smallest even bit width that holds n); values that land at
    n or above are encrypted again until they fall below n (cycle walking), which keeps it a bijection of 0..n-1.
    """

    ROUNDS = 6

    def __init__(self, n: int, key: str) -> None:
        self.n = int(n)
        bits = max(2, (max(self.n, 2) - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        digest = hashlib.sha512(f"build-shards shuffle/{key}".encode()).digest()
        self.keys = [np.uint64(int.from_bytes(digest[8 * i: 8 * i + 8], "little")) for i in range(self.ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        if self.n <= 1 or x.size == 0:
            return x.astype(np.int64)
        x = self._encrypt(x)
        outside = x >= np.uint64(self.n)
        while outside.any():
            x[outside] = self._encrypt(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


# ---------------------------------------------------------------- splits and ranges

@dataclass(frozen=True)
class SplitPlan:
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


def plan_splits(catalog: Catalog, layout: Layout, ordered: bool = False) -> list[SplitPlan]:
    """The splits, in manifest order: train then val (by --val-fraction, from one seeded shuffle of every input),
    or the source's own splits in their listing order, each shuffled with the seed and its name. `ordered`: the
    catalog already is in its final order (streaming sources shuffle their files while listing)."""
    plans = []
    if layout.val_fraction is not None:
        included = catalog.splits != EXCLUDED
        rows = None if included.all() else np.flatnonzero(included)
        n = len(catalog) if rows is None else len(rows)
        shuffle = None if ordered else Shuffle(n, f"{layout.seed}")
        n_val = int(round(n * layout.val_fraction))
        plans = [SplitPlan("train", n - n_val, n_val, shuffle, rows), SplitPlan("val", n_val, 0, shuffle, rows)]
    else:
        for code, name in enumerate(catalog.split_names):
            rows = np.flatnonzero(catalog.splits == code)
            shuffle = None if ordered else Shuffle(len(rows), f"{layout.seed}/{name}")
            plans.append(SplitPlan(name, len(rows), 0, shuffle, rows))
    return [p for p in plans if p.size > 0]


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


def plan_ranges(total: int, shard_size: int) -> list[tuple[int, int]]:
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
