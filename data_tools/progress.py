"""The progress bars of build-shards (listing, then writing shards; reading shards to index them): shown in a
terminal, never in logs."""

from __future__ import annotations

import sys

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
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


def transfer_bar() -> Progress:
    """Bytes read, MB/s and the ETA while it runs, in a terminal (build-shards index); nothing in logs."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), refresh_per_second=4, transient=True,
                    disable=not sys.stdout.isatty())
