"""Writing webdataset tars from bytes: fixed metadata (byte-reproducible), atomic (temporary name, synced, then
renamed: vit_mpp/durable.py).

The tar is written directly, byte for byte what `tarfile` writes in USTAR format for a regular file with our fixed
metadata (mode 0444, owner 0, mtime 0, no owner names; tests/test_shards.py compares the two): tarfile builds
each 512-byte header in Python, field by field, which cost build-shards' workers about 8% of their time at three
files per sample. The sha256 and size are computed while writing, so a finished shard is never read back.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vit_mpp import durable

BLOCK = 512  # tar block
RECORD = 20 * BLOCK  # tarfile pads the archive to whole records of 20 blocks
FLUSH = 1 << 20  # bytes gathered before they are hashed and written: fewer, larger calls

# A USTAR header with our fixed fields, split around what varies per file (name, size, checksum).
_MODE_OWNER = b"0000444\0" + b"0000000\0" * 2  # mode, uid, gid
_MTIME = b"%011o\0" % 0
_AFTER_CHECKSUM = (b"0" + b"\0" * 100  # type: regular file; no link name
                   + b"ustar\x0000" + b"\0" * 64)  # magic and version; no user or group name; then all NUL (the
# device numbers, empty for a regular file as tarfile writes them, and the name prefix)


def ustar_header(name: str, size: int) -> bytes:
    """The 512-byte USTAR header `tarfile` writes for a regular file `name` of `size` bytes with our fixed
    metadata. Names must fit USTAR's 100-byte name field (sample keys are short)."""
    raw = name.encode("utf-8")
    if len(raw) > 100:
        raise ValueError(f"tar member name {name!r} is longer than 100 bytes")
    header = bytearray(raw.ljust(100, b"\0") + _MODE_OWNER + b"%011o\0" % size + _MTIME + b" " * 8
                       + _AFTER_CHECKSUM)
    header += bytes(BLOCK - len(header))
    # The checksum counts its own field as spaces; written as 6 octal digits, NUL, and the 8th space kept.
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header)


class ShardWriter:
    """Writes one shard to `<name>.tmp`; `close()` renames it to `<name>` and returns (samples, bytes, sha256).

    `finish()` completes the temporary file but leaves the rename to the caller (build-shards' workers write
    tars whose final names only the main process knows)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.pending = bytearray()
        self.count = 0

    @property
    def bytes_written(self) -> int:
        return self.size

    def _put(self, data: bytes) -> None:
        self.pending += data
        self.size += len(data)
        if len(self.pending) >= FLUSH:
            self._drain()

    def _drain(self) -> None:
        self.sha256.update(self.pending)
        self.file.write(self.pending)
        self.pending.clear()

    def write(self, key: str, files: dict[str, bytes]) -> None:
        """Add one sample: `files` maps extension to bytes; they are stored adjacent, as `<key>.<ext>`."""
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        for ext, data in files.items():
            self._put(ustar_header(f"{key}.{ext}", len(data)))
            self._put(data)
            if len(data) % BLOCK:
                self._put(bytes(BLOCK - len(data) % BLOCK))
        self.count += 1

    def finish(self) -> tuple[int, int, str]:
        """Complete and sync the temporary file, without renaming it; returns (samples, bytes, sha256)."""
        if not self.file.closed:
            end = self.size + 2 * BLOCK  # two zero blocks end the archive, then padding to a whole record
            self._put(bytes(2 * BLOCK + (-end) % RECORD))
            self._drain()
            self.file.flush()
            os.fsync(self.file.fileno())  # the shard is on disk before the journal says it is
            self.file.close()
        return self.count, self.size, self.sha256.hexdigest()

    def close(self) -> tuple[int, int, str]:
        stats = self.finish()
        durable.replace(self.tmp, self.path)
        return stats


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
