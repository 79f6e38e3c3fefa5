"""Preemption and time-based checkpoints: a signal of `train.preempt_signals` on any rank raises a flag; at a step
boundary every rank agrees in one small collective to save that step, and the run exits 75 with one line. A watcher
thread sees a signal at once, so a rank blocked in a broken collective or still starting also ends. See
docs/cluster.md and docs/reliability.md."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import FrameType
from typing import Any

from vit_mpp import launcher
from vit_mpp.errors import EXIT_PREEMPTED, StoppedUnsaved
from vit_mpp.launcher import process_rank, stop_if_peer_failed

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
    """A wait for data was cut short by a stop signal (`StopSignals.interruptible`)."""


class StopSignals:
    """Catches the preemption signals for the life of a run (a context manager: the previous handlers come back).

    `saved_step()` names the newest checkpoint of the run (None: none): what a signal during start-up, before the
    first step, leaves to resume from."""

    def __init__(self, names: list[str], saved_step: Callable[[], int | None] = lambda: None) -> None:
        self.signals = [getattr(signal, n) for n in names]
        self.saved_step = saved_step
        self.received: int | None = None
        self.in_loop = False  # before the first step there is nothing new to save: a signal ends the run at once
        self.waiting = False  # the main thread waits for data: a signal cuts the wait short (`interruptible`)
        self._previous: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

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

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A wait for data that a stop signal cuts short: WaitInterrupted, at once when a signal came before it.
        A rank stuck on a stalled read then still reaches the agreement (`StopGate`) instead of its read's deadline."""
        if self.received is not None:
            raise WaitInterrupted
        self.waiting = True
        try:
            yield
        finally:
            self.waiting = False

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
        name = signal.Signals(signum).name
        try:
            step = self.saved_step()
        except Exception:  # the run directory cannot be read: say that nothing was saved now
            step = None
        if step is None:
            error: Exception = StoppedUnsaved(signum, name)
            status = error.status
            line = str(error)
        else:
            status = EXIT_PREEMPTED
            line = (f"preempted ({name}) during start-up: nothing new to save; the checkpoint of step {step} is "
                    "kept; run the same command to resume")
        if process_rank() == 0:
            print(line, file=sys.stderr, flush=True)
        os._exit(status)


class StopGate:
    """Before every step and every evaluation batch, once each rank holds its data (or was cut short waiting for
    it), every rank takes the same decision: stop now (a signal reached some rank) and save now
    (`every_minutes` passed since the last checkpoint, on the main rank's clock).

    One all-reduce of two numbers on the host, over a gloo group of its own: no device synchronisation, about a
    tenth of a millisecond, and no rank commits to a step (its gradient all-reduce) that another cannot take. A
    signal is acted upon within one step or evaluation batch, whatever their length (docs/cluster.md)."""

    def __init__(self, accelerator: Any, signals: StopSignals, every_minutes: float, timeout_s: float = 600.0) -> None:
        self.accelerator, self.signals, self.every_s = accelerator, signals, every_minutes * 60.0
        self.last_save = time.monotonic()
        self.group = None
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def agree(self, stuck: bool = False) -> tuple[bool, bool]:
        """(stop, save for time), the same on every rank; `stuck`: this rank's wait for data was cut short."""
        time_due = self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s
        flags = [float(stuck or self.signals.received is not None),
                 float(time_due and self.accelerator.is_main_process)]
        if self.group is None:
            return flags[0] > 0, flags[1] > 0
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(flags)
        dist.all_reduce(tensor, group=self.group)
        return bool(tensor[0] > 0), bool(tensor[1] > 0)

    def saved(self) -> None:
        """A checkpoint was just written: the clock of time-based saves starts again."""
        self.last_save = time.monotonic()
