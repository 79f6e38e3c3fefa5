"""Handling some signals for the length of a block (`handling`): the one place a command swaps its signal handlers
in and puts the old ones back. compare's stop of its runs (experiments/run_scheduler.py) and a tool's stop while it
writes an output (vit_mpp/tools/args.py) use it; a training run's preemption has its own (stop_signals.py).
`deferred` moves Python's handlers of a block's signals to the points where the block says it is safe to run them:
the poll loops of build-shards and its indexer, which wait on worker pools."""

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


@contextlib.contextmanager
def deferred(signals: Iterable[int]) -> Iterator[Callable[[], None]]:
    """In the block, a signal among `signals` whose handler is a Python function (Ctrl-C's `default_int_handler`, a
    command's own) is only noted; that handler runs at the block's calls of the yielded `run_pending()`, and once
    more as the block ends without an exception. Why: a handler that raises (KeyboardInterrupt) where it lands can
    land inside a lock's Python code (`Condition.wait`, which `concurrent.futures.wait` uses) and leave the lock
    released twice (`RuntimeError: release unlocked lock` instead of the interrupt) or held for ever."""
    signals = list(signals)
    before = {sig: signal.getsignal(sig) for sig in signals}
    noted: list[int] = []

    def run_pending() -> None:
        while noted:
            sig = noted.pop(0)
            before[sig](sig, None)

    with handling(signals, lambda sig, frame: noted.append(sig), takes=callable):
        yield run_pending
    run_pending()
