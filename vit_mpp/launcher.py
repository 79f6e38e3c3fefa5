"""Being one rank of a launched group (`accelerate launch`, torchrun): never outlive the launcher (the kernel sends
SIGTERM when it dies), and stop with one line naming the failed peer when a collective breaks. See docs/cluster.md."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from vit_mpp.errors import UserError, start_up_stop

LAUNCHER_POLL_S = 1.0
FAILED_KEY = "vit_mpp/failed_rank"  # + the launcher's restart count: a restarted group starts with a clean slate
STORE_TIMEOUT = timedelta(seconds=5)  # the note is a courtesy: never wait long for it
# a preemption signal reached this process (vit_mpp/run/durability/preemption.py sets it; vit_mpp/cli.py reads it when
# a collective breaks)
signalled = False


def launched() -> bool:
    """Whether this process is a rank started by torch elastic (`accelerate launch`, torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


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


_before_exit: list[Callable[[], None]] = []


def before_exit_now(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` before `exit_now` ends this process (what must not outlive the rank: vit_mpp/data/loader_workers.py
    registers the killing of loader workers hung in their fork, which never asked to die with it)."""
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


def _orphaned(parent: int) -> None:
    say(f"error: [rank {process_rank()}] the launcher (pid {parent}) is gone; this rank stops")
    exit_now(1)


START_UP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")  # train.preempt_signals' default: the config is not read yet
UNDER_LAUNCH = "VIT_MPP_LAUNCH"  # set by vit-mpp-launch (vit_mpp/launch.py) for the ranks it starts
START_UP_LINES = "VIT_MPP_START_UP_LINES"  # vit-mpp-launch's folder for its ranks' start-up lines (`stop_start_up`)
_resumes_from: Callable[[], int | None] | None = None  # the run's newest checkpoint, once its run directory is known
_early: int | None = None  # a signal that came before that


def under_a_launch() -> bool:
    """Whether this process is a rank a launcher started (`accelerate launch`, torchrun, vit-mpp-launch)."""
    return launched() or UNDER_LAUNCH in os.environ


def stop_during_start_up() -> None:
    """A rank's start-up under a launcher (its imports take seconds): until the run catches its signals
    (vit_mpp/run/durability/preemption.py), a preemption signal ends the rank with one line, not silently, once what
    a rerun resumes from is known (`start_up_resumes_from`): 75 when a checkpoint exists, 128 + the signal's number
    when none does. vit-mpp-launch starts its ranks with these signals blocked, so that one sent before this call
    waits for it; they are unblocked here."""
    signals = [getattr(signal, name) for name in START_UP_SIGNALS]
    if under_a_launch():
        for sig in signals:
            signal.signal(sig, _stop_during_start_up)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def start_up_resumes_from(saved_step: Callable[[], int | None]) -> None:
    """The run directory is known: `saved_step()` names its newest checkpoint (None: none). A signal that came
    during the imports before it is acted on now."""
    global _resumes_from
    _resumes_from = saved_step
    if _early is not None:
        _stop_during_start_up(_early, None)


def quiet_after_the_outcome(status: int) -> None:
    """The run's outcome is decided (done, preempted with its line, failed with its line): under a launcher, a later
    stop signal (the launcher stops the other ranks when one has ended, a scheduler's second signal) ends this
    process at once with that `status`, without a line of its own."""
    global _outcome
    if under_a_launch():
        _outcome = status
        for name in START_UP_SIGNALS:
            signal.signal(getattr(signal, name), lambda signum, frame: exit_now(status))


_outcome: int | None = None  # the decided outcome's status (`quiet_after_the_outcome`)


@atexit.register  # registered as this module is imported, first thing in a rank: it runs after every other one
def _keep_the_outcome() -> None:
    """Python gives the signals back their default action as it finishes, after the exit handlers: a stop signal
    then (torch elastic stopping the other ranks once one has ended) ended a rank whose outcome was decided with
    128 + its number, and the launcher saw no rank's 75. Blocked from here, it waits unheard while the process
    ends with its own status."""
    if _outcome is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, [getattr(signal, name) for name in START_UP_SIGNALS])


def _stop_during_start_up(signum: int, frame: object) -> None:
    # This handler is back once the run's own ones are gone (their context restores it as the run's error goes up):
    # the launcher's SIGTERM after a peer's failure then meets it. The peer's failure comes first, as everywhere.
    global _early
    if _stopping.locked():  # this thread is printing a peer's failure and ending: let it
        return
    stop_if_peer_failed()
    if _resumes_from is None:  # the config is not read yet: what a rerun resumes from is not known
        _early = _early or signum
        return
    stop_start_up(signum, _resumes_from)


def stop_start_up(signum: int, saved_step: Callable[[], int | None]) -> NoReturn:
    """End this rank, stopped by `signum` during its start-up (nothing new to save), with the line naming what a
    rerun resumes from (`saved_step()`, None: nothing). Under vit-mpp-launch the line is left to the launcher, in
    its START_UP_LINES folder: only the launcher knows whether the signal was the scheduler's (it says the line,
    once) or torch elastic stopping the ranks after a peer was killed (it names that peer instead). Elsewhere rank
    0 prints it."""
    try:
        step = saved_step()
    except Exception:  # the run directory cannot be read: say that nothing was saved now
        step = None
    line, status = start_up_stop(signum, step)
    folder = os.environ.get(START_UP_LINES)
    try:
        if folder:
            Path(folder, f"rank_{process_rank()}").write_text(line)
    except OSError:  # the launcher's folder is gone: say it here
        folder = None
    if not folder and process_rank() == 0:
        say(line)
    exit_now(status)


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
        _orphaned(parent)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


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


def _store():
    """The process group's key-value store, or None before the group exists (or without torch loaded), or once this
    rank's launcher is gone: a call to a store no one serves prints a C++ stack dump before it fails (the soak: the
    launcher killed, its ranks stopping on the SIGTERM the kernel sends them as its first thread exits, while its
    pid is still their parent's: its store, no longer served, tells)."""
    if (_launcher is not None and os.getppid() != _launcher) or _store_refused():
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
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
        with _store_client_quiet():
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
        with _store_client_quiet():
            return int(store.get(key)) if store.check([key]) else None
    except Exception:
        return None


# fd 2 is the process's: one thread at a time mutes it, and a rank's one line waits while it is muted. The main
# thread (a broken collective) and the signal watcher (the launcher's SIGTERM) both read a peer's note: muting in
# both at once left fd 2 on /dev/null for good (the second saved the first's /dev/null as the stderr to restore),
# and the peer's line went there (a cluster test, under load: rank 0 ended with status 2 and no word).
_stderr = threading.RLock()
_unmuted: list[int] = []  # the real stderr while it is muted (a handler of the muting thread may mute it again)


@contextlib.contextmanager
def _store_client_quiet() -> Iterator[None]:
    """The process's C-level stderr muted for the block: the store's C++ client writes a stack dump there when its
    server goes away mid-call (a launcher killed while it dies: its pid is still the rank's parent and its store
    still takes connections), then raises, which the callers of these courtesy notes handle. The block is one
    round trip of the store, bounded by STORE_TIMEOUT."""
    with _stderr:
        sys.stderr.flush()
        saved, muted = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        _unmuted.append(saved)
        try:
            os.dup2(muted, 2)
            yield
        finally:
            _unmuted.pop()
            os.dup2(saved, 2)
            os.close(saved)
            os.close(muted)


def say(line: str) -> None:
    """Print a rank's one line on stderr, never while another thread has it muted (`_store_client_quiet`); from a
    signal handler that interrupted this thread's own muted block, on the stderr that block saved."""
    with _stderr:
        if _unmuted:
            os.write(_unmuted[0], f"{line}\n".encode())
        else:
            print(line, file=sys.stderr, flush=True)


def is_peer_error(error: BaseException) -> bool:
    """Whether `error` is a collective that broke because a peer went away (gloo, NCCL, the store)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and names_broken_collective(str(error))


# What gloo, NCCL and the store say when a peer went away or stopped answering. "pair closure" is gloo's timeout
# met outside our own collectives (DDP's buffer broadcast in the forward pass), with no "gloo" in its text.
BROKEN_COLLECTIVE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Broken pipe",
                           "timeout caused pair closure", "Timed out waiting")


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
    timeout (vit_mpp/data/loader_workers.py `loader_timeout_s`): a traceback otherwise. None for any other error."""
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


def names_broken_collective(text: str) -> bool:
    """Whether an error's text says that a collective broke because of a peer."""
    return any(s in text for s in BROKEN_COLLECTIVE_TEXTS)


_stopping = threading.Lock()  # the signal watcher and the main thread may both find the failed peer: one line


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


def peer_failure_line(error: BaseException, signalled: bool = False) -> str:
    """The one line a rank prints when a collective broke under it and no peer noted a failure; `signalled`: a stop
    signal had reached this rank too (the launcher's, after the peer went), and no checkpoint was saved for it."""
    reason = " ".join(str(error).split())[:160]
    if signalled:
        return (f"error: [rank {process_rank()}] stopped: a peer process went away while the run was being "
                f"stopped by a signal; nothing was saved since the last checkpoint: {reason}")
    return (f"error: [rank {process_rank()}] stopped: a peer process stopped without an error of its own (killed?): "
            f"{reason}")
