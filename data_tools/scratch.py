"""Scratch folders under $TMPDIR (the catalog of listed inputs, tars staged for upload) that survive a killed build.

A build killed with SIGKILL, by the OOM killer or by a lost node cannot remove its scratch folder, and a catalog of
a billion inputs is gigabytes. Each folder therefore holds a lock file that its build keeps locked (`flock`, released
by the kernel when the build and every worker it forked are gone), and every build first removes the folders whose
lock it can take: those of builds that are no longer running, on this host or in any container sharing $TMPDIR.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREFIX = "build-shards-"
LOCK_NAME = ".owner.lock"

_held: dict[Path, int] = {}  # scratch folder -> the descriptor that holds its lock


def make_scratch(kind: str) -> Path:
    """A new scratch folder `build-shards-<kind>-XXXX` under $TMPDIR, locked by this process until `remove_scratch`."""
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-"))
    # Locked before it gets its name: a sweeping build never sees an unlocked lock file of a living build.
    fd = os.open(path / f"{LOCK_NAME}.new", os.O_CREAT | os.O_WRONLY, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(path / f"{LOCK_NAME}.new", path / LOCK_NAME)
    _held[path] = fd
    return path


def remove_scratch(path: Path) -> None:
    """Delete a folder made by `make_scratch` and release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


@contextmanager
def scratch(kind: str) -> Iterator[Path]:
    """A scratch folder for the duration of the block."""
    path = make_scratch(kind)
    try:
        yield path
    finally:
        remove_scratch(path)


def sweep_stale(tmp: str | None = None) -> tuple[int, int]:
    """Remove the scratch folders of builds that are no longer running; returns (folders, bytes) removed.

    Folders without a lock file (a build being created, or one of an older version) are left alone."""
    removed = size = 0
    root = Path(tmp or tempfile.gettempdir())
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p not in _held]
    except OSError:
        return 0, 0
    for folder in candidates:
        try:
            fd = os.open(folder / LOCK_NAME, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its build is running
        try:
            size += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed, size
