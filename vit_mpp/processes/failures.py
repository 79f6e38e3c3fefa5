"""What a rank says when another process failed under it, in one line: a peer (its note in the group's store; a
collective that broke) or one of its data-loader workers (torch's words for its death or silence). See
docs/cluster.md."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from datetime import timedelta

from vit_mpp.errors import UserError
from vit_mpp.processes.rank_lifecycle import exit_now, launcher_gone, process_rank
from vit_mpp.processes.stderr import muted, say

FAILED_KEY = "vit_mpp/failed_rank"  # + the launcher's restart count: a restarted group starts with a clean slate
STORE_TIMEOUT = timedelta(seconds=5)  # the note is a courtesy: never wait long for it
# a preemption signal reached this process (stop_signals.py sets it): a collective that breaks then is worded so
signalled = False


def _store():
    """The process group's key-value store, or None before the group exists (or without torch loaded), or once this
    rank's launcher is gone: a call to a store no one serves prints a C++ stack dump before it fails (the soak: the
    launcher killed, its ranks stopping on the SIGTERM the kernel sends them as its first thread exits, while its
    pid is still their parent's: its store, no longer served, tells)."""
    if launcher_gone():
        return None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
    except AttributeError:  # a signal came while torch.distributed was being imported: there is no group yet
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(STORE_TIMEOUT)
        return store
    except Exception:  # no store for this backend or group: no note
        return None


def _failed_key() -> str:
    return f"{FAILED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def note_failure() -> None:
    """Tell the peers that this rank is stopping with an error (its own line says which)."""
    store = _store()
    if store is None:
        return
    try:
        with muted():
            store.set(_failed_key(), str(process_rank()))
    except Exception:  # the store is gone too: the peers will say that a peer stopped
        pass


def failed_peer() -> int | None:
    """The rank that noted a failure, if any."""
    store = _store()
    if store is None:
        return None
    try:
        key = _failed_key()
        with muted():
            return int(store.get(key)) if store.check([key]) else None
    except Exception:
        return None


_stopping = threading.Lock()  # the signal watcher and the main thread may both find the failed peer: one line


def stopping() -> bool:
    """Whether a thread of this process is printing a peer's failure and ending it (`stop_if_peer_failed`)."""
    return _stopping.locked()


def stop_if_peer_failed(wait_s: float = 0.0) -> None:
    """If a peer noted a failure, print the one line naming it and end this process with status 2; else return.

    Its failure outranks everything else this rank sees then: the launcher's SIGTERM that follows it, and the
    collective it breaks, arrive in either order. `wait_s`: how long to wait for this rank's process group, when
    it is not made yet. A peer that fails right after the group is made (a check only the main rank runs) is
    stopped by the launcher while this rank may still be finishing its part of making it; without the group its
    note cannot be read, and this rank would stop without a word."""
    deadline = time.monotonic() + wait_s
    while _store() is None and int(os.environ.get("WORLD_SIZE", "1")) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    peer = failed_peer()
    if peer is None:
        return
    _stopping.acquire()  # never released: the holder ends the process
    say(f"error: [rank {process_rank()}] stopped: rank {peer} failed (its error is above)")
    exit_now(2)


# What gloo, NCCL and the store say when a peer went away or stopped answering. "pair closure" is gloo's timeout
# met outside our own collectives (DDP's buffer broadcast in the forward pass), with no "gloo" in its text.
BROKEN_COLLECTIVE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Broken pipe",
                           "timeout caused pair closure", "Timed out waiting")


def names_broken_collective(text: str) -> bool:
    """Whether an error's text says that a collective broke because of a peer."""
    return any(s in text for s in BROKEN_COLLECTIVE_TEXTS)


def is_peer_error(error: BaseException) -> bool:
    """Whether `error` is a collective that broke because a peer went away (gloo, NCCL, the store)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and names_broken_collective(str(error))


def peer_failure_line(error: BaseException, signalled: bool = False) -> str:
    """The one line a rank prints when a collective broke under it and no peer noted a failure; `signalled`: a stop
    signal had reached this rank too (the launcher's, after the peer went), and no checkpoint was saved for it."""
    reason = " ".join(str(error).split())[:160]
    if signalled:
        return (f"error: [rank {process_rank()}] stopped: a peer process went away while the run was being "
                f"stopped by a signal; nothing was saved since the last checkpoint: {reason}")
    return (f"error: [rank {process_rank()}] stopped: a peer process stopped without an error of its own (killed?): "
            f"{reason}")


class WorkerDied(UserError):
    """A data-loader worker of this rank ended without a word (killed: the kernel's OOM killer, a stray kill -9)."""

    rank_local = True


# torch's words for it, raised wherever this rank's main thread is (its SIGCHLD handler's) or from the loader
_WORKER_DEATH = re.compile(r"DataLoader worker \(pid\(?s?\)? ([\d, ]+)\) "
                           r"(exited unexpectedly(?: with exit code -?\d+)?|is killed by signal: [\w ]+)")
_WORKER_SILENT = re.compile(r"DataLoader timed out after ([\d.]+) seconds")
FORK_HANGS = "a forked worker can hang in Python before 3.10.15 and 3.11.10: CPython gh-112275"


def worker_died(error: BaseException) -> WorkerDied | None:
    """The one-line error for torch's report that a data-loader worker died, or sent no batch for the loader's
    timeout (loader_workers.py `loader_timeout_s`): a traceback otherwise. None for any other error."""
    if not isinstance(error, RuntimeError):
        return None
    if silent := _WORKER_SILENT.search(str(error)):
        return WorkerDied(f"a data-loader worker of this rank sent no batch for {float(silent[1]):g} s: stuck ("
                          f"{FORK_HANGS}, or a read that outlives its deadlines); the newest checkpoint is kept: run "
                          "the same command to resume")
    match = _WORKER_DEATH.search(str(error))
    if match is None:
        return None
    how = match[2].rstrip(". ").replace("is killed by signal: ", "was killed by signal ")
    return WorkerDied(f"a data-loader worker of this rank (pid {match[1].strip()}) {how}, from outside the run (the "
                      "kernel's OOM killer? see `dmesg`; fewer data.num_workers or a smaller data.prefetch_factor "
                      "need less memory); the newest checkpoint is kept: run the same command to resume")
