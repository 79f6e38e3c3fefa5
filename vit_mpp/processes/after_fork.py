"""What a forked child (a data-loader worker) must not keep of its rank: the descriptors registered here (a run
directory's lock, the stop signals' pipe) are closed in it, by one handler that runs after every fork."""

from __future__ import annotations

import contextlib
import os
import signal

_parent_only: set[int] = set()


def close_in_children(*fds: int) -> None:
    """Close `fds` in every child this process forks: a child must not keep a run directory's lock alive after the
    run's own process is gone, nor hold the signal watcher's pipe open or write signals into it."""
    _parent_only.update(fds)


def closed(*fds: int) -> None:
    """`fds` are closed in this process: nothing to close in its children any more."""
    _parent_only.difference_update(fds)


def _close_in_child() -> None:
    if _parent_only:
        with contextlib.suppress(ValueError):  # forked from a thread other than the main one: none to reset
            signal.set_wakeup_fd(-1)  # the C-level handler writes each signal there: never into a pipe closed here
    for fd in _parent_only:
        with contextlib.suppress(OSError):
            os.close(fd)
    _parent_only.clear()


os.register_at_fork(after_in_child=_close_in_child)
