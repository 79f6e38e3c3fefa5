"""Reading bytes by path or URL, with deadlines: shards, manifests and list files are all opened here (local files,
`http(s)://`, `pipe:CMD`, and fsspec's schemes such as `s3://`). Opening and every read run under an idle deadline
(`StreamStalled` when no byte arrives in time) and callers retry a bounded number of times, so neither a silent
server nor a hung network mount can hang a run (the deadlines themselves: deadlines.py). See docs/data_stream.md and
docs/reliability.md."""

from __future__ import annotations

import concurrent.futures
import http.client
import io
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlparse

from vit_mpp.config.sections import READ_RETRIES, READ_TIMEOUT_S
from vit_mpp.data.deadlines import DaemonCaller, DeadlineReader, StreamStalled, pause
from vit_mpp.errors import UserError

T = TypeVar("T")
BUFFER = 1 << 20  # remote reads are buffered in 1 MiB pieces: few deadline round trips per shard
WAIT_S = 1.0


class RemoteError(UserError):
    """A URL that cannot be read as asked (no backend for its scheme, refused for good)."""


def is_local(url: str) -> bool:
    """Whether `url` is a local path (no scheme, `file://`, or a Windows drive letter)."""
    scheme = urlparse(url).scheme
    return scheme in ("", "file") or len(scheme) == 1


def local_path(url: str) -> str:
    """The filesystem path of a local `url`."""
    return urlparse(url).path if url.startswith("file://") else url


def join(location: str, name: str) -> str:
    """`name` inside `location`, a folder path or a URL."""
    if is_local(location) and not location.startswith("file://"):
        return os.path.join(location, name)
    return location.rstrip("/") + "/" + name


def is_permanent(error: BaseException) -> bool:
    """Whether retrying cannot help: a missing file, or an HTTP status that will not change (4xx but 408/429)."""
    if isinstance(error, urllib.error.HTTPError):
        return 400 <= error.code < 500 and error.code not in (408, 429)
    return isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError))


