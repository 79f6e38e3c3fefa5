"""OUT, where a build writes: a local folder (`LocalStore`) or an fsspec URL (`RemoteStore`), with the same few
operations, so the build, the journal and merge never ask which one they have: `publish` (a finished tar becomes a
shard: synced and renamed, or uploaded whole), `write_text` (small files, whole), `list_sizes` (one listing).
See docs/build_shards.md#object-storage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from data_tools.scratch import make_scratch, remove_scratch
from vit_mpp import durable
from vit_mpp.data import uploads, urls
from vit_mpp.errors import UserError


class OutputError(UserError):
    """OUT cannot be used as asked (a file, not writable, inside SOURCE, holding another build); one line."""


class LocalStore:
    """OUT as a local folder; temporary tars are written in it, so publishing is a rename."""

    local = True

    def __init__(self, path: str) -> None:
        self.url = path
        self.path = Path(urls.local_path(path))

    def __repr__(self) -> str:
        return str(self.path)

    def check(self) -> None:
        """Create OUT if needed and make sure files can be written in it (nothing is overwritten)."""
        for parent in [self.path, *self.path.parents]:
            if parent.exists() and not parent.is_dir():
                raise OutputError(f"output folder {self.path} cannot be created: {parent} is a file")
        self.created = [p for p in [self.path, *self.path.parents] if not p.exists()][::-1]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".build-shards-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise OutputError(f"output folder {self.path} is not writable: {e.strerror or e}") from None

    def undo_check(self) -> None:
        """Remove the folders `check` created, if still empty (a build that stopped at a user error)."""
        for folder in reversed(getattr(self, "created", [])):
            try:
                folder.rmdir()
            except OSError:
                return

    def staging(self) -> Path:
        return self.path

    def list_sizes(self) -> dict[str, int]:
        if not self.path.is_dir():
            return {}
        with os.scandir(self.path) as it:
            return {e.name: e.stat().st_size for e in it if e.is_file()}

    def read_text(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except UnicodeDecodeError:
            return ""

    def write_text(self, name: str, text: str) -> None:
        durable.write_atomic(self.path / name, text)  # through `<name>.tmp`, which our_files() knows

    def append_text(self, name: str, text: str) -> None:
        """Append and sync (the journal)."""
        with open(self.path / name, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def publish(self, tmp: str | Path, name: str) -> None:
        durable.fsync(tmp)  # workers leave the tar unsynced (ShardWriter.finish(sync=False)): it is synced here,
        durable.replace(tmp, self.path / name)  # then renamed, the rename on disk before the journal names the shard

    def delete(self, names: list[str]) -> None:
        for name in names:
            try:
                (self.path / name).unlink()
            except FileNotFoundError:
                pass

    def local_file(self, name: str) -> Path | None:
        return self.path / name

    def cleanup(self) -> None:
        pass


class RemoteStore:
    """OUT as an fsspec URL; temporary tars go to local scratch space (under $TMPDIR) and are uploaded."""

    local = False

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._fs: Any = None
        self._root = ""
        self._staging: Path | None = None

    def __repr__(self) -> str:
        return self.url

    def __getstate__(self) -> dict:  # Ray tasks get the URL and open their own filesystem and scratch space
        return {"url": self.url}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"])

    @property
    def fs(self) -> Any:
        if self._fs is None:
            try:
                import fsspec.core

                self._fs, self._root = fsspec.core.url_to_fs(self.url)
            except (ImportError, ValueError) as e:
                raise OutputError(f"cannot write to {self.url}: {e}") from None
        return self._fs

    def _path(self, name: str) -> str:
        _ = self.fs
        return f"{self._root.rstrip('/')}/{name}"

    def check(self) -> None:
        """Make sure OUT can be written: upload a small probe object and delete it."""
        try:
            self.fs.makedirs(self._root, exist_ok=True)
        except OSError:
            pass  # object stores have no folders; the probe decides
        probe = f".build-shards-probe-{os.getpid()}"
        try:
            self.write_text(probe, "")
            self.fs.rm(self._path(probe))
        except OSError as e:
            raise OutputError(f"cannot write to {self.url}: {type(e).__name__}: {e}") from None

    def undo_check(self) -> None:
        pass

    def staging(self) -> Path:
        if self._staging is None:
            self._staging = make_scratch("staging")
        return self._staging

    def list_sizes(self) -> dict[str, int]:
        self.fs.invalidate_cache(self._root)
        try:
            entries = self.fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return {}
        return {os.path.basename(e["name"].rstrip("/")): int(e.get("size") or 0) for e in entries
                if e.get("type") == "file"}

    def read_text(self, name: str) -> str | None:
        try:
            return urls.read_url(f"{self.url}/{name}").decode("utf-8")
        except FileNotFoundError:
            return None
        except UnicodeDecodeError:
            return ""

    def write_text(self, name: str, text: str) -> None:
        tmp = self.staging() / f"{name}.upload"
        tmp.write_text(text, encoding="utf-8")
        try:
            uploads.upload_file(str(tmp), f"{self.url}/{name}")
        finally:
            tmp.unlink(missing_ok=True)

    def publish(self, tmp: str | Path, name: str) -> None:
        uploads.upload_file(str(tmp), f"{self.url}/{name}")
        os.unlink(tmp)

    def delete(self, names: list[str]) -> None:
        if names:
            self.fs.rm([self._path(n) for n in names])

    def local_file(self, name: str) -> Path | None:
        return None

    def cleanup(self) -> None:
        if self._staging is not None:
            remove_scratch(self._staging)
            self._staging = None


def open_store(location: str) -> LocalStore | RemoteStore:
    """The store for OUT: a local path (or file:// URL), or any other URL through fsspec."""
    if location.startswith("pipe:"):
        raise OutputError(f"OUT cannot be a 'pipe:' command: {location}")
    return LocalStore(location) if urls.is_local(location) else RemoteStore(location)
