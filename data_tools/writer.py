"""Writing webdataset tars from bytes: fixed metadata (byte-reproducible), atomic (temporary name, then rename).

The sha256 and size are computed while writing, so a finished shard is never read back.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it.

    tarfile writes many small pieces (512-byte headers, padding); hashing and writing them one by one costs more
    in per-call overhead than in hashing, on the process that also feeds the workers. So they are gathered and
    hashed and written in blocks of `BLOCK` bytes.
    """

    BLOCK = 1 << 20

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.pending = bytearray()

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, data) -> int:
        self.pending += data
        self.size += len(data)
        if len(self.pending) >= self.BLOCK:
            self._drain()
        return len(data)

    def _drain(self) -> None:
        self.sha256.update(self.pending)
        self.f.write(self.pending)
        self.pending.clear()

    def close(self) -> None:
        if not self.f.closed:
            self._drain()
            self.f.flush()
            os.fsync(self.f.fileno())  # the shard is on disk before the journal says it is
            self.f.close()
        super().close()


class ShardWriter:
    """Writes one shard to `<name>.tmp`; `close()` renames it to `<name>` and returns (samples, bytes, sha256).

    `finish()` completes the temporary file but leaves the rename to the caller (build-shards' workers write
    tars whose final names only the main process knows)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.file = _HashingFile(self.tmp)
        self.tar = tarfile.open(fileobj=self.file, mode="w", format=tarfile.USTAR_FORMAT)
        self.count = 0

    @property
    def bytes_written(self) -> int:
        return self.file.size

    def write(self, key: str, files: dict[str, bytes]) -> None:
        """Add one sample: `files` maps extension to bytes; they are stored adjacent, as `<key>.<ext>`."""
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        for ext, data in files.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), 0, 0o444  # fixed: same input -> same bytes
            info.uname = info.gname = ""
            self.tar.addfile(info, io.BytesIO(data))
        self.count += 1

    def finish(self) -> tuple[int, int, str]:
        """Complete and sync the temporary file, without renaming it; returns (samples, bytes, sha256)."""
        self.tar.close()
        self.file.close()
        return self.count, self.file.size, self.file.sha256.hexdigest()

    def close(self) -> tuple[int, int, str]:
        stats = self.finish()
        os.replace(self.tmp, self.path)
        return stats


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
