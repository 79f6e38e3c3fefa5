"""The run's own clock: when this process's stage began (`mark_start`, called first thing by each stage's `main`,
before torch is imported), so that a run's summary counts its start-up too. See docs/pretrain.md#what-a-run-prints.
"""

from __future__ import annotations

import time

_started = time.perf_counter()  # a stage started some other way than its main: from the first import


def mark_start() -> None:
    """This process's run starts now (each call of a stage's `main`, so that runs in one process each count their
    own time)."""
    global _started
    _started = time.perf_counter()


def started() -> float:
    """When this process's run started, on `time.perf_counter`'s clock."""
    return _started
