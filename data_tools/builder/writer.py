"""Writing webdataset tars from bytes (`ShardWriter`): byte for byte what `tarfile` writes for our fixed metadata,
hashed as written, handed to the kernel without a copy, and atomic (temporary name, synced, then renamed:
vit_mpp/durable.py). See docs/build_shards.md#shards.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vit_mpp import durable

BLOCK = 512  # tar block
RECORD = 20 * BLOCK  # tarfile pads the archive to whole records of 20 blocks
FLUSH = 1 << 20  # bytes gathered before they are written: fewer, larger calls
MAX_PIECES = 512  # ... or pieces (os.writev takes at most IOV_MAX, 1024 on Linux, at a time)
ZEROS = bytes(RECORD)

# A USTAR header with our fixed fields, split around what varies per file (name, size, checksum).
_MODE_OWNER = b"0000444\0" + b"0000000\0" * 2  # mode, uid, gid
_MTIME = b"%011o\0" % 0
_AFTER_CHECKSUM = (b"0" + b"\0" * 100  # type: regular file; no link name
                   + b"ustar\x0000" + b"\0" * 64)  # magic and version; no user or group name; then all NUL (the
# device numbers, empty for a regular file as tarfile writes them, and the name prefix)
_TAIL = _AFTER_CHECKSUM + bytes(BLOCK - 100 - len(_MODE_OWNER) - 12 - len(_MTIME) - 8 - len(_AFTER_CHECKSUM))
# The checksum is the sum of the header's bytes with its own field counted as 8 spaces: the fixed fields' share
# once, so each header adds only its name's and size's bytes.
_FIXED_SUM = sum(_MODE_OWNER) + sum(_MTIME) + 8 * ord(" ") + sum(_TAIL)


def ustar_header(name: str, size: int) -> bytes:
    """The 512-byte USTAR header `tarfile` writes for a regular file `name` of `size` bytes with our fixed
    metadata. Names must fit USTAR's 100-byte name field (sample keys are short)."""
    raw = name.encode("utf-8")
    if len(raw) > 100:
        raise ValueError(f"tar member name {name!r} is longer than 100 bytes")
    size_field = b"%011o\0" % size
    # The checksum: 6 octal digits, NUL, and the 8th byte kept a space (what tarfile writes).
    checksum = b"%06o\0 " % (_FIXED_SUM + sum(raw) + sum(size_field))
    return b"".join((raw.ljust(100, b"\0"), _MODE_OWNER, size_field, _MTIME, checksum, _TAIL))


class ShardWriter:
    """Writes one shard to `<name>.tmp`; `close()` renames it to `<name>` and returns (samples, bytes, sha256).

    `finish()` completes the temporary file but leaves the rename to the caller (build-shards' workers write
    tars whose final names only the main process knows)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.file = open(self.tmp, "wb", buffering=0)
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.pieces: list[bytes] = []  # hashed, not yet written
        self.pending = 0  # their bytes
        self.count = 0

    @property
    def bytes_written(self) -> int:
        return self.size

    def _put(self, data: bytes) -> None:
        self.sha256.update(data)
        self.pieces.append(data)
        self.pending += len(data)
        self.size += len(data)

    def _drain(self) -> None:
        pieces, fd = self.pieces, self.file.fileno()
        while pieces:
            try:
                written = os.writev(fd, pieces)
            except OSError as e:
                e.needed = self.size  # the shard's bytes so far: what a full disk was asked to hold
                raise
            if written == sum(map(len, pieces)):
                break
            while written >= len(pieces[0]):  # a short write (rare for a file): go on where it stopped
                written -= len(pieces.pop(0))
            pieces[0] = pieces[0][written:]
        pieces.clear()
        self.pending = 0

    def write(self, key: str, files: dict[str, bytes]) -> None:
        """Add one sample: `files` maps extension to bytes; they are stored adjacent, as `<key>.<ext>`."""
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        self.write_members([(f"{key}.{ext}", data) for ext, data in files.items()])

    def write_members(self, members: list[tuple[str, bytes]]) -> None:
        """Add one sample as its members (name, bytes), in order: a sample copied from another tar keeps its
        names (`build-shards subset`), where `write` makes them from a key."""
        put, added = self.pieces.append, 0
        for name, data in members:
            header = ustar_header(name, len(data))
            pad = ZEROS[: -len(data) % BLOCK]
            for piece in (header, data, pad):
                if piece:
                    self.sha256.update(piece)
                    put(piece)
            added += len(header) + len(data) + len(pad)
        self.size += added
        self.pending += added
        self.count += 1
        if self.pending >= FLUSH or len(self.pieces) >= MAX_PIECES:
            self._drain()

    def finish(self, sync: bool = True) -> tuple[int, int, str]:
        """Complete the temporary file, without renaming it; returns (samples, bytes, sha256). `sync`: flush it to
        disk first (build-shards' workers leave that to whoever publishes the shard, off the workers' time)."""
        if not self.file.closed:
            end = self.size + 2 * BLOCK  # two zero blocks end the archive, then padding to a whole record
            self._put(ZEROS[: 2 * BLOCK + (-end) % RECORD])
            self._drain()
            if sync:
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
