"""Source kind `list`: a CSV, JSONL or Parquet list of image paths, local or at a URL, listed as a stream.

Columns (CSV header, JSONL keys, Parquet columns): `path`, optional `label` and `split`. Paths are relative to the
list's folder (or URL); a path that is absolute, a URL or leads above that folder is refused unless
`allow_outside_paths`, and a `pipe:` command never runs. Rows without a usable path or label are recorded and left
out. The list is read once, front to back, whether local or remote; no row is kept in memory. Remote lists are read
through vit_mpp/urls.py, with its idle deadline on every read (a Parquet list through its seekable opener).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from data_tools.catalog import CatalogWriter
from data_tools.sources.base import (
    SPLIT_NAME,
    BadLabel,
    FailureLog,
    FileReader,
    LabelTable,
    Listing,
    Progress,
    SourceError,
    SourceSpec,
    is_url,
    labelled_listing,
    os_error_detail,
)
from vit_mpp import urls


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
    if is_url(path):
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
    suffix = os.path.splitext(urlparse(location).path if is_url(location) else location)[1].lower()
    return ".jsonl" if suffix == ".ndjson" else suffix


def list_paths(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, labels: LabelTable,
               progress: Progress) -> str:
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
            handle: Any = urls.open_seekable(location)
            count = None
            rows: Iterator[Row] = _parquet_rows(handle, name)
        else:
            count = _CountingReader(urls.open_url(location, urls.READ_TIMEOUT_S))  # the deadline as set when called
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
    if is_url(location):
        return location.rsplit("/", 1)[0]
    return os.path.dirname(urls.local_path(location)) or "."


def list_path_list(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, seed: int,
                   progress: Progress) -> Listing:
    """Kind `list`: items are read by their path, relative to the list's folder (or URL)."""
    labels = LabelTable()
    base = list_paths(spec, writer, failures, labels, progress)
    return labelled_listing(FileReader(base), labels)


def is_path_list(location: str) -> bool:
    """A parquet file with a string 'path' column and no image column is a list of paths, not a dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = urls.read_seekable(location, pq.read_schema)
    except (OSError, pa.ArrowException):
        return False
    images = [f for f in schema if pa.types.is_struct(f.type) or pa.types.is_binary(f.type)]
    return "path" in schema.names and pa.types.is_string(schema.field("path").type) and not images
