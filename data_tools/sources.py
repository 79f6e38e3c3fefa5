"""Sources: where the images come from, listed once into a catalog (data_tools/plan.py) before anything is read.

`open_source` lists SOURCE into a `Source`: the catalog of inputs (an id, a label, a split per input), the class
names, and a picklable `reader` that worker processes (or Ray tasks) use to fetch an input's original bytes. Only
ids are listed, never image bytes, and no Python object is kept per input. Kinds:

* `folder`: one sub-folder of images per class (labels are the sorted sub-folder names, as torchvision and HF do);
* `unlabelled`: every image under SOURCE, recursively, label -1;
* `list`: a CSV (header with `path`, optional `label` and `split`) or JSONL file (same keys) of image paths,
  relative to the list's folder; the list may be a local file or an fsspec URL (`s3://bucket/list.csv`);
* `hf`: a Hugging Face `datasets` dataset: a `save_to_disk` folder, parquet file(s), a folder of images read with
  the "imagefolder" builder, or a hub name. Images are read with `Image(decode=False)`: original bytes. With
  `streaming`, parquet files are read where they are, row group by row group (data_tools/hf_stream.py).

Folder trees are walked depth first with each folder's entries sorted by name (the order of `sorted(rglob)`),
following symbolic links. Whatever is met and not used is recorded with its reason (`FailureLog`): unreadable
folders, dangling links, links that loop back to a folder that contains them, files that are not images, files
outside any class folder, list rows without a usable path or label. Hidden entries (names starting with '.') are
not inputs and are passed over.
"""

from __future__ import annotations

import bisect
import collections
import csv
import errno
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from common import urls
from common.errors import UserError
from data_tools.plan import EXCLUDED, Catalog, CatalogWriter

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")  # split names end up in shard names and sample keys
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SPLIT_LIKE = {"train", "val", "valid", "validation", "test"}
KINDS = ("auto", "folder", "unlabelled", "list", "hf")
UNLABELLED_ROWS = ("error", "skip", "keep")
MAX_LABEL_INDEX = 10_000_000  # integer labels are class indices: a larger one is a mistake (or a memory bomb)
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
    allow_outside_paths: bool = False  # list rows may name absolute paths, URLs or paths above the list's folder


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

def _is_url(path: str) -> bool:
    scheme = urlparse(path).scheme
    return len(scheme) > 1


class FileReader:
    """Reads items whose `ref` is a path: relative to `base` (a folder or a URL), or, for list rows allowed outside
    it, absolute or a URL of its own. Remote reads have deadlines and bounded retries (common/urls.py)."""

    def __init__(self, base: str | Path = "") -> None:
        self.base = str(base)

    def location(self, ref: str | int) -> str:
        ref = str(ref)
        return ref if _is_url(ref) or os.path.isabs(ref) else urls.join(self.base, ref)

    def read(self, ref: str | int) -> bytes:
        where = self.location(ref)
        if urls.is_local(where):
            with open(urls.local_path(where), "rb") as f:
                return f.read()
        return urls.read_url(where)

    def read_many(self, refs: list) -> Iterator[bytes | OSError]:
        """Each ref's bytes, or the OSError that reading it raised, in order."""
        for ref in refs:
            try:
                yield self.read(ref)
            except OSError as e:
                yield e


class HFReader:
    """Reads original image bytes from Hugging Face datasets; `ref` is a row number across all `datasets` in turn.

    The datasets are Arrow tables memory-mapped from disk, so worker processes share them instead of copying."""

    def __init__(self, datasets: list[Any], image_column: str) -> None:
        self.datasets = datasets
        self.image_column = image_column
        self.offsets = [0]
        for ds in datasets:
            self.offsets.append(self.offsets[-1] + len(ds))

    def read(self, ref: str | int) -> bytes:
        i = bisect.bisect_right(self.offsets, int(ref)) - 1
        return image_value_bytes(self.datasets[i][int(ref) - self.offsets[i]][self.image_column], ref,
                                 self.image_column)

    def read_many(self, refs: list) -> Iterator[bytes | OSError]:
        for ref in refs:
            try:
                yield self.read(ref)
            except OSError as e:
                yield e


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


# ---------------------------------------------------------------- what open_source returns

