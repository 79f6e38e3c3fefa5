"""Calls and streams with a deadline, what every read and write by URL runs under (urls.py, uploads.py): a daemon
thread runs the calls (`DaemonCaller`), so a call stuck on a dead connection is abandoned and never keeps the process
from exiting; `DeadlineReader` aborts a stream whose opening or read brings nothing in time (`StreamStalled`); and a
thread waiting on one runs its `while_waiting` check meanwhile, so a worker asked to stop leaves at once. See
docs/reliability.md."""

from __future__ import annotations

import concurrent.futures
import http.client
import io
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

CHECK_EVERY_S = 0.25  # how often a thread that waits on a read runs its `while_waiting` check

_waiting = threading.local()  # the check this thread runs while it waits (`while_waiting`)


def while_waiting(check: Callable[[], None] | None) -> None:
    """Have this thread run `check()` every CHECK_EVERY_S while it waits on a deadlined call (opening, a read, a
    seek, the pause before a retry). An exception it raises abandons the stream (aborted as a stalled one is) and
    propagates: a pool's workers, asked to stop, leave a stalled read at once instead of at its deadline. None: no
    check (the default)."""
    _waiting.check = check


def waiting_check() -> Callable[[], None] | None:
    """This thread's `while_waiting` check, for a helper thread that reads on its behalf to run too."""
    return getattr(_waiting, "check", None)


def pause(seconds: float) -> None:
    """Sleep `seconds`, running this thread's `while_waiting` check meanwhile."""
    check = getattr(_waiting, "check", None)
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if check is not None:
            check()
        time.sleep(min(left, CHECK_EVERY_S) if check is not None else left)


class StreamStalled(OSError):
    """A stream (remote, or a local file on a hung mount) brought no data within its deadline; it has been aborted."""


def read_some(stream: Any, n: int) -> bytes:
    """Up to `n` bytes, as soon as some have arrived. An HTTP body that ends before its Content-Length is an error
    (http.client's read1 would return b"" there, which looks like a normal end)."""
    data = stream.read1(n) if hasattr(stream, "read1") else stream.read(n)
    if not data and isinstance(stream, http.client.HTTPResponse) and stream.length:
        raise http.client.IncompleteRead(b"", stream.length)
    return data


def abort(stream: Any) -> None:
    """Stop a stream that another thread may be blocked on: kill its command, or close it."""
    if stream is None:
        return
    try:
        if hasattr(stream, "kill"):  # a `pipe:` command's output (urls.py): its process
            stream.kill()
        else:
            stream.close()
    except Exception:  # already broken: nothing more to stop
        pass


class DaemonCaller:
    """Runs calls one at a time in a daemon thread: a call stuck on a dead connection is abandoned, and never keeps
    the process from exiting (a ThreadPoolExecutor's threads are joined at exit)."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="url-write").start()

    def _run(self) -> None:
        while True:
            fn, future = self.calls.get()
            if fn is None:
                return
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((fn, future))
        return future

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        return self.submit(fn).result(timeout=timeout)

    def stop(self) -> None:
        self.calls.put((None, None))


class DeadlineReader(io.RawIOBase):
    """A stream whose opening and every read must finish within `timeout` seconds.

    The calls run in a daemon thread (`DaemonCaller`); the caller waits on each with a timeout. On a timeout the
    stream is aborted from another thread (which unblocks the stuck call) and `StreamStalled` is raised; a call
    that stays stuck is abandoned and never keeps the process from exiting.
    """

    def __init__(self, url: str, timeout: float, opener: Callable[[str, float], Any]) -> None:
        super().__init__()
        self.url, self.timeout = url, timeout
        self._stream: Any = None
        self._caller = DaemonCaller()
        self._stream = self._call(lambda: opener(url, timeout), "opening")

    def _call(self, fn: Callable[[], Any], doing: str) -> Any:
        return self._wait(self._caller.submit(fn), doing)

    def _wait(self, future: concurrent.futures.Future, doing: str) -> Any:
        check = getattr(_waiting, "check", None)
        end = time.monotonic() + self.timeout
        try:
            while True:
                left = end - time.monotonic()
                try:
                    return future.result(timeout=max(0.0, min(left, CHECK_EVERY_S) if check is not None else left))
                except concurrent.futures.TimeoutError:
                    if check is None or time.monotonic() >= end:
                        raise StreamStalled(f"{self.url}: no data for {self.timeout:g} s while {doing}") from None
                if check is not None:
                    check()
        except BaseException:
            # A stall, the check's exception, or one raised into the wait (a stop signal, Ctrl-C): the call still
            # running is abandoned with its stream, so that closing it does not wait behind it.
            if not future.done():
                self._give_up()
            raise

    def _give_up(self) -> None:
        """Abort the stream from another thread (a call stuck on it returns) and leave the caller thread."""
        if sys.is_finalizing():  # no thread starts while the interpreter exits (start() would wait forever)
            abort(self._stream)
        else:
            threading.Thread(target=abort, args=(self._stream,), daemon=True).start()
        self._caller.stop()
        self._stream = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._stream is None:
            raise StreamStalled(f"{self.url}: the stream was aborted")
        stream = self._stream
        data = self._call(lambda: read_some(stream, len(buffer)), "reading")
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._stream is not None and sys.is_finalizing():
                # A stream left to the garbage collector at interpreter exit: the caller thread no longer runs (a
                # daemon thread is frozen then), so a call handed to it would wait out its deadline and then
                # start a thread, which never starts: the process would never exit. Close it here.
                abort(self._stream)
            elif self._stream is not None:
                self._call(self._stream.close, "closing")
        finally:
            self._stream = None
            self._caller.stop()
            super().close()
