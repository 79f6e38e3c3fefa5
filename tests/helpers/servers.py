"""Loopback http servers for shard streams: one that serves a folder, one that cuts or stalls chosen responses."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the test output clean
        pass


class FaultyHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files, but for the first `faults[path] = (kind, n)` requests of a path sends half the body and then
    either cuts the connection (`cut`: the headers promised all of it) or goes silent with the connection open until
    the server stops (`stall`: a hung server or proxy). Every request path is recorded in `requests`."""

    faults: dict[str, tuple[str, int]] = {}
    requests: list[str] = []
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:
        self.requests.append(self.path)
        kind, left = self.faults.get(self.path, ("", 0))
        if left <= 0:
            super().copyfile(source, outputfile)
            return
        self.faults[self.path] = (kind, left - 1)
        data = source.read()
        outputfile.write(data[: len(data) // 2])
        outputfile.flush()
        if kind == "stall":
            self.release.wait(timeout=600)
        self.close_connection = True


def serve_faulty(directory: Path) -> contextlib.AbstractContextManager[str]:
    """Serve `directory` with FaultyHandler on 127.0.0.1 while the block runs (faults reset); yields the base URL."""
    FaultyHandler.faults, FaultyHandler.requests, FaultyHandler.release = {}, [], threading.Event()
    return serve(FaultyHandler, directory, FaultyHandler.release)


@contextlib.contextmanager
def serve(handler: type[http.server.SimpleHTTPRequestHandler], directory: Path,
          release: threading.Event | None = None) -> Iterator[str]:
    """Serve `directory` with `handler` on 127.0.0.1 (a free port) while the block runs; yields the base URL.
    `release` is set on the way out, so that handler threads waiting on it (a stalled response) end."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if release is not None:
            release.set()
        server.shutdown()
        server.server_close()


def serve_directory(directory: Path) -> contextlib.AbstractContextManager[str]:
    """Serve `directory` over http on 127.0.0.1 (a free port) while the block runs; yields the base URL."""
    return serve(_QuietHandler, directory)
