"""Preemption and time-based checkpoints: a signal of `train.preempt_signals` on any rank raises a flag; at a step
boundary every rank agrees in one small collective to save that step, and the run exits 75 with one line. A watcher
thread sees a signal at once, so a rank blocked in a broken collective or still starting also ends. See
docs/cluster.md and docs/reliability.md."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from vit_mpp import launcher
from vit_mpp.errors import EXIT_PREEMPTED
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


class StopSignals:
    """Catches the preemption signals for the life of a run (a context manager: the previous handlers come back)."""

    def __init__(self, names: list[str]) -> None:
        self.signals = [getattr(signal, n) for n in names]
        self.received: int | None = None
        self.in_loop = False  # before the first step there is nothing new to save: a signal ends the run at once
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

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        launcher.signalled = True
        if self.received is None:
            self.received = signum

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
            if process_rank() == 0:
                print(f"preempted ({signal.Signals(signum).name}) before the first step: nothing new to save; run "
                      "the same command to resume", file=sys.stderr, flush=True)
            os._exit(EXIT_PREEMPTED)
        if self.received is None:
            self.received = signum


class StepBoundary:
    """At step boundaries, every rank takes the same decision: stop now (a signal reached some rank) and save now
    (`every_minutes` passed since the last checkpoint, on the main rank's clock).

    One all-reduce of three numbers, started without waiting (it overlaps the next steps) and read at the next
    check: a signal stops the run a check later on every rank. The checks are spaced so that they cost under 0.2%
    of the training time, and never more than about `MAX_DELAY_S` apart: the main rank proposes the spacing from the
    steps' and the check's measured durations, inside the same collective, so every rank adopts it at the same step."""

    MAX_DELAY_S = 2.0  # how late, at most, a signal is acted upon (beyond the step it arrives in)
    SHARE = 0.002  # of the training time the checks may take

    def __init__(self, accelerator: Any, signals: StopSignals, every_minutes: float) -> None:
        self.accelerator, self.signals, self.every_s = accelerator, signals, every_minutes * 60.0
        self.last_save = self.last_check = time.monotonic()
        self.every, self.count, self.cost = 1, 0, 0.0  # check every `every` steps (agreed); its measured cost
        self._pending: tuple[Any, Any] | None = None  # (the collective in flight, its tensor)

    def check(self) -> tuple[bool, bool]:
        """(preempt, save for time), the same on every rank; call it after every step."""
        time_due = self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s
        flags = [float(self.signals.received is not None), float(time_due and self.accelerator.is_main_process)]
        if self.accelerator.num_processes == 1:
            return flags[0] > 0, flags[1] > 0
        self.count += 1
        if self.count % self.every:
            return False, False
        start = time.monotonic()
        step_s = (start - self.last_check) / self.every
        agreed = self._wait()
        flags.append(self._spacing(step_s) if self.accelerator.is_main_process else 0.0)
        self._launch(flags)
        self.cost, self.last_check = time.monotonic() - start, time.monotonic()
        if agreed is None:
            return False, False
        self.every, self.count = max(1, int(agreed[2])), 0
        return agreed[0] > 0, agreed[1] > 0

    def _spacing(self, step_s: float) -> float:
        """The main rank's proposal: steps between checks."""
        wanted = math.ceil(self.cost / (self.SHARE * max(step_s, 1e-9)))
        return float(max(1, min(wanted, int(self.MAX_DELAY_S / max(step_s, 1e-9)))))

    def _launch(self, flags: list[float]) -> None:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(flags, device=self.accelerator.device)
        self._pending = (dist.all_reduce(tensor, async_op=True), tensor)

    def _wait(self) -> list[float] | None:
        """The flags of the collective in flight, once it has finished (None when none is)."""
        if self._pending is None:
            return None
        work, tensor = self._pending
        self._pending = None
        work.wait()
        return tensor.tolist()

    def saved(self) -> bool:
        """A checkpoint was just written: the clock starts again, and the collective in flight is finished. Returns
        whether it agreed to stop (a signal reached some rank before the save), the same answer on every rank: the
        run then stops with the checkpoint just written. Its clock decision is dropped (the save was just made).

        The stop must not be dropped with it: checkpoints closer together than two checks (frequent `ckpt_every`
        steps, or a machine slowed down so that checks are spaced more steps apart) finished every collective here,
        and a signal was then never acted upon: ranks orphaned by a killed launcher trained on."""
        agreed = self._wait()
        if agreed is not None:
            self.every, self.count = max(1, int(agreed[2])), 0
        self.last_save = self.last_check = time.monotonic()
        return agreed is not None and agreed[0] > 0

    def close(self) -> None:
        """Finish the collective in flight (every rank calls it when the loop ends)."""
        self._wait()
