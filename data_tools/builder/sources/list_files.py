"""Which files a list SOURCE is made of: one list file, a folder of list files, or a glob pattern of them, in name
order with their sizes, from the listing alone (`resolve_list_files`); `is_list_folder` tells a folder of lists from
a class-folder tree. See docs/build_shards.md#sources ("Many list files").
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import urlparse

from data_tools.builder.sources.base import SourceError, is_url, os_error_detail
from vit_mpp.data import urls

LIST_SUFFIXES = (".csv", ".jsonl", ".ndjson", ".parquet")
WILDCARDS = "*?["


@dataclass(frozen=True)
class ListFile:
    """One list file: where it is, its name relative to the SOURCE's root, its size in bytes."""

    location: str
    name: str
    size: int

    @property
    def prefix(self) -> str:
        """The file's folder relative to the root ('' or 'sub/'): what its rows' relative paths start from."""
        folder = self.name.rpartition("/")[0]
        return f"{folder}/" if folder else ""


@dataclass(frozen=True)
class ListSource:
    """The files of a list SOURCE, sorted by name; `root` is the folder (or URL) that ids are relative to; `single`:
    SOURCE named one list file (the manifest then records no file count)."""

    root: str
    files: list[ListFile]
    single: bool


def list_suffix(location: str) -> str:
    """.csv, .jsonl or .parquet (or another suffix): the format of a list file (or URL), from its name."""
    suffix = os.path.splitext(urlparse(location).path if is_url(location) else location)[1].lower()
    return ".jsonl" if suffix == ".ndjson" else suffix


def has_wildcard(path: str) -> bool:
    """Whether `path` has glob characters (`*`, `?`, `[`)."""
    return any(c in (urlparse(path).path if is_url(path) else path) for c in WILDCARDS)


def is_pattern(path: str) -> bool:
    """Whether `path` is a glob pattern rather than one file or folder: it has glob characters and is not an
    existing local path (a folder may be named `images[2024]`)."""
    return has_wildcard(path) and not (urls.is_local(path) and os.path.exists(urls.local_path(path)))


def _skipped(name: str) -> bool:
    """Hidden files and Spark/Hadoop markers (`_SUCCESS`), passed over in a folder of lists."""
    return name.startswith((".", "_"))


def _root_of_pattern(pattern: str) -> str:
    """The folder of a pattern before its first wildcard: `lists/*/x.csv` -> `lists`."""
    head = pattern
    while has_wildcard(head):
        head = head.rsplit("/", 1)[0] if "/" in head else ""
    return head


def source_name(path: str) -> str:
    """The manifest's `name` of a SOURCE: its base name, or for a pattern that of its folder (`lists/*.parquet` ->
    `lists`)."""
    if is_pattern(path):
        path = _root_of_pattern(path) or os.getcwd()
    return PurePosixPath(path.rstrip("/")).name


def _check(location: str, name: str) -> None:
    """A file of a folder or pattern that is not a list is a one-line error."""
    if list_suffix(location) not in (".csv", ".jsonl", ".parquet"):
        raise SourceError(f"{location} is not a list file (.csv, .jsonl or .parquet): the files of a list SOURCE "
                          "folder or pattern must all be lists (names starting with '.' or '_' are passed over)")


def _single(path: str) -> ListSource:
    """SOURCE names one list file (checked for its suffix; a missing local file is an error)."""
    if list_suffix(path) not in (".csv", ".jsonl", ".parquet"):
        raise SourceError(f"list file must end in .csv, .jsonl or .parquet: {path}")
    if urls.is_local(path):
        local = urls.local_path(path)
        if not os.path.isfile(local):
            raise SourceError(f"list file not found: {path}")
        root = os.path.dirname(local) or "."
        return ListSource(root, [ListFile(path, os.path.basename(local), os.path.getsize(local))], True)
    return ListSource(path.rsplit("/", 1)[0], [ListFile(path, path.rsplit("/", 1)[1], 0)], True)


def _local_entries(path: str, pattern: bool) -> list[tuple[str, int, bool]]:
    """[(path, size, is a folder)] of a local folder's entries or of what a local pattern matches."""
    found = glob.glob(path, recursive=True) if pattern else [os.path.join(path, n) for n in os.listdir(path)]
    entries = []
    for p in found:
        try:
            entries.append((p, os.path.getsize(p), os.path.isdir(p)))
        except OSError:  # a dangling link: named as a bad entry below
            entries.append((p, 0, False))
    return entries


def _relative(location: str, root: str) -> str:
    """`location`'s name below `root` (URLs compared without their scheme: fsspec may spell `memory://x` as
    `memory:///x`)."""
    if urls.is_local(location):
        return os.path.relpath(location, root).replace(os.sep, "/")

    def key(url: str) -> str:
        parts = urlparse(url)
        return (parts.netloc + parts.path).strip("/")

    inner, outer = key(location), key(root)
    return inner[len(outer):].lstrip("/") if inner.startswith(outer) else inner.rsplit("/", 1)[-1]


def resolve_list_files(path: str) -> ListSource:
    """The list files of SOURCE `path`: one file, a folder's list files, or what a pattern matches; sorted by name."""
    path = path.rstrip("/") or path
    pattern, local = is_pattern(path), urls.is_local(path)
    if not pattern and (os.path.isdir(urls.local_path(path)) if local else not list_suffix(path)):
        root = urls.local_path(path) if local else path  # a folder of lists
    elif pattern:
        root = _root_of_pattern(urls.local_path(path) if local else path) or "."
    else:
        return _single(path)
    try:
        entries = _local_entries(urls.local_path(path), pattern) if local else urls.list_remote(path)
    except OSError as e:
        raise SourceError(f"cannot list {path}: {os_error_detail(e)}") from None
    files = []
    for location, size, is_folder in entries:
        name = _relative(location, root)
        if not pattern and _skipped(name):
            continue
        if is_folder:
            continue  # the images may be there (a pattern such as 'lists/*/*.parquet' reads sub-folders' lists)
        _check(location, name)
        files.append(ListFile(location, name, size))
    if not files:
        raise SourceError(f"no list files (.csv, .jsonl or .parquet) in {path}")
    return ListSource(root, sorted(files, key=lambda f: f.name), False)


def is_path_list(location: str) -> bool:
    """A parquet file with a string 'path' column and no image column is a list of paths, not a dataset. A file
    that is not parquet at all is a SourceError naming it, whatever kind of source it was meant to be."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = urls.read_seekable(location, pq.read_schema)
    except pa.ArrowInvalid as e:  # not parquet (no magic bytes, empty, cut short)
        raise SourceError(f"{location} is not a readable parquet file: {str(e).splitlines()[0]}") from None
    except (OSError, pa.ArrowException):
        return False
    images = [f for f in schema if pa.types.is_struct(f.type) or pa.types.is_binary(f.type)]
    return "path" in schema.names and pa.types.is_string(schema.field("path").type) and not images


def is_list_folder(path: str) -> bool:
    """A local folder whose visible entries are all files, among them a CSV or JSONL list, or Parquet files whose
    first is a list of paths (`is_path_list`), is a folder of lists (`--source-kind auto`)."""
    try:
        entries = [e for e in os.scandir(path) if not _skipped(e.name)]
    except OSError:
        return False
    if not entries or any(e.is_dir() for e in entries):
        return False
    suffixes = {list_suffix(e.name) for e in entries}
    if suffixes & {".csv", ".jsonl"}:
        return True
    parquet = sorted(e.path for e in entries if e.name.endswith(".parquet"))
    return bool(parquet) and is_path_list(parquet[0])
