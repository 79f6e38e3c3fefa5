"""How a command's process ends (`with one_line_errors():`, `run_main`): a user error (bad config, path, file or
data) is one line, `error: ...`, and exit 2, printed once under a launcher (the main process prints it; a rank's
own data error is printed by that rank); a preempted run exits 75; a rank whose peer failed says which. See
docs/reliability.md."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from vit_mpp.errors import EXIT_INTERRUPTED, Stopped, StoppedWriting, UserError
from vit_mpp.processes import failures, stop_signals
from vit_mpp.processes.failures import (
    is_peer_error,
    note_failure,
    peer_failure_line,
    stop_if_peer_failed,
    worker_died,
)
from vit_mpp.processes.rank_lifecycle import exit_now, process_rank, quiet_after_the_outcome
from vit_mpp.processes.stderr import say

QUIET_WAIT_S = 10.0


def error_line(error: BaseException) -> str:
    """The user-facing line of an error. An error raised in a data-loader worker arrives wrapped with the worker's
    traceback; its last line holds the message."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    if len(lines) > 1:
        return lines[-1].split(": ", 1)[-1]
    return lines[0] if lines else type(error).__name__


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """An entry point's body (`with one_line_errors(): main()`): a user error (bad config, path, file or data)
    becomes one line, `error: ...`, and exit 2 (once per run); a preempted run prints its line and exits with status
    75 when a checkpoint of the step it names exists, 128 + the signal's number when nothing was saved (as does a
    tool stopped while it wrote an output, `StoppedWriting`); a rank whose collective broke because a peer went away
    prints one line naming the peer and exits with status 2. Anything else is a bug and keeps its traceback."""
    try:
        yield
    except (Stopped, StoppedWriting) as e:
        quiet_after_the_outcome(e.status)
        if process_rank() == 0:
            print(e, flush=True)
        sys.exit(e.status)
    except UserError as e:
        _one_line(e)
    except Exception as e:
        died = worker_died(e)  # a loader worker killed from outside: this rank's error, in one line
        if died is not None:
            _one_line(died)
        if is_peer_error(e):
            stop_if_peer_failed()  # before the signal: the launcher's SIGTERM may follow the peer's failure
            say(peer_failure_line(e, signalled=failures.signalled))
            exit_now(2)  # the group is broken: no clean-up can finish, and nothing was saved now
        note_failure()
        raise
    quiet_after_the_outcome(0)  # done: a signal as the process ends changes nothing


def _one_line(error: UserError) -> NoReturn:
    """A user error's line, once per run (the main process prints it; a rank's own data error is printed by that
    rank, its peers naming it), and exit status 2."""
    quiet_after_the_outcome(2)
    rank, line, world = process_rank(), error_line(error), int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or (rank == 0 and not error.rank_local):
        note_failure()  # before the line: a peer whose collective breaks names this rank
        say(f"error: {line}")
    else:
        if error.rank_local:
            note_failure()
        else:  # every rank met it: the main one prints it, and the launcher then ends this one
            if stop_signals.came_during_start_up():  # the launcher's stop came first, while this rank started
                exit_now(2)
            time.sleep(QUIET_WAIT_S)
        say(f"error: [rank {rank}] {line}")
    sys.exit(2)


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None,
             interrupted: str = "interrupted; run the same command again") -> None:
    """`main(argv)` under `one_line_errors` (the tools' entry points, and tests that call them in-process). Ctrl-C
    is one line, `error: {interrupted}`, and status 130, not a traceback (an output being written is left as it
    was: `open_out_file`); build-shards' line says what its build kept."""
    with one_line_errors():
        try:
            main(argv)
        except KeyboardInterrupt:
            say(f"error: {interrupted}")
            sys.exit(EXIT_INTERRUPTED)
