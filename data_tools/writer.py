"""Writing webdataset tars from bytes: fixed metadata (byte-reproducible), atomic (temporary name, then rename)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path


class ShardWriter:
    """Writes one shard; `close()` renames `<name>.tmp` to `<name>` and returns (samples, bytes, sha256)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.tar = tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT)
        self.count = 0

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

    def close(self) -> tuple[int, int, str]:
        self.tar.close()
        digest = hashlib.sha256()
        with open(self.tmp, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        size = self.tmp.stat().st_size
        os.replace(self.tmp, self.path)
        return self.count, size, digest.hexdigest()
