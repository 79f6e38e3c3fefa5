"""Being one rank of a launched group (`accelerate launch`, torchrun, vit-mpp-launch: the other side is
job_launcher.py): who it is, never outliving the launcher (the kernel sends SIGTERM when it dies), ending at once
(`exit_now`), a decided outcome kept against late signals, and its group's store for this attempt. See
docs/cluster.md."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

from vit_mpp.processes.stderr import say

LAUNCHER_POLL_S = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # what a scheduler sends; train.preempt_signals' default
UNDER_LAUNCH = "VIT_MPP_LAUNCH"  # set by vit-mpp-launch (job_launcher.py) for the ranks it starts
START_UP_LINES = "VIT_MPP_START_UP_LINES"  # vit-mpp-launch's folder for its ranks' start-up lines (stop_signals.py)


def launched() -> bool:
    """Whether this process is a rank started by torch elastic (`accelerate launch`, torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def under_a_launch() -> bool:
    """Whether this process is a rank a launcher started (`accelerate launch`, torchrun, vit-mpp-launch)."""
    return launched() or UNDER_LAUNCH in os.environ


_owns_the_process = False  # a stage run as its own command (`python -m pretrain`), not code calling its main()


def command_owns_the_process() -> None:
    """Called by a stage's `__main__` block: its process's stop signals are the run's to set without a launcher too."""
    global _owns_the_process
    _owns_the_process = True


def sets_the_signals() -> bool:
    """Whether the run sets this process's stop-signal handlers for its whole life (its start-up's one line, nothing
    after its outcome): a rank a launcher started, or a stage run as its own command (a Ctrl-C during its imports
    was a traceback). Not code that calls a stage's main() in its own process (tests, a notebook): its handlers
    are its own."""
    return under_a_launch() or _owns_the_process


def process_rank() -> int:
    """This process's global rank under a launcher (0 without one), read from the environment the launcher sets."""
    return int(os.environ.get("RANK", "0"))


_launcher: int | None = None  # the launcher's pid, read first thing (`die_with_launcher`)


def die_with_launcher() -> None:
    """Under a launcher: die the moment the launcher dies, however it dies. Call it first thing in an entry point
    (calling it again is harmless)."""
    global _launcher
    if not launched() or _launcher is not None:
        return
    parent = _launcher = os.getppid()
    if not die_with_parent(parent, signal.SIGTERM):
        _watch_parent(parent)
    if _hosts_launchers_store():
        _watch_launchers_store()


def launcher_gone() -> bool:
    """Whether this rank's launcher is gone: no longer its parent, or nothing serves the group's store (a killed
    launcher's children are adopted as its first thread exits, while its pid may still be their parent's)."""
    return (_launcher is not None and os.getppid() != _launcher) or _store_refused()


STORE_WATCH_S = 5.0  # how long a rank on node 0 keeps checking that its launcher's store is served
STORE_POLL_S = 0.25


def _hosts_launchers_store() -> bool:
    """Whether this rank's own launcher serves the group's store (node 0 under torch elastic's agent store): then a
    refused connection to it means the launcher is gone. Elsewhere nothing tells (docs/cluster.md)."""
    return (os.environ.get("GROUP_RANK", "0") == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and "MASTER_ADDR" in os.environ and os.environ.get("MASTER_PORT", "").isdigit())


def _watch_launchers_store() -> None:
    """For a launcher that dies while this rank starts, before the kernel could be asked to signal it: the rank was
    adopted by init (or a subreaper) and the death signal was asked of the wrong parent. A launcher that is init
    itself (a container's first process) is told apart by the store it serves. Checked now, then for a few
    seconds from a thread: a killed launcher's children are adopted as its first thread exits, while its other
    threads may still hold its store open for some milliseconds (CI: both ranks saw it served, then waited for it
    until the collective timeout)."""
    _launcher_gone_unless_store_serves()

    def watch() -> None:
        deadline = time.monotonic() + STORE_WATCH_S
        while time.monotonic() < deadline:
            time.sleep(STORE_POLL_S)
            _launcher_gone_unless_store_serves()

    threading.Thread(target=watch, name="launcher-store-watch", daemon=True).start()


def _launcher_gone_unless_store_serves() -> None:
    if _store_refused():  # nothing listens: the launcher is gone
        host, port = _store_address()
        say(f"error: [rank {process_rank()}] the launcher is gone (nothing serves its store at {host}:{port}); this "
            "rank stops")
        exit_now(1)


def _store_address() -> tuple[str, int] | None:
    port = os.environ.get("MASTER_PORT", "")
    return (os.environ["MASTER_ADDR"], int(port)) if "MASTER_ADDR" in os.environ and port.isdigit() else None


def _store_refused() -> bool:
    """Whether nothing accepts a connection at the group's store address (on node 0 its launcher serves it); a
    slow answer proves nothing."""
    import socket

    address = _store_address()
    try:
        if address is not None:
            socket.create_connection(address, timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        pass
    return False


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux); False where it cannot be asked.

    `parent` is the pid the parent had, read by the parent itself before it started this process (or, for a rank,
    first thing at start-up): read here, after the fact, it would already be the reaper's when the parent died
    between the fork and this call, and the process would outlive it (a loader worker did, its rank killed while it
    started the evaluation's workers). A parent already gone ends this process at once."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig))
    if os.getppid() != parent:  # the parent died before the kernel could be asked
        os._exit(1)
    return True


def _watch_parent(parent: int) -> None:
    """A thread that ends this rank when its parent is gone (where PR_SET_PDEATHSIG does not exist)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        say(f"error: [rank {process_rank()}] the launcher (pid {parent}) is gone; this rank stops")
        exit_now(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


_before_exit: list[Callable[[], None]] = []


def before_exit_now(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` before `exit_now` ends this process (what must not outlive the rank: loader_workers.py registers
    the killing of loader workers hung in their fork, which never asked to die with it)."""
    _before_exit.append(cleanup)


def exit_now(status: int) -> NoReturn:
    """End this rank at once with `status`, without the interpreter's clean-up (it could wait on a broken group or
    a hung worker), after the `before_exit_now` clean-ups."""
    for cleanup in _before_exit:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 (ending regardless)
            pass
    os._exit(status)


_outcome: int | None = None  # the decided outcome's status (`quiet_after_the_outcome`)


def quiet_after_the_outcome(status: int) -> None:
    """The run's outcome is decided (done, preempted with its line, failed with its line): under a launcher or as
    its own command (`sets_the_signals`), a later stop signal (the launcher stops the other ranks when one has
    ended, a scheduler's second signal, a second Ctrl-C) ends this process at once with that `status`, without a
    line of its own."""
    global _outcome
    if sets_the_signals():
        _outcome = status
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, frame: exit_now(status))


@atexit.register  # registered as this module is imported, first thing in a rank: it runs after every other one
def _keep_the_outcome() -> None:
    """Python gives the signals back their default action as it finishes, after the exit handlers: a stop signal
    then (torch elastic stopping the other ranks once one has ended, a scheduler's as the job ends) ended a rank
    whose outcome was decided with 128 + its number, and the launcher saw no rank's 0 or 75. Ignored from here, in
    every thread (blocked in this one alone, it went to a thread of torch's), it changes nothing as the process ends
    with its own status."""
    if _outcome is not None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def process_group_kwargs(timeout_s: float) -> dict:
    """What the process group is made with (passed through Accelerate's PartialState to `init_process_group`): the
    collective timeout, and under a launcher with several processes a store of its own for this attempt.

    torch elastic keeps one store across the restarts of `--max_restarts`, and a restarted group that reads the keys
    of the group it replaces hangs while it connects (gloo) or joins the wrong peers; a prefix per restart gives each
    attempt a clean slate.
    """
    timeout = timedelta(seconds=timeout_s)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not launched() or world < 2 or "MASTER_ADDR" not in os.environ:
        return {"timeout": timeout}
    from torch.distributed import PrefixStore
    from torch.distributed.rendezvous import _create_c10d_store  # env:// does the same; we only add the prefix

    rank = process_rank()
    store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world, timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"timeout": timeout, "store": PrefixStore(f"vit_mpp/attempt_{attempt}", store), "rank": rank,
            "world_size": world}
