"""Durable file writes: what a crash (kill -9, power loss) may not leave half-written.

Every small file that marks something as done (a checkpoint's marker, a shard set's manifest, a cut-back metrics
log, a build journal) is written by `write_atomic`: to a temporary name beside it, synced, renamed into place, and
the folder synced, so a reader sees the old file or the new one, never a torn one. The new file's permissions
follow the umask, as a plain `open` would.
"""

from __future__ import annotations

import os
from pathlib import Path

TMP_SUFFIX = ".tmp"


def fsync(path: str | Path) -> None:
    """Flush a written file, or a folder's entries (so a rename in it survives a crash), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(src: str | Path, dst: str | Path) -> None:
    """Rename `src` over `dst` and sync the folder of `dst`, so the rename itself is on disk."""
    os.replace(src, dst)
    fsync(Path(dst).parent)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` so that it is either wholly there or not changed (see the module doc)."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    replace(tmp, path)