class _Command:
    """The standard output of a `pipe:` command; closing it checks the command's exit status."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, bufsize=BUFFER)

    def read1(self, n: int) -> bytes:
        return self.proc.stdout.read1(n)

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        self.proc.stdout.close()
        status = self.proc.wait()
        # A reader that stops early closes the pipe: the command then dies of SIGPIPE, which is not a failure.
        if status not in (0, -13, 141):
            raise OSError(f"command {self.command!r} exited with status {status}")


def _open_raw(url: str, timeout: float) -> Any:
    """The undeadlined stream of a remote `url` (called under the deadline)."""
    scheme = urlparse(url).scheme
    if scheme in ("http", "https"):
        return urllib.request.urlopen(url, timeout=timeout)
    if scheme == "pipe":
        return _Command(url[len("pipe:"):])
    return _open_fsspec(url, timeout)


def _open_local(url: str, timeout: float) -> Any:
    """The undeadlined, unbuffered file of a local `url` (called under the deadline; buffering is the caller's)."""
    return open(local_path(url), "rb", buffering=0)


def _open_fsspec(url: str, timeout: float) -> Any:
    """The undeadlined, seekable fsspec file of a remote `url` (called under the deadline)."""
    try:
        import fsspec

        return fsspec.open(url, "rb").open()
    except (ImportError, ValueError) as e:  # fsspec missing; fsspec's unknown protocol
        raise RemoteError(f"cannot read {url}: {e}") from None


def as_os_error(url: str, fn: Callable[[], T]) -> T:
    """`fn()`; a backend's own exception type for network trouble (aiohttp's, botocore's, fsspec's ValueError for a
    server that ignores ranges) becomes an OSError, which callers retry and report."""
    try:
        return fn()
    except (OSError, RemoteError):
        raise
    except Exception as e:
        raise OSError(f"{url}: {type(e).__name__}: {e}") from None


class _DeadlineSeekable(DeadlineReader):
    """A remote file (through fsspec) that can also seek; opening, every read and every seek must finish within
    `timeout` seconds, as for `DeadlineReader`."""

    def __init__(self, url: str, timeout: float) -> None:
        super().__init__(url, timeout, lambda u, t: as_os_error(u, lambda: _open_fsspec(u, t)))

    def _live(self) -> Any:
        if self._stream is None:
            raise StreamStalled(f"{self.url}: the stream was aborted")
        return self._stream

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        stream = self._live()
        data = self._call(lambda: as_os_error(self.url, lambda: stream.read(len(buffer))), "reading")
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        stream = self._live()
        return self._call(lambda: as_os_error(self.url, lambda: stream.seek(offset, whence)), "seeking")

    def tell(self) -> int:
        return self._live().tell()  # the position is kept locally: no I/O, nothing to wait for


@dataclass(frozen=True)
class ReadPolicy:
    """How a reader reads one file: the idle deadline, the retries after a failed attempt and the first wait."""

    timeout: float = READ_TIMEOUT_S
    retries: int = READ_RETRIES
    wait_s: float = WAIT_S


def open_url(url: str, timeout: float = READ_TIMEOUT_S) -> BinaryIO:
    """A buffered binary stream of `url` (a local file or a remote stream) whose opening and every read have the
    idle deadline `timeout`: `StreamStalled` when it passes."""
    opener = _open_local if is_local(url) else _open_raw
    return io.BufferedReader(DeadlineReader(url, timeout, opener), buffer_size=BUFFER)


def worth_retrying(url: str, error: BaseException) -> bool:
    """Whether reading `url` again may help after `error`: a remote error that is not permanent, or a local stall."""
    if is_local(url):
        return isinstance(error, StreamStalled)
    return not is_permanent(error)


def with_retries(action: Callable[[], T], url: str, retries: int, wait_s: float) -> T:
    """`action()`, repeated after an OSError `retries` times, after `wait_s`, then twice that, ...; an error that
    retrying cannot help (see `worth_retrying`: a missing file, HTTP 4xx, a local error other than a stall) is raised at
    once."""
    attempt = 0
    while True:
        try:
            return action()
        except OSError as e:
            if not worth_retrying(url, e) or attempt >= retries:
                raise
        pause(wait_s * 2**attempt)
        attempt += 1


def read_url(url: str, timeout: float = READ_TIMEOUT_S, retries: int = READ_RETRIES, wait_s: float = WAIT_S) -> bytes:
    """The whole content of a (small) file at `url`; remote reads are retried `retries` times with backoff.

    Raises the last OSError when every attempt failed (FileNotFoundError and HTTP 4xx are not retried).
    """
    def read() -> bytes:
        with open_url(url, timeout) as f:
            return f.read()

    return with_retries(read, url, retries, wait_s)


def open_seekable(url: str, timeout: float | None = None, retries: int | None = None,
                  wait_s: float | None = None) -> BinaryIO:
    """A seekable binary file of `url` (what pyarrow needs for parquet): a local file, or a buffered remote file
    through fsspec (`http(s)://`, `s3://`, `hf://`, ...) whose opening and every read and seek run under the idle
    deadline `timeout`, raising `StreamStalled` when it passes. Opening is retried `retries` times with backoff
    from `wait_s` (as `read_url`); reads are not (see `read_seekable`). None: READ_TIMEOUT_S, READ_RETRIES and WAIT_S as
    they are when called."""
    if is_local(url):
        return open(local_path(url), "rb")
    limit = READ_TIMEOUT_S if timeout is None else timeout
    return with_retries(lambda: io.BufferedReader(_DeadlineSeekable(url, limit), buffer_size=BUFFER), url,
                         READ_RETRIES if retries is None else retries, WAIT_S if wait_s is None else wait_s)


def read_seekable(url: str, read: Callable[[BinaryIO], T], timeout: float | None = None, retries: int | None = None,
                  wait_s: float | None = None) -> T:
    """`read(file)` on `url` opened with `open_seekable`; an attempt that fails with an OSError (a stall included)
    is started again, `retries` times with backoff, as `read_url` does (None: as `open_seekable`). `read` must not
    have effects that a second attempt would repeat."""
    def attempt() -> T:
        with open_seekable(url, timeout, retries=0) as f:
            return read(f)

    return with_retries(attempt, url, READ_RETRIES if retries is None else retries,
                         WAIT_S if wait_s is None else wait_s)


def read_stream(url: str, read: Callable[[BinaryIO], T], timeout: float | None = None, retries: int | None = None,
                wait_s: float | None = None) -> T:
    """`read(stream)` on `url` opened with `open_url` (every remote read under the idle deadline `timeout`); an
    attempt that fails with an OSError (a stall, a reset, a body
    shorter than its headers promised) is started again from the beginning, `retries` times with backoff, as
    `read_url` does (None: READ_TIMEOUT_S, READ_RETRIES and WAIT_S as they are when called). `read` must not have
    effects that a second attempt would repeat."""
    limit = READ_TIMEOUT_S if timeout is None else timeout

    def attempt() -> T:
        with open_url(url, limit) as stream:
            try:
                return read(stream)
            except http.client.HTTPException as e:  # http.client's own type for a cut body: retried as an OSError
                raise OSError(f"{url}: {type(e).__name__}: {e}") from None

    return with_retries(attempt, url, READ_RETRIES if retries is None else retries,
                         WAIT_S if wait_s is None else wait_s)


def list_folder(url: str, timeout: float | None = None, retries: int | None = None,
                wait_s: float | None = None) -> list[tuple[str, int | None]]:
    """The files directly in the remote folder `url` (fsspec `ls`: `s3://`, `gs://`, `hf://`, and `http(s)://`
    index pages), as (URL, size or None), sorted by URL. The listing runs under the idle deadline `timeout` and is
    retried `retries` times with backoff (None: as `read_stream`); a folder that does not exist raises
    FileNotFoundError."""
    limit = READ_TIMEOUT_S if timeout is None else timeout

    def attempt() -> list[tuple[str, int | None]]:
        try:
            import fsspec.core

            fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:  # no backend for the scheme, or an unknown protocol
            raise RemoteError(f"cannot list {url}: {e}") from None
        caller = DaemonCaller()
        try:
            entries = caller.call(lambda: as_os_error(url, lambda: fs.ls(root, detail=True)), limit)
        except concurrent.futures.TimeoutError:
            raise StreamStalled(f"{url}: no answer for {limit:g} s while listing") from None
        finally:
            caller.stop()
        found = [(e["name"], e.get("size")) for e in entries if e.get("type") == "file"]
        return sorted((name if "://" in name else fs.unstrip_protocol(name), size) for name, size in found)

    return with_retries(attempt, url, READ_RETRIES if retries is None else retries,
                         WAIT_S if wait_s is None else wait_s)


def _list_once(url: str, timeout: float) -> list[tuple[str, int, bool]]:
    """One attempt of `list_remote`: the listing runs in a daemon thread, waited for at most `timeout` seconds."""
    try:
        import fsspec.core

        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # no backend for the scheme, or an unknown protocol
        raise RemoteError(f"cannot list {url}: {e}") from None
    pattern = any(c in path for c in "*?[")

    def entries() -> list[tuple[str, int, bool]]:
        found = fs.glob(path, detail=True) if pattern else fs.ls(path, detail=True)
        found = found.values() if isinstance(found, dict) else found
        return [(fs.unstrip_protocol(e["name"]), int(e.get("size") or 0), e.get("type") == "directory")
                for e in found]

    caller = DaemonCaller()
    try:
        return caller.call(lambda: as_os_error(url, entries), timeout)
    except concurrent.futures.TimeoutError:
        raise StreamStalled(f"{url}: no answer for {timeout:g} s while listing") from None
    finally:
        caller.stop()


def list_remote(url: str, timeout: float = READ_TIMEOUT_S, retries: int = READ_RETRIES,
                wait_s: float = WAIT_S) -> list[tuple[str, int, bool]]:
    """The entries of a remote folder, or what a glob pattern (`*`, `?`, `[`) matches, through fsspec: (URL, size,
    is a folder) each. The listing runs under the deadline `timeout` and is retried `retries` times with backoff,
    as `read_url`; a missing folder is an empty list for a pattern and FileNotFoundError otherwise."""
    return with_retries(lambda: _list_once(url, timeout), url, retries, wait_s)