@dataclass
class Source:
    """A listed SOURCE: its catalog, class names, reader and the inputs met but not listed (`failures`)."""

    kind: str
    path: str
    catalog: Catalog
    class_names: list[str]
    reader: Any  # FileReader, HFReader or ParquetStreamReader: read_many(refs) -> bytes or OSError per ref
    failures: FailureLog
    details: dict[str, Any] = field(default_factory=dict)
    ordered: bool = False  # the catalog already is in its final order (no shuffle of single inputs)
    refs_are_rows: bool = False  # an item's ref is its catalog row (datasets) rather than its id (paths)
    num_unlabelled: int = 0  # labelled source, unlabelled inputs kept (--unlabelled-rows keep)

    @property
    def num_inputs(self) -> int:
        return int(np.count_nonzero(self.catalog.splits != EXCLUDED))

    def describe(self) -> dict[str, Any]:
        """The manifest's `source` record."""
        return {"kind": self.kind, "path": self.path, "num_inputs": self.num_inputs, **self.details}

    def items(self, rows: np.ndarray) -> list[Item]:
        """The items of catalog `rows`, in that order."""
        ids = self.catalog.ids(rows)
        labels = self.catalog.labels[rows].tolist()
        refs = rows.tolist() if self.refs_are_rows else ids
        return [Item(i, r, lb) for i, r, lb in zip(ids, refs, labels)]

    def close(self) -> None:
        self.catalog.close()


# ---------------------------------------------------------------- labels

class BadLabel(ValueError):
    """A label value that cannot be a class (a float, a negative index, ...)."""


class LabelTable:
    """Label values as met while listing -> codes (first-seen order); at the end, codes -> class indices.

    Integers (and strings of digits) are class indices, with names '0'..'K-1' unless `names` are given (a
    ClassLabel's); other strings are names, indexed in sorted order; None, '' and -1 mean unlabelled."""

    def __init__(self, names: list[str] | None = None) -> None:
        self.names = names
        self.codes: dict[str, int] = {}
        self.intlike = True

    def code(self, value: Any) -> int:
        if value is None or value == "":
            return -1
        if isinstance(value, bool) or not isinstance(value, (int, str, np.integer)):
            raise BadLabel(f"label {value!r} is not an integer or a name")
        text = str(value).strip() if isinstance(value, str) else str(int(value))
        if re.fullmatch(r"[-+]?\d+", text):
            index = int(text)
            if index == -1:
                return -1
            if index < 0 or index >= MAX_LABEL_INDEX:
                raise BadLabel(f"label {value!r} is not a class index (0 to {MAX_LABEL_INDEX - 1:,}, or -1 for none)")
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


# ---------------------------------------------------------------- folders

def _sorted_entries(folder: str, rel: str, failures: FailureLog) -> list[os.DirEntry]:
    """A folder's entries sorted by name, hidden ones left out; [] (and a recorded failure) if it cannot be read."""
    try:
        with os.scandir(folder) as it:
            return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        failures.add(rel or ".", "unreadable_folder", os_error_detail(e))
        return []


def _entry_kind(entry: os.DirEntry) -> tuple[str, str]:
    """("dir" | "file", "") for what a (possibly linked) entry is, else a failure (reason, detail)."""
    try:
        if entry.is_dir():
            return "dir", ""
        if entry.is_file():
            return "file", ""
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink_loop", "the chain of links loops"
        return "unreadable", os_error_detail(e)
    if entry.is_symlink():
        try:
            os.stat(entry.path)
        except FileNotFoundError:
            return "broken_link", f"the link points to a missing target: {os.readlink(entry.path)}"
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "symlink_loop", "the chain of links loops"
            return "unreadable", os_error_detail(e)
    return "not_a_file", "a special file (pipe, socket or device)"


