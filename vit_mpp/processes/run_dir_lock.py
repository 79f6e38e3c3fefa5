"""One run owns a run directory: its main process holds a lock on `run_dir/.lock` for its whole life (who holds it
is written inside), and a second run gets one line naming the holder. See docs/reliability.md."""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from vit_mpp.durable import writing
from vit_mpp.errors import UserError
from vit_mpp.processes.after_fork import close_in_children

LOCK_NAME = ".lock"
_held: dict[str, int] = {}  # run dir -> descriptor of its lock, kept open (so held) until this process ends


class RunDirBusy(UserError):
    """Another live run holds the run directory."""


def lock_run_dir(run_dir: Path, flag: str = "train.run_dir") -> None:
    """Hold an exclusive lock on `run_dir` until this process ends, or raise RunDirBusy naming the holder (and
    `flag`, the setting that chooses another).

    The lock is the kernel's (flock on run_dir/.lock): it goes with the process that holds it, however that process
    ends (kill -9 included), so a lock is never left stale by a dead run; a forked child (a data-loader worker)
    closes its copy, so that it cannot keep the lock alive after the run's own process is gone. On NFSv4 and Lustre
    (flock mount option) flock is a lock between machines too; on a filesystem without locks a warning says the run
    dir is unprotected.
    """
    key = str(run_dir.resolve())
    if key in _held:
        return
    path = run_dir / LOCK_NAME
    with writing(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(f"{run_dir} is in use by another run ({_describe(holder)}): wait for it to end, or use "
                         f"another {flag}") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        print(f"warning: {run_dir} is on a filesystem without file locks ({e.strerror}): nothing stops a second run "
              "from using it at the same time", file=sys.stderr, flush=True)
    since = datetime.datetime.now().isoformat(" ", "seconds")
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": since, "command": " ".join(sys.argv)[:300]}
    with writing(path):  # a full disk: one line, before the run writes anything else
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    _held[key] = fd
    close_in_children(fd)


def _describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on {h['host']} since {h['since']}: {h['command']}"
    except (ValueError, KeyError, TypeError):
        return holder[:200]


def check_not_locked(run_dir: Path, flag: str = "train.run_dir") -> None:
    """RunDirBusy naming the holder (and `flag`, the setting that chooses another) when a live run (not this process)
    holds `run_dir`'s lock. Creates nothing (for dry runs, and checks before anything is written)."""
    if str(run_dir.resolve()) in _held:
        return
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return
    except BlockingIOError:
        holder = _describe(os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown")
    except OSError:
        return
    finally:
        os.close(fd)
    raise RunDirBusy(f"{run_dir} is in use by another run ({holder}): wait for it to end, or use another {flag}")
