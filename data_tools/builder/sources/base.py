"""What every kind of source shares: the user's `SourceSpec`, the listed `Source`, readers, labels, failures. A kind
is a lister, `(spec, writer, failures, seed, progress) -> Listing`, that adds every input of SOURCE to the catalog
writer (ids, labels, splits: never image bytes), records what it does not use in the `FailureLog`, and returns a
picklable `Reader` with the class names. registry.py turns a `Listing` into a `Source`; this module imports no
kind. See docs/build_shards.md#sources.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from data_tools.builder.catalog import EXCLUDED, Catalog, CatalogWriter
from vit_mpp.data import urls
from vit_mpp.data.labels import MAX_CLASSES, BadLabel
from vit_mpp.errors import UserError

SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")  # split names end up in shard names and sample keys
UNLABELLED_ROWS = ("error", "skip", "keep")
REPEATED_ROWS = ("error", "skip", "keep")
MAX_LABEL_NAMES = 1_000_000  # distinct label names held while listing


class SourceError(UserError):
    """SOURCE cannot be read as asked; the message is one line."""


@dataclass(frozen=True)
class SourceSpec:
    """What the user said about SOURCE (the build-shards options that choose and read it)."""

    path: str
    kind: str = "auto"
    existing_splits: bool = False
    split: str | None = None  # hf: comma-separated split names (None: train, or every split with existing_splits)
    image_column: str = ""  # hf: '' picks 'image' or the first Image column
    label_column: str = "label"  # hf: '' means unlabelled
    streaming: bool = False  # hf: read parquet files where they are instead of loading the dataset
    unlabelled_rows: str = "error"  # a labelled list or dataset with some rows unlabelled: error, skip or keep
    repeated_rows: str = "error"  # list rows naming a path an earlier row names: error, skip or keep
    allow_outside_paths: bool = False  # list rows may name absolute paths, URLs or paths above the list's folder

    def row_rules(self) -> dict[str, str]:
        """What is done with unlabelled and repeated rows: part of a build's fingerprint
        (data_tools/builder/journal.py), since it changes which inputs are written."""
        return {"unlabelled_rows": self.unlabelled_rows, "repeated_rows": self.repeated_rows}


@dataclass(frozen=True, slots=True)
class Item:
    """One input image: `source_id` names it in the metadata and failure report; `ref` is what the reader needs
    (a path, or a row number); label -1 means unlabelled."""

    source_id: str
    ref: str | int
    label: int = -1


def os_error_detail(error: OSError) -> str:
    """An OSError as reproducible text: its type and reason, not the path (which may be a temporary name)."""
    return f"{type(error).__name__}: {error.strerror or error}"


class FailureLog:
    """Inputs met while listing that are not used, with their reasons, spilled to a JSONL file as they come."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = open(self.path, "w", encoding="utf-8")
        self.count = 0
        self.reasons: collections.Counter[str] = collections.Counter()
        self.hash = hashlib.sha256()

    def add(self, source: str, reason: str, detail: str, split: str | None = None) -> None:
        line = json.dumps({"source": source, "split": split, "reason": reason, "detail": detail}) + "\n"
        self.file.write(line)
        self.hash.update(line.encode())
        self.count += 1
        self.reasons[reason] += 1

    def close(self) -> None:
        self.file.close()


# ---------------------------------------------------------------- readers (used in worker processes)

def is_url(path: str) -> bool:
    """Whether `path` is a URL with a scheme of its own (`s3://`, `file://`), not a local path."""
    scheme = urlparse(path).scheme
    return len(scheme) > 1


class Reader:
    """What worker processes read an input's original bytes with: `read(ref)`, and `read_many(refs)` in order."""

    def read(self, ref: str | int) -> bytes:
        raise NotImplementedError

    def read_many(self, refs: list) -> Iterator[bytes | OSError]:
        """Each ref's bytes, or the OSError that reading it raised, in order."""
        for ref in refs:
            try:
                yield self.read(ref)
            except OSError as e:
                yield e


class FileReader(Reader):
    """Reads items whose `ref` is a path: relative to `base` (a folder or a URL), or, for list rows allowed outside
    it, absolute or a URL of its own. Remote reads have deadlines and bounded retries (vit_mpp/data/urls.py)."""

    def __init__(self, base: str | Path = "") -> None:
        self.base = str(base)
        # A local folder's path, worked out once: most refs are plain relative paths, read without parsing them
        # as URLs (three urlparse calls an image otherwise).
        self.local_base = urls.local_path(self.base) if urls.is_local(self.base) else None

    def location(self, ref: str | int) -> str:
        ref = str(ref)
        return ref if is_url(ref) or os.path.isabs(ref) else urls.join(self.base, ref)

    def read(self, ref: str | int) -> bytes:
        if self.local_base is not None and isinstance(ref, str) and ":" not in ref and not os.path.isabs(ref):
            with open(os.path.join(self.local_base, ref), "rb") as f:  # no ':', so no URL scheme
                return f.read()
        where = self.location(ref)
        if urls.is_local(where):
            with open(urls.local_path(where), "rb") as f:
                return f.read()
        return urls.read_url(where)


