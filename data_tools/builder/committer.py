"""Committing finished ranges (`Committer`): their shards are published in OUT (synced and renamed, or uploaded
whole), then the range is journaled, in that order, so a journaled range is always complete. Publishing runs in a
bounded number of background threads of the main process; the workers never sync.
See docs/build_shards.md#one-machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from data_tools.builder.journal import Journal
from data_tools.stops import BuildStopped
from data_tools.store import LocalStore, RemoteStore
from vit_mpp.data import urls


class Committer:
    """Publishes the shards of finished ranges (in background threads: a sync and a rename, or an upload) and
    journals each range, in the main thread, once all of its shards are published."""

    def __init__(self, store: LocalStore | RemoteStore, journal: Journal, threads: int,
                 on_commit: Callable[[dict], None]) -> None:
        self.store, self.journal, self.on_commit = store, journal, on_commit
        self.pending: dict[Future, dict] = {}
        self.limit = 2 * threads  # publications in flight at most (each in its own thread)

    def _publish(self, record: dict) -> None:
        for shard in record["shards"]:
            if "tmp" in shard:
                self.store.publish(shard["tmp"], shard["filename"])

    def _commit(self, record: dict) -> None:
        for shard in record["shards"]:
            shard.pop("tmp", None)
        self.journal.append(record)
        self.on_commit(record)

    def add(self, record: dict) -> None:
        if not any("tmp" in s for s in record["shards"]):
            self._publish(record)
            self._commit(record)
            return
        future: Future = Future()

        def publish() -> None:
            try:
                self._publish(record)
                future.set_result(None)
            except BaseException as e:  # handed to poll()
                future.set_exception(e)

        # A daemon thread: after Ctrl-C or an error the process exits at once; a shard whose publication was cut
        # short is not journaled (and written again on resume).
        threading.Thread(target=publish, daemon=True, name="publish").start()
        self.pending[future] = record

    def room(self) -> bool:
        return len(self.pending) < self.limit

    def poll(self, timeout: float = 0.0) -> None:
        """Journal the ranges whose shards are published; a publication that failed (an upload: after every
        attempt) stops the build."""
        if not self.pending:
            return
        done, _ = wait(self.pending, timeout=timeout, return_when=FIRST_COMPLETED)
        for future in done:
            record = self.pending.pop(future)
            try:
                future.result()
            except OSError as e:
                names = ", ".join(s["filename"] for s in record["shards"])
                what = (f"writing {names} in {self.store} failed" if self.store.local else
                        f"uploading {names} to {self.store} failed after {urls.READ_RETRIES + 1} attempts")
                raise BuildStopped(f"{what}: {' '.join(str(e).split())}. Finished shards are kept: re-run the same "
                                   "command to continue") from None
            self._commit(record)

    def settle(self, timeout: float) -> None:
        """The build is stopping on an error: journal the ranges whose publication finishes within `timeout`
        seconds, so a full disk or a failed range loses only the ranges still being written. A publication or
        journal write that fails here is left to the resume (the error that stopped the build is the one told)."""
        deadline = time.monotonic() + timeout
        while self.pending and (left := deadline - time.monotonic()) > 0:
            try:
                self.poll(timeout=left)
            except OSError:  # the journal cannot be written either
                return
            except Exception:  # that range's publication failed: it is written again on resume
                continue
