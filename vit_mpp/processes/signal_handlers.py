"""Handling some signals for the length of a block (`handling`): the one place a command swaps its signal handlers
in and puts the old ones back. compare's stop of its runs (experiments/run_scheduler.py) and a tool's stop while it
writes an output (vit_mpp/tools/args.py) use it; a training run's preemption has its own (stop_signals.py)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def handling(signals: Iterable[int], handler: Callable[[int, Any], None],
             takes: Callable[[Any], bool]) -> Iterator[None]:
    """In the block, `handler` handles each of `signals` whose handler now (SIG_DFL, SIG_IGN or a function) `takes`
    accepts; the previous handlers come back after it. Only in the main thread, where Python runs handlers and lets
    them be set; elsewhere the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals if takes(signal.getsignal(sig))}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