def _folder_key(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def walk_images(root: str, start: str, failures: FailureLog, emit: Callable[[str], None]) -> None:
    """`emit` the path (relative to `root`) of every image file under root/start, depth first with each folder's
    entries sorted by name, following links. Only the entries of the folders on the current path are held."""
    top = os.path.join(root, start) if start else root
    try:
        top_key = _folder_key(top)
    except OSError as e:
        failures.add(start or ".", "unreadable_folder", os_error_detail(e))
        return
    ancestors = {top_key}
    stack = [(start, iter(_sorted_entries(top, start, failures)), top_key)]
    while stack:
        rel_dir, entries, key = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            ancestors.discard(key)
            continue
        rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
        kind, detail = _entry_kind(entry)
        if kind == "dir":
            try:
                sub_key = _folder_key(entry.path)
            except OSError as e:
                failures.add(rel, "unreadable_folder", os_error_detail(e))
                continue
            if sub_key in ancestors:
                failures.add(rel, "symlink_loop", "a link to a folder that contains it")
                continue
            ancestors.add(sub_key)
            stack.append((rel, iter(_sorted_entries(entry.path, rel, failures)), sub_key))
        elif kind == "file":
            suffix = os.path.splitext(entry.name)[1].lower()
            if suffix in IMAGE_SUFFIXES:
                emit(rel)
            else:
                failures.add(rel, "not_an_image", f"extension '{suffix}' is not an image's "
                             f"({' '.join(sorted(IMAGE_SUFFIXES))})")
        else:
            failures.add(rel, kind, detail)


def _check_split_names(names: list[str], where: str) -> None:
    bad = [n for n in names if not SPLIT_NAME.match(n)]
    if bad:
        raise SourceError(f"split names in {where} must be letters, digits or '_' (got {', '.join(bad)})")


def _subfolders(folder: str, rel: str, failures: FailureLog, files_reason: str) -> list[str]:
    """Names of the sub-folders of `folder`; its other entries are recorded as failures (`files_reason`)."""
    names = []
    for entry in _sorted_entries(folder, rel, failures):
        kind, detail = _entry_kind(entry)
        entry_rel = f"{rel}/{entry.name}" if rel else entry.name
        if kind == "dir":
            names.append(entry.name)
        elif kind == "file":
            failures.add(entry_rel, files_reason, "a file where sub-folders are expected")
        else:
            failures.add(entry_rel, kind, detail)
    return names


def list_folder(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, labelled: bool) -> list[str]:
    """List a class-folder tree (`labelled`) or any tree of images (label -1) into `writer`; with existing splits,
    each sub-folder of SOURCE is a split holding such a tree, and classes are the union over splits (so labels
    agree). Returns the class names."""
    root = spec.path
    if not os.path.isdir(root):
        raise SourceError(f"source folder not found: {root}")
    try:
        os.scandir(root).close()
    except OSError as e:
        raise SourceError(f"cannot read source folder {root}: {os_error_detail(e)}") from None
    if spec.existing_splits:
        split_rels = _subfolders(root, "", failures, "outside_split_folder")
        if not split_rels:
            raise SourceError(f"--existing-splits: {root} has no split sub-folders (expected {root}/train, ...)")
        _check_split_names(split_rels, root)
    else:
        split_rels = [""]
    if not labelled:
        for rel in split_rels:
            code = writer.split_code(rel)
            walk_images(root, rel, failures, lambda path, c=code: writer.add(path, -1, c))
        return []
    per_split = {rel: _subfolders(os.path.join(root, rel) if rel else root, rel, failures, "outside_class_folder")
                 for rel in split_rels}
    classes = sorted({c for names in per_split.values() for c in names})
    if not classes:
        where = f"{root}/<split>" if spec.existing_splits else root
        raise SourceError(f"{where} has no class sub-folders (expected {where}/<class>/<image>; "
                          "use --source-kind unlabelled for a plain tree of images)")
    for rel, names in per_split.items():
        code = writer.split_code(rel)
        present = set(names)
        for label, name in enumerate(classes):
            if name in present:
                start = f"{rel}/{name}" if rel else name
                walk_images(root, start, failures, lambda path, lb=label, c=code: writer.add(path, lb, c))
    return classes


# ---------------------------------------------------------------- lists

class _CountingReader(io.RawIOBase):
    """A binary stream that counts the bytes read from it (for the listing's progress bar)."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self.stream, self.count = stream, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        self.count += len(data)
        return len(data)

    def close(self) -> None:
        self.stream.close()
        super().close()


def outside_reason(path: str) -> str | None:
    """Why a list row's path is not inside the list's folder (None when it is)."""
    if _is_url(path):
        return "is a URL"
    if os.path.isabs(path):
        return "is absolute"
    if os.path.normpath(path).split(os.sep)[0] == "..":
        return "leads out of the list's folder"
    return None


Row = tuple[int, Any, Any, Any, str]  # (line or row number, path, label, split, why the row is unusable or '')
LIST_COLUMNS = ("path", "label", "split")


def _csv_rows(stream: io.TextIOBase, name: str) -> Iterator[Row]:
    reader = csv.reader(stream)
    header = next(reader, None) or []
    if "path" not in header:
        raise SourceError(f"{name} has no 'path' column in its header line (has: {', '.join(header) or 'nothing'})")
    where = [header.index(c) if c in header else None for c in LIST_COLUMNS]
    width = max(i for i in where if i is not None) + 1
    for row in reader:
        if not row:  # a blank line
            continue
        if len(row) < width:
            row = row + [""] * (width - len(row))
        yield (reader.line_num, *(row[i] if i is not None else None for i in where), "")


def _jsonl_rows(stream: io.TextIOBase) -> Iterator[Row]:
    for lineno, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield lineno, None, None, None, f"not JSON: {e.msg}"
            continue
        if not isinstance(row, dict):
            yield lineno, None, None, None, "not a JSON object"
            continue
        yield lineno, row.get("path"), row.get("label"), row.get("split"), ""


def _parquet_rows(handle: Any, name: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(handle)
    names = parquet.schema_arrow.names
    if "path" not in names:
        raise SourceError(f"{name} has no 'path' column (has: {', '.join(names)})")
    columns = [c for c in LIST_COLUMNS if c in names]
    number = 0
    for batch in parquet.iter_batches(columns=columns, batch_size=65536):
        values = [batch.column(columns.index(c)).to_pylist() if c in columns else [None] * batch.num_rows
                  for c in LIST_COLUMNS]
        for path, label, split in zip(*values):
            number += 1
            yield number, path, label, split, ""


def list_kind_suffix(location: str) -> str:
    """.csv, .jsonl or .parquet: the format of a list file (or URL), from its name."""
    suffix = os.path.splitext(urlparse(location).path if _is_url(location) else location)[1].lower()
    return ".jsonl" if suffix == ".ndjson" else suffix


def list_paths(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, labels: LabelTable,
               progress: Callable[[int, int], None]) -> str:
    """List a CSV, JSONL or Parquet file of image paths with optional `label` and `split` into `writer`; returns the
    folder (or URL) that relative paths start from. `progress(rows, bytes read)` is called every 65,536 rows."""
    location = spec.path
    suffix = list_kind_suffix(location)
    if suffix not in (".csv", ".jsonl", ".parquet"):
        raise SourceError(f"list file must end in .csv, .jsonl or .parquet: {location}")
    if urls.is_local(location) and not os.path.isfile(urls.local_path(location)):
        raise SourceError(f"list file not found: {location}")
    name = os.path.basename(location.rstrip("/"))
    lineno = 0
    default_split = 0 if spec.existing_splits else writer.split_code("")
    try:
        if suffix == ".parquet":
            from data_tools.hf_stream import _open

            handle: Any = _open(location)
            count = None
            rows: Iterator[Row] = _parquet_rows(handle, name)
        else:
            count = _CountingReader(urls.open_url(location))
            handle = io.TextIOWrapper(io.BufferedReader(count, 1 << 20), encoding="utf-8",
                                      newline="" if suffix == ".csv" else None)
            rows = _csv_rows(handle, name) if suffix == ".csv" else _jsonl_rows(handle)
        with handle:
            for lineno, path, label_value, split_value, why in rows:
                if lineno % 65536 == 0:
                    progress(len(writer), count.count if count else 0)
                where = f"{name}:{lineno}"
                if why:
                    failures.add(where, "bad_row", why)
                    continue
                if not isinstance(path, str) or not path or "\0" in path:
                    failures.add(where, "bad_row", "no path" if not path else f"path {path!r} is not a file name")
                    continue
                if path.startswith("pipe:"):
                    raise SourceError(f"{where}: path {path!r} is a 'pipe:' command; lists name files, never commands")
                reason = outside_reason(path)
                if reason and not spec.allow_outside_paths:
                    raise SourceError(f"{where}: path {path!r} {reason}; list paths are relative to the list's folder "
                                      "unless you pass --allow-outside-paths")
                try:
                    label = labels.code(label_value)
                except BadLabel as e:
                    failures.add(path, "bad_label", str(e))
                    continue
                split = default_split
                if spec.existing_splits:
                    if not isinstance(split_value, str) or not split_value:
                        raise SourceError(f"--existing-splits: {where} has no 'split' value")
                    if not SPLIT_NAME.match(split_value):
                        raise SourceError(f"split names in {name} must be letters, digits or '_' "
                                          f"({where}: {split_value!r})")
                    split = writer.split_code(split_value)
                writer.add(path, label, split)
    except UnicodeDecodeError:
        raise SourceError(f"{name} is not UTF-8 text (near line {lineno + 1})") from None
    except csv.Error as e:
        raise SourceError(f"{name} is not a CSV file ({name}:{lineno + 1}: {e})") from None
    except OSError as e:
        raise SourceError(f"cannot read list {location}: {os_error_detail(e)}") from None
    except Exception as e:  # pyarrow's errors for a file that is not parquet
        if type(e).__module__.startswith("pyarrow"):
            raise SourceError(f"{name} is not a parquet list: {type(e).__name__}: {e}") from None
        raise
    progress(len(writer), count.count if count else 0)
    if _is_url(location):
        return location.rsplit("/", 1)[0]
    return os.path.dirname(urls.local_path(location)) or "."


# ---------------------------------------------------------------- Hugging Face datasets (loaded)

def _load_hf(path: str) -> Any:
    """A Dataset or DatasetDict from a save_to_disk folder, parquet file(s), an image folder, or a hub name."""
    import datasets  # imported here: only this source needs it, and it is slow to import

    p = Path(path)
    try:
        if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
            return datasets.load_from_disk(str(p)), "save_to_disk"
        if p.is_file() and p.suffix == ".parquet":
            return datasets.load_dataset("parquet", data_files=str(p)), "parquet"
        if p.is_dir() and any(p.rglob("*.parquet")):
            return datasets.load_dataset("parquet", data_dir=str(p)), "parquet"
        if p.is_dir():
            return datasets.load_dataset("imagefolder", data_dir=str(p)), "imagefolder"
        if p.exists():
            raise SourceError(f"{p} is neither a dataset folder nor a parquet file")
        return datasets.load_dataset(path), "hub"
    except SourceError:
        raise
    except Exception as e:  # datasets raises many types (ConnectionError offline, FileNotFoundError, ...)
        raise SourceError(f"could not load Hugging Face dataset '{path}': {hf_error(e)}") from None


def hf_error(error: Exception) -> str:
    """The first line of an error from `datasets`, with its type."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"


def choose_splits(available: list[str], spec: SourceSpec, path: str) -> list[str]:
    """The dataset splits to read: --split (comma-separated), or every split with --existing-splits, or train."""
    split = spec.split if spec.split is not None else ("" if spec.existing_splits else "train")
    wanted = [s for s in split.split(",") if s] or list(available)
    missing = [s for s in wanted if s not in available]
    if missing:
        raise SourceError(f"split {', '.join(missing)} not in {path} (has: {', '.join(available)})")
    if not spec.existing_splits and len(wanted) > 1:
        raise SourceError("several --split names need --existing-splits (or pass one split and --val-fraction)")
    if spec.existing_splits:
        _check_split_names(wanted, path)
    return wanted


def pick_image_column(features: Any, wanted: str, path: str) -> str:
    """--image-column, or 'image', or the first Image column."""
    import datasets

    column = wanted or ("image" if "image" in features else next(
        (k for k, v in features.items() if isinstance(v, datasets.Image)), ""))
    if column not in features:
        raise SourceError(f"no image column '{column or '?'}' in {path} (columns: {', '.join(features)}); "
                          "pass --image-column")
    return column


def list_hf(spec: SourceSpec, writer: CatalogWriter) -> tuple[HFReader, dict, LabelTable]:
    """List a loaded Hugging Face dataset: ids `<split>/<row>`, refs = catalog rows; returns the reader, the
    manifest details and the label table."""
    import datasets

    loaded, how = _load_hf(spec.path)
    if not isinstance(loaded, datasets.DatasetDict):
        loaded = datasets.DatasetDict({(spec.split or "train").split(",")[0]: loaded})
    parts = {s: loaded[s] for s in choose_splits(list(loaded), spec, spec.path)}
    first = next(iter(parts.values()))
    image_column = pick_image_column(first.features, spec.image_column, spec.path)
    label_column = spec.label_column if spec.label_column and spec.label_column in first.features else None
    names = None
    if label_column and isinstance(first.features[label_column], datasets.ClassLabel):
        names = list(first.features[label_column].names)
    labels = LabelTable(names)
    tables = []
    for name, ds in parts.items():
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # original bytes, no re-encoding
        code = writer.split_code(name if spec.existing_splits else "")
        if label_column is None:
            for i in range(len(ds)):
                writer.add(f"{name}/{i}", -1, code)
        else:
            row = 0
            for batch in ds.select_columns([label_column]).iter(batch_size=10_000):
                for value in batch[label_column]:
                    try:
                        label = labels.code(value)
                    except BadLabel as e:
                        raise SourceError(f"{spec.path} split {name} row {row}: {e}") from None
                    writer.add(f"{name}/{row}", label, code)
                    row += 1
        tables.append(ds.select_columns([image_column]))
    details = {"loader": how, "splits": list(parts), "image_column": image_column, "label_column": label_column}
    return HFReader(tables, image_column), details, labels


# ---------------------------------------------------------------- choosing and opening

def detect_kind(path: str) -> str:
    """`auto`: .csv/.jsonl is a list; a datasets folder (parquet files in it or in its data/ folder, or a
    save_to_disk folder), a parquet file, or a missing path shaped like a hub name
    ("name", "owner/name") is `hf`; any other folder is a class-folder tree; any other missing path an error."""
    lowered = (urlparse(path).path if _is_url(path) else path).lower()
    if lowered.endswith((".csv", ".jsonl", ".ndjson")):
        return "list"
    if lowered.endswith(".parquet") and (_is_url(path) or os.path.isfile(path)) and _is_path_list(path):
        return "list"
    p = Path(path)
    if p.is_dir():
        if ((p / "dataset_dict.json").exists() or (p / "state.json").exists() or any(p.glob("*.parquet"))
                or any(p.glob("data/*.parquet"))):  # data/: the Hub's layout
            return "hf"
        return "folder"
    if p.suffix == ".parquet" and p.exists():
        return "hf"
    if not p.exists():
        if HUB_NAME.match(path):  # "name" or "owner/name": a dataset on the Hugging Face hub
            return "hf"
        raise SourceError(f"source not found: {path}")
    raise SourceError(f"cannot tell what kind of source {path} is; pass --source-kind")


def _is_path_list(location: str) -> bool:
    """A parquet file with a string 'path' column and no image column is a list of paths, not a dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_tools.hf_stream import _open

    try:
        with _open(location) as f:
            schema = pq.read_schema(f)
    except (OSError, pa.ArrowException):
        return False
    images = [f for f in schema if pa.types.is_struct(f.type) or pa.types.is_binary(f.type)]
    return "path" in schema.names and pa.types.is_string(schema.field("path").type) and not images


def _unlabelled_rows(source: Source, mode: str) -> None:
    """A labelled source with unlabelled inputs: refuse (error), leave them out and record them (skip), or keep."""
    catalog = source.catalog
    if not source.class_names:
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


def open_source(spec: SourceSpec, workdir: Path, seed: int = 0,
                progress: Callable[[int, int], None] = lambda rows, done: None) -> Source:
    """List SOURCE as the given kind (see the module docstring) into a catalog under `workdir` (local scratch
    space). `seed` orders the files of a streaming dataset. The caller closes the returned source."""
    kind = spec.kind
    if kind == "auto":
        kind = "hf" if spec.streaming and (os.path.isdir(spec.path) or not os.path.exists(spec.path)) else \
            detect_kind(spec.path)
    if kind not in KINDS[1:]:
        raise SourceError(f"unknown source kind {kind!r} (one of {', '.join(KINDS)})")
    if spec.streaming and kind != "hf":
        raise SourceError(f"--streaming reads Hugging Face datasets; {spec.path} is a {kind} source")
    if spec.unlabelled_rows not in UNLABELLED_ROWS:
        raise SourceError(f"--unlabelled-rows must be one of {', '.join(UNLABELLED_ROWS)}")
    writer = CatalogWriter(workdir)
    failures = FailureLog(Path(workdir) / "listing_failures.jsonl")
    details: dict[str, Any] = {}
    ordered = refs_are_rows = False
    label_map, class_names = None, []
    if kind in ("folder", "unlabelled"):
        class_names = list_folder(spec, writer, failures, labelled=kind == "folder")
        reader: Any = FileReader(spec.path)
        if kind == "folder" and not spec.existing_splits and set(class_names) <= SPLIT_LIKE:
            print(f"note: the class folders of {spec.path} look like splits ({', '.join(class_names)}); "
                  "pass --existing-splits to use them as splits")
    elif kind == "list":
        labels = LabelTable()
        reader = FileReader(list_paths(spec, writer, failures, labels, progress))
        label_map, class_names = labels.finish()
    elif spec.streaming:
        from data_tools.hf_stream import list_parquet_stream

        reader, details, labels = list_parquet_stream(spec, writer, seed, progress)
        label_map, class_names = labels.finish()
        ordered = refs_are_rows = True
    else:
        reader, details, labels = list_hf(spec, writer)
        label_map, class_names = labels.finish()
        refs_are_rows = True
    catalog = writer.finish(label_map)
    failures.file.flush()
    source = Source(kind, spec.path, catalog, class_names, reader, failures, details, ordered, refs_are_rows)
    _unlabelled_rows(source, spec.unlabelled_rows)
    failures.close()
    return source