def image_value_bytes(value: Any, ref: Any, column: str) -> bytes:
    """The bytes of an undecoded `datasets.Image` value ({"bytes": ..., "path": ...}), bytes, or a path."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value:
        return FileReader().read(value)
    raise OSError(f"row {ref} has no image bytes or path in column '{column}'")


# ---------------------------------------------------------------- what open_source returns (registry.py)

@dataclass
class Source:
    """A listed SOURCE: its catalog, class names, reader and the inputs met but not listed (`failures`)."""

    kind: str
    path: str
    catalog: Catalog
    class_names: list[str]
    reader: Any  # the kind's Reader: read_many(refs) -> bytes or OSError per ref
    failures: FailureLog
    details: dict[str, Any] = field(default_factory=dict)
    ordered: bool = False  # the catalog already is in its final order (no shuffle of single inputs)
    refs_are_rows: bool = False  # an item's ref is its catalog row (datasets) rather than its id (paths)
    num_unlabelled: int = 0  # labelled source, unlabelled inputs kept (--unlabelled-rows keep)
    num_repeated: int = 0  # rows naming a path an earlier row names, kept (--repeated-rows keep)

    @property
    def num_inputs(self) -> int:
        return int(np.count_nonzero(self.catalog.splits != EXCLUDED))

    def describe(self) -> dict[str, Any]:
        """The manifest's `source` record."""
        repeated = {"num_repeated": self.num_repeated} if self.num_repeated else {}  # --repeated-rows keep
        return {"kind": self.kind, "path": self.path, "num_inputs": self.num_inputs, **repeated, **self.details}

    def items(self, rows: np.ndarray) -> list[Item]:
        """The items of catalog `rows`, in that order."""
        ids = self.catalog.ids(rows)
        labels = self.catalog.labels[rows].tolist()
        refs = rows.tolist() if self.refs_are_rows else ids
        return [Item(i, r, lb) for i, r, lb in zip(ids, refs, labels)]

    def close(self) -> None:
        self.catalog.close()


def check_split_names(names: list[str], where: str) -> None:
    bad = [n for n in names if not SPLIT_NAME.match(n)]
    if bad:
        raise SourceError(f"split names in {where} must be letters, digits or '_' (got {', '.join(bad)})")


# ---------------------------------------------------------------- labels

class LabelTable:
    """Label values as met while listing -> codes (first-seen order); at the end, codes -> class indices.

    Integers (and strings of digits) are class indices, with names '0'..'K-1' unless `names` are given (a
    ClassLabel's); other strings are names, indexed in sorted order; None, '' and -1 mean unlabelled."""

    def __init__(self, names: list[str] | None = None) -> None:
        self.names = names
        self.codes: dict[str, int] = {}
        self.intlike = True
        self.seen: dict[int | str, int] = {}  # a plain int or str value met before -> its code: a list repeats a
        # few labels millions of times, and working one out (a regular expression) was a sixth of listing a row

    def code(self, value: Any) -> int:
        if type(value) in (int, str):  # exactly: True == 1 and np.int64(1) == 1 must not share an entry
            known = self.seen.get(value)
            if known is not None:
                return known
            code = self._code(value)
            if len(self.seen) < MAX_LABEL_NAMES:
                self.seen[value] = code
            return code
        return self._code(value)

    def _code(self, value: Any) -> int:
        if value is None or value == "":
            return -1
        if isinstance(value, bool) or not isinstance(value, (int, str, np.integer)):
            raise BadLabel(f"label {value!r} is not an integer or a name")
        text = str(value).strip() if isinstance(value, str) else str(int(value))
        if re.fullmatch(r"[-+]?\d+", text):
            index = int(text)
            if index == -1:
                return -1
            if index < 0 or index >= MAX_CLASSES:
                raise BadLabel(f"label {value!r} is not a class index (0 to {MAX_CLASSES - 1:,}, or -1 for none)")
            text = str(index)
        else:
            self.intlike = False
        code = self.codes.get(text)
        if code is None:
            if len(self.codes) >= MAX_LABEL_NAMES:
                raise SourceError(f"more than {MAX_LABEL_NAMES:,} distinct labels: labels must be class names or "
                                  "class indices, not per-image values")
            code = self.codes[text] = len(self.codes)
        return code

    def finish(self) -> tuple[np.ndarray | None, list[str]]:
        """(code -> class index lookup table, class names); (None, []) when nothing is labelled."""
        if not self.codes:
            return None, []
        keys = list(self.codes)
        if self.intlike:
            index = [int(k) for k in keys]
            names = list(self.names) if self.names else []
            if max(index) >= len(names):
                if self.names:
                    raise SourceError(f"label {max(index)} is outside the dataset's {len(self.names)} class names")
                names = [str(i) for i in range(max(index) + 1)]
            return np.array(index, dtype=np.int32), names
        names = sorted(keys)
        position = {n: i for i, n in enumerate(names)}
        return np.array([position[k] for k in keys], dtype=np.int32), names


