"""Preemption: `StopSignals` catches the signals of `train.preempt_signals` for a run's life and raises a flag the
loop reads before every step (vit_mpp/run/loop.py: every rank then agrees in one small collective to save that step,
and the run exits 75 with one line). A watcher thread sees a signal at once, so a rank blocked in a broken collective
or still starting also ends; a rank waiting for data (`waiting`) has its wait cut short. See docs/cluster.md and
docs/reliability.md."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

from vit_mpp import launcher
from vit_mpp.config.sections import TrainConfig
from vit_mpp.launcher import stop_if_peer_failed
from vit_mpp.run.durability.checkpoint_files import saved_step

_open_pipes: set[int] = set()  # the watchers' pipes, closed in forked children (data-loader workers)


def _close_in_child() -> None:
    """A forked child (a data-loader worker) must not hold the watcher's pipe open, nor write signals into it."""
    if _open_pipes:
        signal.set_wakeup_fd(-1)
    for fd in _open_pipes:
        try:
            os.close(fd)
        except OSError:
            pass
    _open_pipes.clear()


os.register_at_fork(after_in_child=_close_in_child)


GROUP_WAIT_S = 5.0  # a signal before the first step waits at most this long for the process group (see above)


class WaitInterrupted(Exception):
    """A wait for data was cut short by a stop signal (raised in the wait while `StopSignals.waiting`)."""


class StopSignals:
    """Catches the preemption signals for the life of a run (a context manager: the previous handlers come back).

    `saved_step()` names the newest checkpoint of the run (None: none): what a signal during start-up, before the
    first step, leaves to resume from. The loop reads `received` and sets `in_loop` once it starts, and `waiting`
    while it waits for a step's data: a signal then raises WaitInterrupted in the wait, so that a rank stuck on a
    stalled read still reaches the stop agreement instead of its read's deadline."""

    def __init__(self, names: list[str], saved_step: Callable[[], int | None] = lambda: None) -> None:
        self.signals = [getattr(signal, n) for n in names]
        self.saved_step = saved_step
        self.received: int | None = None
        self.in_loop = False  # before the first step there is nothing new to save: a signal ends the run at once
        self.waiting = False  # the main thread waits for data: a signal cuts the wait short
        self._previous: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    @classmethod
    def for_run(cls, train: TrainConfig) -> StopSignals:
        """The signals of `train.preempt_signals`, for a run in `train.run_dir`."""
        return cls(train.preempt_signals, partial(saved_step, train.run_dir))

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread() or not self.signals:
            return self  # signals reach the main thread only: a run started elsewhere (a test) keeps the defaults
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        _open_pipes.update(self._pipe)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        # The C-level handler writes each signal's number here at once, even while the main thread is blocked in a
        # collective: the watcher reacts then, not at the next Python bytecode.
        self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="preemption-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        os.close(self._pipe[1])  # ends the watcher
        _open_pipes.difference_update(self._pipe)
        self._pipe = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        launcher.signalled = True
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
                os.close(read)
                _open_pipes.discard(read)
                return
            if any(b in self.signals for b in data):
                self._on_signal(next(b for b in data if b in self.signals))

    def _on_signal(self, signum: int) -> None:
        # the launcher stops this rank because a peer failed: say so, once, and go (before the first step, the
        # group may still be being made: wait for it a little, to read the peer's note)
        stop_if_peer_failed(0.0 if self.in_loop else GROUP_WAIT_S)
        launcher.signalled = True
        if not self.in_loop:
            self._stop_before_the_loop(signum)
        if self.received is None:
            self.received = signum
        if self.waiting:  # the kernel may have handed the signal to another thread: the main thread's wait (a poll
            # with a timeout of seconds, in torch's loader) would not end before its timeout; the main thread is sent
            # it as well, and its handler cuts the wait short
            signal.pthread_kill(threading.main_thread().ident, signum)

    def _stop_before_the_loop(self, signum: int) -> None:
        """During start-up there is nothing new to save: end now, naming what a rerun resumes from, if anything."""
        launcher.stop_start_up(signum, self.saved_step)
