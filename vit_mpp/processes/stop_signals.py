"""The preemption signals, from a rank's first line to its end: during its start-up one line and an exit that names
what a rerun resumes from (`stop_during_start_up`, `start_up_resumes_from`); for the run's life `StopSignals`, a
flag the loop reads before every step (vit_mpp/processes/stop_agreement.py: every rank then agrees to save that
step, and the run exits 75 with one line) and a wait for data it cuts short (`StopSignals.take`). A watcher thread
sees a signal at once, so a rank blocked in a broken collective or still starting also ends. See docs/cluster.md
and docs/reliability.md."""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

from vit_mpp.config.sections import TrainConfig
from vit_mpp.errors import EXIT_PREEMPTED
from vit_mpp.processes import failures
from vit_mpp.processes.after_fork import close_in_children, closed
from vit_mpp.processes.failures import stop_if_peer_failed, stopping
from vit_mpp.processes.rank_lifecycle import (
    START_UP_LINES,
    STOP_SIGNALS,
    exit_now,
    process_rank,
    quiet_after_the_outcome,
    sets_the_signals,
)
from vit_mpp.processes.stderr import say

T = TypeVar("T")
GROUP_WAIT_S = 5.0  # a signal before the first step waits at most this long for the process group (see below)
_resumes_from: Callable[[], int | None] | None = None  # the run's newest checkpoint, once its run directory is known
_early: int | None = None  # a signal that came before that


def stop_during_start_up() -> None:
    """A rank's start-up (its imports take seconds), under a launcher or run as its own command: until the run
    catches its signals (`StopSignals`), a preemption signal (Ctrl-C included) ends the rank with one line, not
    silently or with a traceback from the import it stood in, once what a rerun resumes from is known
    (`start_up_resumes_from`): 75 when a checkpoint exists, 128 + the signal's number when none does.
    vit-mpp-launch starts its ranks with these signals blocked, so that one sent before this call waits for it;
    they are unblocked here."""
    if sets_the_signals():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _stop_during_start_up)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def start_up_resumes_from(saved_step: Callable[[], int | None]) -> None:
    """The run directory is known: `saved_step()` names its newest checkpoint (None: none), for a stop before the
    run's first step. A signal that came during the imports before it is acted on now."""
    global _resumes_from
    _resumes_from = saved_step
    if _early is not None:
        _stop_during_start_up(_early, None)


def came_during_start_up() -> bool:
    """Whether a stop signal came before the run's config was read (kept for `start_up_resumes_from`): a rank whose
    config then fails has been told to stop, by the launcher whose main rank met the same error, or a scheduler."""
    return _early is not None


def _stop_during_start_up(signum: int, frame: object) -> None:
    # This handler is back once the run's own ones are gone (their context restores it as the run's error goes up):
    # the launcher's SIGTERM after a peer's failure then meets it. The peer's failure comes first, as everywhere.
    global _early
    if stopping():  # this thread is printing a peer's failure and ending: let it
        return
    stop_if_peer_failed()
    if _resumes_from is None:  # the config is not read yet: what a rerun resumes from is not known
        _early = _early or signum
        return
    stop_start_up(signum)


def start_up_stop(signum: int, step: int | None) -> tuple[str, int]:
    """(line, exit status) of a run stopped by signal `signum` during its start-up, when nothing new can be saved:
    75 when its run directory holds a checkpoint (of `step`), else 128 + the signal's number."""
    name = signal.Signals(signum).name
    if step is None:
        return (f"preempted ({name}) during start-up: nothing was saved; run the same command to start",
                128 + signum)
    return (f"preempted ({name}) during start-up: nothing new to save; the checkpoint of step {step} is kept; run the "
            "same command to resume", EXIT_PREEMPTED)