# ---------------------------------------------------------------- what a kind's lister returns

Progress = Callable[[int, int], None]  # progress(inputs listed, bytes read), called now and then while listing


@dataclass
class Listing:
    """What a lister returns once it has added its inputs to the catalog writer."""

    reader: Reader  # read_many(refs) -> bytes or OSError per ref, in worker processes
    class_names: list[str] = field(default_factory=list)
    label_map: np.ndarray | None = None  # labels added as `LabelTable` codes -> class indices (None: added as such)
    details: dict[str, Any] = field(default_factory=dict)  # the manifest's `source` record, beyond kind and path
    ordered: bool = False  # the catalog already is in its final order (no shuffle of single inputs)
    refs_are_rows: bool = False  # an item's ref is its catalog row (datasets) rather than its id (paths)


Lister = Callable[[SourceSpec, CatalogWriter, FailureLog, int, Progress], Listing]


def labelled_listing(reader: Reader, labels: LabelTable, **fields: Any) -> Listing:
    """A `Listing` whose labels were added as codes of `labels`."""
    label_map, class_names = labels.finish()
    return Listing(reader, class_names, label_map, **fields)


def apply_repeated_rows(source: Source, mode: str) -> None:
    """Rows that name a path an earlier row names (the catalog's `repeats`): refuse (error), leave them out and
    record them (skip: each path is written once, with its first row's label), or keep them (written as often as
    listed). Left in, a repeated image can land in both train and val."""
    catalog = source.catalog
    repeats = catalog.repeats
    if not len(repeats):
        return
    rows, earlier = repeats[:, 0], repeats[:, 1]
    relabelled = int(np.count_nonzero(catalog.labels[rows] != catalog.labels[earlier]))
    if mode == "error":
        example = catalog.ids(rows[:1])[0]
        other = f", {relabelled:,} of them with another label" if relabelled else ""
        raise SourceError(f"{len(rows):,} of the {len(catalog):,} rows of {source.path} name a path an earlier row "
                          f"names (first: {example!r}{other}); pass --repeated-rows skip to write each path once "
                          "(its first row), or --repeated-rows keep to write every row")
    if mode == "skip":
        for start in range(0, len(rows), 65536):
            chunk = slice(start, start + 65536)
            same_label = (catalog.labels[rows[chunk]] == catalog.labels[earlier[chunk]]).tolist()
            for source_id, first_id, same in zip(catalog.ids(rows[chunk]), catalog.ids(earlier[chunk]), same_label):
                source.failures.add(source_id, "repeated", f"names the path of an earlier row ({first_id})"
                                    f"{'' if same else ', with another label'}; written once, as that row")
        catalog.splits[rows] = EXCLUDED
    else:
        source.num_repeated = len(rows)


def apply_unlabelled_rows(source: Source, mode: str, every_row: bool = False) -> None:
    """A labelled source with unlabelled inputs: refuse (error), leave them out and record them (skip), or keep.
    `every_row`: apply it even when nothing is labelled (a plan part cannot see whether the others are)."""
    catalog = source.catalog
    if not source.class_names and not every_row:
        return
    missing = np.flatnonzero((catalog.labels < 0) & (catalog.splits != EXCLUDED))
    if not len(missing):
        return
    if mode == "error":
        example = catalog.ids(missing[:1])[0]
        raise SourceError(f"{len(missing):,} of {source.num_inputs:,} inputs of {source.path} have no label (first: "
                          f"{example!r}) while the others have one; pass --unlabelled-rows skip to leave them out, "
                          "or --unlabelled-rows keep to write them without a label (pretraining only)")
    if mode == "skip":
        for start in range(0, len(missing), 65536):
            chunk = missing[start: start + 65536]
            for source_id in catalog.ids(chunk):
                source.failures.add(source_id, "unlabelled", "no label while the other inputs have one")
        catalog.splits[missing] = EXCLUDED
    else:
        source.num_unlabelled = len(missing)
