"""The indexer's read-ahead (`ReadAhead`): the next chunks of a shard's stream read by a helper thread while
vit_mpp/data/tar_scan.py parses this one, so a remote or slow read overlaps with the parsing. See
docs/reliability.md (deadlines) and docs/benchmarks.md (what it gains).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from vit_mpp.data import deadlines
from vit_mpp.data.tar_scan import CHUNK


class ReadAhead:
    """A stream read `depth` chunks ahead by a helper thread, so reading (a disk, a socket: the GIL is released
    while waiting) overlaps with parsing. `read()` returns the next chunk whatever size is asked; an error met by
    the helper (a stall past the deadline, a reset) is raised by the `read()` that reaches it. `close()` stops the
    helper after its current read, which the stream's own deadline bounds; it does not close the stream. The
    helper runs the creating thread's `deadlines.while_waiting` check while it waits, so a pool's worker asked to stop
    is not held up by a stalled read in its helper."""

    def __init__(self, stream: BinaryIO, depth: int = 2) -> None:
        self.stream, self.done = stream, False
        self.chunks: queue.Queue = queue.Queue(depth)
        self.stopped = threading.Event()
        threading.Thread(target=self._run, args=(deadlines.waiting_check(),), daemon=True,
                         name="tar-read-ahead").start()

    def _run(self, check: Callable[[], None] | None) -> None:
        deadlines.while_waiting(check)
        try:
            while not self.stopped.is_set():
                chunk = self.stream.read(CHUNK)
                self._put(chunk)
                if not chunk:
                    return
        except BaseException as e:  # handed to the reader, which raises it
            self._put(e)

    def _put(self, item: Any) -> None:
        while not self.stopped.is_set():
            try:
                self.chunks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def read(self, n: int = -1) -> bytes:
        if self.done:
            return b""
        item = self.chunks.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = not item
        return item

    def close(self) -> None:
        self.stopped.set()
