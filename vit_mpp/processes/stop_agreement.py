"""The stop agreement of every rank (`StopGate`), which the loop asks before every step and every evaluation batch
(vit_mpp/run/loop.py `Loop._agree`). See docs/cluster.md."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from vit_mpp.processes.stop_signals import StopSignals


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
        import torch.distributed as dist

        tensor = torch.tensor(flags)
        dist.all_reduce(tensor, group=self.group)
        return bool(tensor[0] > 0), bool(tensor[1] > 0)

    def saved(self) -> None:
        """A checkpoint was just written: the clock of time-based saves starts again."""
        self.last_save = time.monotonic()
