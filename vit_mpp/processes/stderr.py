"""A rank's stderr: its one line (`say`), never lost while the store's client is read with stderr muted (`muted`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

# fd 2 is the process's: one thread at a time mutes it, and a rank's one line waits while it is muted. The main
# thread (a broken collective) and the signal watcher (the launcher's SIGTERM) both read a peer's note: muting in
# both at once left fd 2 on /dev/null for good (the second saved the first's /dev/null as the stderr to restore),
# and the peer's line went there (a cluster test, under load: rank 0 ended with status 2 and no word).
_stderr = threading.RLock()
_unmuted: list[int] = []  # the real stderr while it is muted (a handler of the muting thread may mute it again)


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """The process's C-level stderr muted for the block: the store's C++ client writes a stack dump there when its
    server goes away mid-call (a launcher killed while it dies: its pid is still the rank's parent and its store
    still takes connections), then raises, which the callers of these courtesy notes handle. The block is one
    round trip of the store, bounded by vit_mpp/processes/failures.py `STORE_TIMEOUT`."""
    with _stderr:
        sys.stderr.flush()
        saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        _unmuted.append(saved)
        try:
            os.dup2(quiet, 2)
            yield
        finally:
            _unmuted.pop()
            os.dup2(saved, 2)
            os.close(saved)
            os.close(quiet)


def say(line: str) -> None:
    """Print a rank's one line on stderr, never while another thread has it muted (`muted`); from a signal handler
    that interrupted this thread's own muted block, on the stderr that block saved."""
    with _stderr:
        if _unmuted:
            os.write(_unmuted[0], f"{line}\n".encode())
        else:
            print(line, file=sys.stderr, flush=True)