def stop_start_up(signum: int) -> NoReturn:
    """End this rank, stopped by `signum` during its start-up (nothing new to save), with the line naming what a
    rerun resumes from (`start_up_resumes_from`; nothing, before it). Under vit-mpp-launch the line is left to the
    launcher, in its START_UP_LINES folder: only the launcher knows whether the signal was the scheduler's (it says
    the line, once) or torch elastic stopping the ranks after a peer was killed (it names that peer instead).
    Elsewhere rank 0 prints it."""
    try:
        step = _resumes_from() if _resumes_from is not None else None
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


class WaitInterrupted(Exception):
    """A wait for data was cut short by a stop signal (raised in the wait while `StopSignals.waiting`)."""


class StopSignals:
    """Catches the preemption signals for the life of a run (a context manager: the previous handlers come back).

    The loop reads `received` and sets `in_loop` once it starts; before that there is nothing new to save, and a
    signal ends the rank at once with the line of a stop during start-up. The loop waits for a step's data through
    `take`: a signal then cuts the wait short, so that a rank stuck on a stalled read still reaches the stop
    agreement instead of its read's deadline."""

    def __init__(self, names: list[str]) -> None:
        self.signals = [getattr(signal, n) for n in names]
        self.received: int | None = None
        self.in_loop = False  # before the first step there is nothing new to save: a signal ends the run at once
        self.waiting = False  # the main thread waits for data: a signal cuts the wait short
        self._previous: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    @classmethod
    def for_run(cls, train: TrainConfig) -> StopSignals:
        """The signals of `train.preempt_signals` (a stop before the first step names what the run directory holds:
        `start_up_resumes_from`)."""
        return cls(train.preempt_signals)

    def take(self, items: Iterator[T], count: int) -> list[T] | None:
        """Up to `count` items (fewer at the end of an evaluation), or None when a stop signal came before or
        during the wait (the signal's handler raises WaitInterrupted in it while `waiting`)."""
        if self.received is not None:
            return None
        self.waiting = True
        try:
            return list(itertools.islice(items, count))
        except WaitInterrupted:
            return None
        finally:
            self.waiting = False

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread() or not self.signals:
            return self  # signals reach the main thread only: a run started elsewhere (a test) keeps the defaults
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        close_in_children(read, write)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        # The C-level handler writes each signal's number here at once, even while the main thread is blocked in a
        # collective: the watcher reacts then, not at the next Python bytecode.
        self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="preemption-watch", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        done = kind is None and sets_the_signals()  # the run is done: a later signal ends the rank with 0, no line
        for sig, previous in self._previous.items():
            if not (done and sig in STOP_SIGNALS):  # kept until the line below: no start-up handler between them
                signal.signal(sig, previous)
        if done:
            quiet_after_the_outcome(0)
        closed(self._pipe[1])
        os.close(self._pipe[1])  # ends the watcher
        self._pipe = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        failures.signalled = True
        if self.received is None:
            self.received = signum
        if self.waiting:  # the main thread waits for a batch: leave the wait (its read is abandoned)
            self.waiting = False
            raise WaitInterrupted

    def _watch(self) -> None:
        read = self._pipe[0]
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                closed(read)
                os.close(read)
                return
            if any(b in self.signals for b in data):
                self._on_signal(next(b for b in data if b in self.signals))

    def _on_signal(self, signum: int) -> None:
        # the launcher stops this rank because a peer failed: say so, once, and go (before the first step, the
        # group may still be being made: wait for it a little, to read the peer's note)
        stop_if_peer_failed(0.0 if self.in_loop else GROUP_WAIT_S)
        failures.signalled = True
        if not self.in_loop:  # during start-up there is nothing new to save: end now, naming what a rerun resumes
            stop_start_up(signum)
        if self.received is None:
            self.received = signum
        if self.waiting:  # the kernel may have handed the signal to another thread: the main thread's wait (a poll
            # with a timeout of seconds, in torch's loader) would not end before its timeout; the main thread is sent
            # it as well, and its handler cuts the wait short
            signal.pthread_kill(threading.main_thread().ident, signum)
