"""Source kind `list`: CSV, JSONL or Parquet lists of image paths (one file, or a folder or pattern of them:
list_files.py), local or at a URL, read once as a stream (`list_path_list`). Paths are relative to the list's
folder; one leading out of it is refused unless `allow_outside_paths`. See docs/build_shards.md#sources.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from data_tools.builder.catalog import CatalogWriter
from data_tools.builder.sources.base import (
    SPLIT_NAME,
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
from data_tools.builder.sources.list_files import ListFile, list_suffix, resolve_list_files
from vit_mpp.data import urls
from vit_mpp.data.labels import BadLabel


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


LEADS_OUT = "leads out of the list's folder"


def outside_reason(path: str) -> str | None:
    """Why a list row's path is not inside the list's folder (None when it is)."""
    if ":" not in path and not path.startswith("/") and ".." not in path:
        return None  # no scheme, not absolute, no way up: the common row, without urlparse (half of listing it)
    if is_url(path):
        return "is a URL"
    if os.path.isabs(path):
        return "is absolute"
    if os.path.normpath(path).split(os.sep)[0] == "..":
        return LEADS_OUT
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


def _open_rows(file: ListFile) -> tuple[Any, _CountingReader | None, Iterator[Row]]:
    """(handle to close, byte counter or None, rows) of one list file, by its suffix."""
    suffix = list_suffix(file.location)
    if suffix == ".parquet":
        handle = urls.open_seekable(file.location)
        return handle, None, _parquet_rows(handle, file.name)
    count = _CountingReader(urls.open_url(file.location, urls.READ_TIMEOUT_S))  # the deadline as set when called
    handle = io.TextIOWrapper(io.BufferedReader(count, 1 << 20), encoding="utf-8",
                              newline="" if suffix == ".csv" else None)
    return handle, count, (_csv_rows(handle, file.name) if suffix == ".csv" else _jsonl_rows(handle))


SplitOf = Callable[[str], int]  # an input's id -> its split code (planned builds: val by a hash of the id)


@dataclass
class ListedInto:
    """Where listed rows go: the catalog `writer`, the `failures` log, the `labels` table, `progress(rows, bytes
    read)` and, for a planned build, `split_of` an input's id."""

    writer: CatalogWriter
    failures: FailureLog
    labels: LabelTable
    progress: Progress
    split_of: SplitOf | None = None


def list_file(file: ListFile, spec: SourceSpec, into: ListedInto) -> int:
    """Add the rows of one CSV, JSONL or Parquet list file (image paths with optional `label` and `split`) to
    `into.writer`, ids relative to the SOURCE's root; returns the bytes read. `into.progress` is called every 65,536
    rows. Without `split_of` and --existing-splits, every row goes to split '' (split later, by the plan)."""
    name, prefix = file.name, file.prefix
    writer, failures, labels, progress, split_of = into.writer, into.failures, into.labels, into.progress, into.split_of
    lineno = 0
    default_split = 0 if spec.existing_splits else writer.split_code("") if split_of is None else -1
    count = None
    try:
        handle, count, rows = _open_rows(file)
        with handle:
            for lineno, path, label_value, split_value, why in rows:
                if lineno % 65536 == 0:
                    progress(len(writer), count.count if count else 0)
                if why:
                    failures.add(f"{name}:{lineno}", "bad_row", why)
                    continue
                if not isinstance(path, str) or not path or "\0" in path:
                    failures.add(f"{name}:{lineno}", "bad_row",
                                 "no path" if not path else f"path {path!r} is not a file name")
                    continue
                if path.startswith("pipe:"):
                    raise SourceError(f"{name}:{lineno}: path {path!r} is a 'pipe:' command; lists name files, never "
                                      "commands")
                reason = outside_reason(path)
                if reason and not spec.allow_outside_paths:
                    raise SourceError(f"{name}:{lineno}: path {path!r} {reason}; list paths are relative to the "
                                      "list's folder unless you pass --allow-outside-paths")
                if prefix and reason in (None, LEADS_OUT):
                    path = prefix + path  # relative to its own file's folder: to the root, for the one reader
                try:
                    label = labels.code(label_value)
                except BadLabel as e:
                    failures.add(path, "bad_label", str(e))
                    continue
                split = default_split
                if spec.existing_splits:
                    if not isinstance(split_value, str) or not split_value:
                        raise SourceError(f"--existing-splits: {name}:{lineno} has no 'split' value")
                    if not SPLIT_NAME.match(split_value):
                        raise SourceError(f"split names in {name} must be letters, digits or '_' "
                                          f"({name}:{lineno}: {split_value!r})")
                    split = writer.split_code(split_value)
                elif split_of is not None:
                    split = split_of(path)
                writer.add(path, label, split)
    except UnicodeDecodeError:
        raise SourceError(f"{name} is not UTF-8 text (near line {lineno + 1})") from None
    except csv.Error as e:
        raise SourceError(f"{name} is not a CSV file ({name}:{lineno + 1}: {e})") from None
    except OSError as e:
        raise SourceError(f"cannot read list {file.location}: {os_error_detail(e)}") from None
    except Exception as e:  # pyarrow's errors for a file that is not parquet
        if type(e).__module__.startswith("pyarrow"):
            raise SourceError(f"{name} is not a parquet list: {type(e).__name__}: {e}") from None
        raise
    done = count.count if count else file.size
    progress(len(writer), done)
    return done


def list_rows(files: list[ListFile], spec: SourceSpec, into: ListedInto) -> None:
    """`list_file` for each of `files` in turn; `into.progress` sees the bytes read over all of them."""
    done = 0
    for file in files:
        def show(rows: int, read: int, before: int = done) -> None:
            into.progress(rows, before + read)

        done += list_file(file, spec, dataclasses.replace(into, progress=show))


def list_path_list(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, seed: int,
                   progress: Progress) -> Listing:
    """Kind `list`: one list file, or a folder or pattern of them (list_files.py), listed in the order of their
    names; items are read by their path, relative to their list's folder (or URL)."""
    source = resolve_list_files(spec.path)
    labels = LabelTable()
    list_rows(source.files, spec, ListedInto(writer, failures, labels, progress))
    details = {} if source.single else {"files": len(source.files)}
    return labelled_listing(FileReader(source.root), labels, details=details)
