"""Entry-point plumbing: a user error (bad config, path, file or data) becomes one line, `error: ...`, and exit 2.

Under a launcher (`accelerate launch`, torchrun: several processes) every rank usually meets the same error: the
main process prints it and the others stay silent, so it appears once. A silent rank must not exit first: the
launcher would then stop the main process before it printed anything. So it waits (`QUIET_WAIT_S`) for the
launcher to stop it, which happens as soon as the main process has printed and exited; if it is still running
then (the main process did not meet the error), it prints the error itself. An error from a rank's own data (a bad
shard in its range) is printed by that rank at once, with its rank named. Every rank exits with status 2. The
launcher itself then reports the failed ranks and exits with its own status (torch elastic: 1); that part is its
own.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from vit_mpp.errors import UserError

QUIET_WAIT_S = 10.0


def process_rank() -> int:
    """This process's global rank under a launcher (0 without one), read from the environment the launcher sets."""
    return int(os.environ.get("RANK", "0"))


def error_line(error: BaseException) -> str:
    """The user-facing line of an error. An error raised in a data-loader worker arrives wrapped with the worker's
    traceback; its last line holds the message."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    if len(lines) > 1:
        return lines[-1].split(": ", 1)[-1]
    return lines[0] if lines else type(error).__name__


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Call `main(argv)`; print a user error as `error: ...` on one line (once per run) and exit with status 2."""
    try:
        main(argv)
    except UserError as e:
        rank, line = process_rank(), error_line(e)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 or (rank == 0 and not e.rank_local):
            print(f"error: {line}", file=sys.stderr, flush=True)
        else:
            if not e.rank_local:  # every rank met it: the main one prints it, and the launcher then ends this one
                time.sleep(QUIET_WAIT_S)
            print(f"error: [rank {rank}] {line}", file=sys.stderr, flush=True)
        sys.exit(2)
