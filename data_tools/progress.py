"""The progress bar of build-shards (listing, then writing shards): shown in a terminal, never in logs."""

from __future__ import annotations

import sys

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class SpeedColumn(ProgressColumn):
    """Images per second."""

    def render(self, task) -> Text:
        return Text(f"{task.speed or 0:,.0f} img/s")


def progress_bar() -> Progress:
    """Rate and ETA while it runs, in a terminal; nothing in logs (the closing lines give the totals)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    SpeedColumn(), TimeRemainingColumn(), refresh_per_second=4, transient=True,
                    disable=not sys.stdout.isatty())
