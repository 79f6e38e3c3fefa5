"""Which tars `build-shards index` reads (`list_shards`: folders, `.tar` files or URLs, brace patterns) and where
its manifest goes (`place_manifest`); every mistake here is one line, found before any shard is read.
See docs/build_shards.md#indexing-shards-you-already-have.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from braceexpand import UnbalancedBracesError, braceexpand

from vit_mpp.data import urls
from vit_mpp.errors import UserError

SHARD_SUFFIX = ".tar"
SPLIT_NAME = re.compile(r"[A-Za-z0-9_]+")


class IndexInputError(UserError):
    """A LOCATION, split or output that `build-shards index` cannot use; one line."""


@dataclass(frozen=True)
class ShardRef:
    """One tar to index: its split, where it is (an absolute path or a URL) and its size when the listing gave it."""

    split: str
    url: str
    size: int | None


def folder_of(url: str) -> str:
    """The folder (or URL prefix) that holds a shard."""
    return os.path.dirname(url) if urls.is_local(url) else url.rsplit("/", 1)[0]


def _local_pattern(names: list[str], location: str) -> list[tuple[str, int | None]]:
    found = []
    for name in names:
        path = os.path.abspath(urls.local_path(name))
        try:
            found.append((path, os.stat(path).st_size))
        except FileNotFoundError:
            raise IndexInputError(f"{name}: no such shard (named by the pattern {location})") from None
        except OSError as e:
            raise IndexInputError(f"{name}: cannot be read: {e.strerror or e}") from None
    return found


def _local_folder(path: str, location: str) -> list[tuple[str, int | None]]:
    try:
        with os.scandir(path) as entries:
            return sorted((os.path.abspath(e.path), e.stat().st_size) for e in entries
                          if e.name.endswith(SHARD_SUFFIX) and e.is_file())
    except OSError as e:
        raise IndexInputError(f"cannot list {location}: {e.strerror or e}") from None


def _remote_folder(location: str, timeout: float, retries: int) -> list[tuple[str, int | None]]:
    try:
        files = urls.list_folder(location, timeout, retries)
    except FileNotFoundError:
        raise IndexInputError(f"{location}: no such folder") from None
    except OSError as e:
        raise IndexInputError(f"cannot list {location}: {' '.join(str(e).split())}") from None
    return [(url, size) for url, size in files if url.endswith(SHARD_SUFFIX)]


def expand(location: str, timeout: float = urls.READ_TIMEOUT_S, retries: int = urls.READ_RETRIES,
           ) -> list[tuple[str, int | None]]:
    """The shards a LOCATION names, as (absolute path or URL, size or None), in order."""
    if "{" in location:
        try:
            names = list(braceexpand(location))
        except UnbalancedBracesError:
            raise IndexInputError(f"{location}: unbalanced braces in the pattern") from None
        found = (_local_pattern(names, location) if urls.is_local(location)
                 else [(name, None) for name in names])  # a missing remote shard is found when it is opened
    elif urls.is_local(location):
        path = urls.local_path(location)
        if os.path.isdir(path):
            found = _local_folder(path, location)
        elif os.path.isfile(path):
            found = [(os.path.abspath(path), os.path.getsize(path))]
        else:
            raise IndexInputError(f"{location}: no such folder or file")
    elif location.endswith(SHARD_SUFFIX):
        found = [(location, None)]
    else:
        found = _remote_folder(location.rstrip("/"), timeout, retries)
    if not found:
        raise IndexInputError(f"{location}: no {SHARD_SUFFIX} files (a folder of webdataset shards, or a pattern "
                              "such as 'shards/{00000..00099}.tar')")
    return found


def split_names(locations: list[str], splits: list[str] | None) -> list[str]:
    """The split of each LOCATION: `train` for all, the one --split for all, or one --split per LOCATION."""
    names = splits or ["train"]
    if len(names) == 1:
        names = names * len(locations)
    if len(names) != len(locations):
        raise IndexInputError(f"--split is given {len(splits or [])} times for {len(locations)} LOCATIONs: give it "
                              "once (every LOCATION in that split) or once per LOCATION, in the same order")
    for name in names:
        if not SPLIT_NAME.fullmatch(name):
            raise IndexInputError(f"--split {name!r}: split names are letters, digits and '_'")
    return names


def list_shards(locations: list[str], splits: list[str] | None, timeout: float = urls.READ_TIMEOUT_S,
                retries: int = urls.READ_RETRIES) -> list[ShardRef]:
    """Every shard to index, by split in the order the splits first appear, then in LOCATION order."""
    shards: list[ShardRef] = []
    seen: dict[str, str] = {}
    for location, split in zip(locations, split_names(locations, splits)):
        for url, size in expand(location, timeout, retries):
            if url in seen:
                raise IndexInputError(f"{url} is named twice (in {seen[url]} and {location}): a shard belongs to "
                                      "one split, once")
            seen[url] = location
            shards.append(ShardRef(split, url, size))
    order = list(dict.fromkeys(s.split for s in shards))
    return sorted(shards, key=lambda s: order.index(s.split))  # stable: listing order within a split


@dataclass(frozen=True)
class Placement:
    """Where the manifest goes (`out`: a folder or URL, or the `.json` file itself), the `location` field when it
    is not beside the shards, and each shard's name in it (plain when the shards share one folder, else the
    absolute path or URL)."""

    out: str
    location: str | None
    names: dict[str, str]


def place_manifest(shards: list[ShardRef], out: str | None) -> Placement:
    """Beside the shards when they share one local folder and no --out is given; else in --out, with a `location`
    field naming the shards' folder when they share one."""
    folders = sorted({folder_of(s.url) for s in shards})
    if out is None:
        if len(folders) > 1:
            raise IndexInputError(f"the shards are in {len(folders)} folders ({folders[0]}, {folders[1]}, ...): give "
                                  "--out DIR for the manifest")
        if not urls.is_local(folders[0]):
            raise IndexInputError(f"the shards are remote ({folders[0]}): give --out DIR (a folder or URL) for the "
                                  "manifest")
        out = folders[0]
    target = os.path.abspath(urls.local_path(out)) if urls.is_local(out) else out.rstrip("/")
    beside = folder_of(target) if target.endswith(".json") else target  # the folder the manifest is in
    base = folders[0] if len(folders) == 1 else None
    names = {s.url: s.url if base is None else os.path.basename(s.url) if urls.is_local(s.url)
             else s.url.rsplit("/", 1)[1] for s in shards}
    return Placement(target, None if base == beside else base, names)
