"""Durable file writes: what a crash (kill -9, power loss) may not leave half-written.

Every small file that marks something as done (a checkpoint's marker, a shard set's manifest, a cut-back metrics
log, a build journal) is written by `write_atomic`: to a temporary name beside it, synced, renamed into place, and
the folder synced, so a reader sees the old file or the new one, never a torn one. The new file's permissions
follow the umask, as a plain `open` would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from vit_mpp.errors import UserError

TMP_SUFFIX = ".tmp"
FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or a full quota


class WriteFailed(UserError):
    """A file could not be written (a full disk or quota, a refused permission, an I/O error): one line naming it,
    what was needed and how to go on. What was half-written is removed; what was there before is left as it was."""


def write_failed(path: str | Path, error: OSError, needed: int | None = None) -> WriteFailed:
    """The one line for a write of `path` that failed with `error` (`path` may carry the flag that named it);
    `needed`: about how many bytes it needed, said with the free space when the disk or quota is full."""
    reason = (os.strerror(error.errno) if error.errno else " ".join(str(error).split())).lower()
    line = f"{path} cannot be written: {reason}"
    if error.errno in FULL:
        try:
            free = shutil.disk_usage(_existing(Path(str(path).split(" ")[-1]))).free
            line += f"; {free / 1e6:,.1f} MB free there" + (f", about {needed / 1e6:,.1f} MB needed" if needed else "")
        except OSError:
            pass
        line += "; free some space, then run the same command to go on"
    return WriteFailed(line)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# How writers that are not Python's own file objects report a full disk: safetensors' Rust writer (SafetensorError,
# `I/O error: No space left on device (os error 28)`), torch's zip writer (RuntimeError, `unexpected pos ...` or
# `basic_ios::clear`, whatever the I/O error behind it).
_FOREIGN = ((("Disk quota exceeded", "os error 122"), errno.EDQUOT),
            (("No space left on device", "os error 28", "unexpected pos", "basic_ios"), errno.ENOSPC))


def os_error_of(error: BaseException) -> OSError | None:
    """The OSError a writer's exception stands for: itself when it is one, a full disk or quota for the exceptions
    other writers raise for them (`_FOREIGN`), None for anything else (a bug keeps its traceback)."""
    if isinstance(error, OSError):
        return error
    for failure in getattr(error, "failures", {}).values():  # torch.distributed.checkpoint's: (error, trace) per rank
        found = os_error_of(failure[0] if isinstance(failure, tuple) else failure)
        if found is not None:
            return found
    text = str(error)
    for needles, number in _FOREIGN:
        if any(n in text for n in needles):
            return OSError(number, os.strerror(number))
    return None


@contextlib.contextmanager
def writing(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """Writes to `path` in the block: an OSError (or another writer's full disk, `os_error_of`) becomes the one-line
    WriteFailed (`write_failed`)."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as e:
        os_error = os_error_of(e)
        if os_error is None:
            raise
        raise write_failed(path, os_error, needed) from None


def append_whole(path: str | Path, text: str) -> None:
    """Append `text` to `path` whole or not at all: what a full disk let through of it is cut back off, so that a
    log of lines never ends in a torn one (a reader of metrics.jsonl between the failure and the resume); the
    failure is the one-line WriteFailed."""
    data = text.encode("utf-8")
    with writing(path, len(data)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                left = memoryview(data)
                while left:
                    left = left[os.write(fd, left):]
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


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
    """Write `data` to `path` so that it is either wholly there or not changed (see the module doc); a write that
    fails (a full disk) leaves no temporary file and is the one-line WriteFailed."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_failed(path, e, len(raw)) from None
