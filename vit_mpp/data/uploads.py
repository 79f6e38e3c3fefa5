"""Writing a local file to a store by URL (fsspec: `s3://`, `gs://`, `memory://`, SFTP, ...), with the deadlines and
bounded retries of reading (urls.py): `upload_file`, what build-shards and a run's published exports write with.
An abandoned attempt never touches the object a later attempt finished. See docs/reliability.md."""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections.abc import Callable
from typing import Any

from vit_mpp.config.sections import READ_RETRIES, READ_TIMEOUT_S
from vit_mpp.data.deadlines import DaemonCaller, StreamStalled
from vit_mpp.data.urls import BUFFER, WAIT_S, RemoteError, as_os_error, with_retries


def _bounded(fn: Callable[[], Any], timeout: float) -> None:
    """Run `fn` in a daemon thread and wait for it at most `timeout` seconds; its errors are ignored (clean-up)."""
    def quiet() -> None:
        try:
            fn()
        except Exception:  # clean-up after a failure: nothing more to report
            pass

    worker = threading.Thread(target=quiet, daemon=True)
    worker.start()
    worker.join(timeout)


_SHOWN_WHILE_WRITTEN: dict[type, bool] = {}  # per kind of store (fsspec filesystem class), asked once


def _shows_files_while_written(fs: Any, probe: str, call: Callable[[Callable[[], Any], str], Any]) -> bool:
    """Whether `fs` shows a file as soon as it is opened for writing (fsspec's memory store, SFTP, HDFS) rather than
    once its upload completes (object stores); asked once per kind of store with an empty file at `probe`, which is
    removed (`call` runs each step under the upload's deadline)."""
    kind = type(fs)
    if kind not in _SHOWN_WHILE_WRITTEN:
        handle = call(lambda: fs.open(probe, "wb"), "connecting")
        try:
            shown = bool(call(lambda: fs.exists(probe), "connecting"))
        finally:
            call(handle.close, "finishing")
            call(lambda: fs.rm(probe), "removing a probe")
        _SHOWN_WHILE_WRITTEN[kind] = shown
    return _SHOWN_WHILE_WRITTEN[kind]


def _upload_once(path: str, url: str, timeout: float) -> None:
    try:
        import fsspec.core

        fs, final = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # no backend for the scheme, or an unknown protocol
        raise RemoteError(f"cannot write {url}: {e}") from None
    caller = DaemonCaller()
    target: Any = None
    # An attempt abandoned at its deadline goes on in its thread and may still act later (its open, a write, the
    # removal of its part). On a store that shows a file while it is written, that late act would truncate or delete
    # the object a later attempt finished, after the build journaled it: there each attempt writes a name of its
    # own and renames it whole once closed. An object store's upload is invisible until it completes.
    own = f"{final}.upload-{uuid.uuid4().hex[:12]}"
    shown = False
    renamed = False

    def call(fn: Callable[[], Any], doing: str) -> Any:
        try:
            return caller.call(fn, timeout)
        except concurrent.futures.TimeoutError:
            raise StreamStalled(f"{url}: no progress for {timeout:g} s while {doing}") from None

    def attempt() -> None:
        nonlocal shown, renamed, target
        shown = _shows_files_while_written(fs, own, call)
        target = call(lambda: fs.open(own if shown else final, "wb"), "connecting")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(BUFFER), b""):
                call(lambda b=block: target.write(b), "writing")
        call(target.close, "finishing")
        target = None
        if shown:
            call(lambda: fs.mv(own, final), "renaming")
            renamed = True

    try:
        as_os_error(url, attempt)  # a backend's own error types for network trouble: retried like an OSError
    finally:
        # This attempt's own name (its upload where the store shows files while written, or the probe that asks),
        # never the object's: removed on the attempt's thread after the call it may still be stuck in, as an open or
        # a close that answers late makes the name again; and at once where the upload wrote it (a probe that failed
        # is not waited for: on a dead store each attempt would wait out the deadline once more)
        if not renamed and (shown or type(fs) not in _SHOWN_WHILE_WRITTEN):
            if shown:
                _bounded(lambda: fs.rm(own), timeout)
            caller.submit(lambda: fs.rm(own))
        elif target is not None and hasattr(target, "discard"):  # an aborted multipart upload never becomes visible
            _bounded(target.discard, timeout)
        caller.stop()


def upload_file(path: str, url: str, timeout: float = READ_TIMEOUT_S, retries: int = READ_RETRIES,
                wait_s: float = WAIT_S) -> None:
    """Copy the local file `path` to `url` through fsspec (`s3://`, `gs://`, `memory://`, ...).

    Opening, every 1 MiB write and the final commit each run under the idle deadline `timeout`; an upload that fails
    or stalls is abandoned (an unfinished multipart upload is aborted, so object stores never show part of it; a store
    that shows a file while it is written gets each attempt under a name of its own, renamed once closed) and
    started again, `retries` times with backoff. Raises the last OSError when every attempt failed (a missing
    bucket or a refused permission is not retried).
    """
    with_retries(lambda: _upload_once(path, url, timeout), url, retries, wait_s)
