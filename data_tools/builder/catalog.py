"""The catalog: every listed input (its id, label and split) in listing order, with bounded memory (`CatalogWriter`,
`Catalog`): ids in a spill file on local disk, labels and splits in numpy arrays, a digest that is part of the
build's fingerprint, and the rows that repeat a path, found exactly.
See docs/build_shards.md#planning-in-bounded-memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from pathlib import Path

import numpy as np

EXCLUDED = -1  # split code of a listed input that goes to no split (an unlabelled row left out)
NO_REPEATS = np.zeros((0, 2), dtype=np.int64)


def same_path(source_id: str) -> str:
    """The form of a listed path under which two spellings of one file meet (`./a/b.jpg`, `a//b.jpg`: `a/b.jpg`);
    URLs are taken as written."""
    if ("./" in source_id or "//" in source_id) and "://" not in source_id:
        return posixpath.normpath(source_id)
    return source_id


class Catalog:
    """Every listed input, in listing order: ids in a spill file, labels and split codes in arrays."""

    def __init__(self, path: Path, ends: np.ndarray, labels: np.ndarray, splits: np.ndarray, split_names: list[str],
                 digest: str) -> None:
        self.path, self.ends, self.labels, self.splits = path, ends, labels, splits
        self.split_names, self.digest = split_names, digest
        self.repeats = NO_REPEATS  # (row, the earlier row naming the same path), by row; see `find_repeats`
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
        order = np.argsort(starts, kind="stable")
        out: list[str] = [""] * len(rows)
        fd = self._fd
        # Python ints, not numpy scalars, in the loop: indexing an array row by row was half the time of reading
        for i, size, start in zip(order.tolist(), (ends - starts)[order].tolist(), starts[order].tolist()):
            out[i] = os.pread(fd, size, start).decode("utf-8", "surrogateescape")
        return out

    def find_repeats(self, keys: np.ndarray) -> None:
        """Set `repeats`: each row whose path (`same_path`) an earlier row names, with the first such row. `keys`
        holds a hash of each row's `same_path`; only rows whose hashes meet are read back and compared."""
        ordered = np.sort(keys)  # a plain sort, ten times an argsort's speed: rows are found below only if need be
        met = ordered[1:][ordered[1:] == ordered[:-1]]
        del ordered
        if not len(met):
            self.repeats = NO_REPEATS
            return
        met = np.unique(met)
        at = np.searchsorted(met, keys)
        np.minimum(at, len(met) - 1, out=at)
        candidates = np.flatnonzero(met[at] == keys)  # every row whose hash another row has, in listing order
        del at
        first: dict[str, int] = {}
        pairs: list[tuple[int, int]] = []
        for start in range(0, len(candidates), 65536):
            rows = candidates[start:start + 65536]
            for row, source_id in zip(rows.tolist(), self.ids(rows)):
                earlier = first.setdefault(same_path(source_id), row)
                if earlier != row:
                    pairs.append((row, earlier))
        self.repeats = np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class CatalogWriter:
    """Collects listed inputs into a `Catalog`; memory per input is a few bytes in array chunks."""

    CHUNK = 1 << 16

    def __init__(self, folder: Path, split_names: list[str] | None = None, check_repeats: bool = False) -> None:
        """`check_repeats`: find the rows that repeat a path (lists; a folder walk or a dataset cannot repeat one)."""
        self.path = Path(folder) / "catalog_ids.bin"
        self.file = open(self.path, "wb", buffering=1 << 20)
        self.size = 0
        self.split_names = list(split_names or [])
        self._ends: list[int] = []
        self._labels: list[int] = []
        self._splits: list[int] = []
        self.check_repeats = check_repeats
        self._keys: list[int] = []  # a hash of each row's same_path, for Catalog.find_repeats (not in the digest)
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
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
        if self.check_repeats:
            self._keys.append(hash(source_id if "./" not in source_id and "//" not in source_id
                                   else same_path(source_id)))  # same_path, inlined for its common case
        if len(self._ends) >= self.CHUNK:
            self._flush()

    def __len__(self) -> int:
        return sum(len(c[0]) for c in self._chunks) + len(self._ends)

    def _flush(self) -> None:
        if self._ends:
            self._chunks.append((np.array(self._ends, dtype=np.int64), np.array(self._labels, dtype=np.int32),
                                 np.array(self._splits, dtype=np.int16), np.array(self._keys, dtype=np.int64)))
            self._ends, self._labels, self._splits, self._keys = [], [], [], []

    def finish(self, label_map: np.ndarray | None = None) -> Catalog:
        """Close the spill file; labels added as codes become `label_map[code]`. The catalog's `digest` covers every
        id, label and split; its `repeats` are found."""
        self._flush()
        self.file.close()
        # One field at a time, each field's chunks dropped once joined: the peak is the chunks plus the largest
        # field, not the chunks plus all fields.
        fields = [list(f) for f in zip(*self._chunks)] or [[], [], [], []]
        self._chunks = []
        joined = []
        for dtype in (np.int64, np.int32, np.int16, np.int64):
            parts = fields.pop(0)
            joined.append(np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
            del parts
        ends, labels, splits = joined[:3]
        if label_map is not None:  # codes -> class indices; -1 (unlabelled) indexes the -1 put at the end
            labels = np.append(label_map, -1).astype(np.int32)[labels]
        for array in (ends, labels, splits):  # the little-endian bytes, hashed in place (no copy on such machines)
            self._hash.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).view(np.uint8))
        self._hash.update(json.dumps(self.split_names).encode())
        catalog = Catalog(self.path, ends, labels, splits, self.split_names, self._hash.hexdigest())
        if self.check_repeats:
            catalog.find_repeats(joined.pop())
        return catalog
