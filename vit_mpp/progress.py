"""Progress on long work, the same in every tool (predict, evaluate, analysis; build-shards can take it too):

    with progress("labelling", total=len(paths), unit="images") as advance:
        for batch in batches:
            ...
            advance(len(batch))

On a terminal: a rich progress bar with count, rate and ETA, on standard error, gone when the work is done (the
tool's own closing line gives the totals). Otherwise (a log file, a pipe, CI): no escape codes, only a plain line
every `every_s` seconds (`labelling: 1200/5000 images (24%), 85 images/s, eta 0m44s`), so short work prints
nothing and long work leaves a readable trace. Standard output stays the tool's own (predict's CSV).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
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

PLAIN_EVERY_S = 30.0  # without a terminal, one line this often


def format_duration(seconds: float) -> str:
    """`5h51m` or `4m07s`."""
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class RateColumn(ProgressColumn):
    """Items per second, in the work's own unit."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:  # noqa: ANN001 - rich's Task
        return Text(f"{task.speed or 0:,.1f} {self.unit}/s")


class PlainProgress:
    """Progress as a plain line every `every_s` seconds (no terminal)."""

    def __init__(self, console: Console, description: str, total: int | None, unit: str, every_s: float) -> None:
        self.console, self.description, self.total, self.unit, self.every_s = console, description, total, unit, every_s
        self.done = 0
        self.start = self.last = time.monotonic()

    def advance(self, n: int = 1) -> None:
        """`n` more items done; a line when `every_s` has passed since the last one."""
        self.done += n
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        line = f"{self.description}: {self.done:,}"
        if self.total:
            left = max(self.total - self.done, 0) / rate if rate else 0.0
            line += (f"/{self.total:,} {self.unit} ({100 * self.done / self.total:.0f}%), {rate:,.1f} {self.unit}/s, "
                     f"eta {format_duration(left)}")
        else:
            line += f" {self.unit}, {rate:,.1f} {self.unit}/s"
        self.console.out(line, highlight=False)


@contextlib.contextmanager
def progress(description: str, total: int | None, unit: str = "images", *, console: Console | None = None,
             every_s: float = PLAIN_EVERY_S) -> Iterator[Callable[[int], None]]:
    """Show the progress of `total` items of work (None: unknown) while the block runs; yields `advance(n)`. The
    console defaults to standard error; a bar when it is a terminal, plain periodic lines otherwise."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield PlainProgress(console, description, total, unit, every_s).advance
        return
    # Standard output is the tool's own (predict's CSV): only what goes to standard error is drawn above the bar.
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   RateColumn(unit), TimeRemainingColumn(), console=console, transient=True, refresh_per_second=4,
                   redirect_stdout=False)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
