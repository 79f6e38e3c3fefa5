"""Progress on long work, the same in every tool (predict, evaluate, analysis, build-shards), on standard error: on
a terminal a rich bar with count, rate and ETA; otherwise a plain line every `every_s` seconds. Standard output
stays the tool's own. Use: `with progress("labelling", total=len(paths)) as advance: ... advance(len(batch))`.
See docs/finetune.md, "Evaluate an export".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
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


def _amount(n: float, unit: str) -> str:
    """`1,200 images`, or for bytes `35.2 MB`."""
    return f"{n / 1e6:,.1f} MB" if unit == "bytes" else f"{n:,.0f} {unit}"


def _fraction(done: float, total: float, unit: str) -> str:
    """`1,200/5,000 images`, or for bytes `35.2/100.0 MB`."""
    if unit == "bytes":
        return f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB"
    return f"{done:,.0f}/{total:,.0f} {unit}"


class RateColumn(ProgressColumn):
    """Items per second, in the work's own unit."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:  # noqa: ANN001 - rich's Task
        return Text(f"{_amount(task.speed or 0, self.unit)}/s")


class AmountColumn(ProgressColumn):
    """Done / total, in the work's own unit."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:  # noqa: ANN001 - rich's Task
        if task.total:
            return Text(_fraction(task.completed, task.total, self.unit))
        return Text(_amount(task.completed, self.unit))


class Progressing:
    """What `progress` yields: `advance(n)` (n more done), or `update(completed=, description=, total=)`."""

    def __init__(self, description: str, total: float | None, unit: str, completed: float) -> None:
        self.description, self.total, self.unit, self.done = description, total, unit, completed

    def __call__(self, n: float = 1) -> None:
        self.update(completed=self.done + n)

    def update(self, completed: float | None = None, description: str | None = None,
               total: float | None = None) -> None:
        self.done = self.done if completed is None else completed
        self.description = description or self.description
        self.total = total or self.total
        self._show()

    def _show(self) -> None:
        raise NotImplementedError


class _Bar(Progressing):
    def __init__(self, bar: Progress, description: str, total: float | None, unit: str, completed: float) -> None:
        super().__init__(description, total, unit, completed)
        self.bar, self.task = bar, bar.add_task(description, total=total, completed=completed)

    def _show(self) -> None:
        self.bar.update(self.task, completed=self.done, description=self.description, total=self.total)


class _Lines(Progressing):
    """Progress as a plain line every `every_s` seconds (no terminal)."""

    def __init__(self, console: Console, description: str, total: float | None, unit: str, completed: float,
                 every_s: float) -> None:
        super().__init__(description, total, unit, completed)
        self.console, self.every_s, self.first = console, every_s, completed
        self.start = self.last = time.monotonic()

    def _show(self) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = (self.done - self.first) / max(now - self.start, 1e-9)
        if self.total:
            left = max(self.total - self.done, 0) / rate if rate else 0.0
            line = (f"{self.description}: {_fraction(self.done, self.total, self.unit)} "
                    f"({100 * self.done / self.total:.0f}%), {_amount(rate, self.unit)}/s, eta {format_duration(left)}")
        else:
            line = f"{self.description}: {_amount(self.done, self.unit)}, {_amount(rate, self.unit)}/s"
        self.console.out(line, highlight=False)


@contextlib.contextmanager
def progress(description: str, total: float | None, unit: str = "images", *, console: Console | None = None,
             every_s: float = PLAIN_EVERY_S, completed: float = 0) -> Iterator[Progressing]:
    """Show the progress of `total` items of work (None: unknown; `unit` "bytes" shows MB and MB/s) while the block
    runs; yields a `Progressing` (call it with how many more are done, or `update` it). The console defaults to
    standard error; a bar when it is a terminal, plain periodic lines otherwise."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield _Lines(console, description, total, unit, completed, every_s)
        return
    # Standard output is the tool's own (predict's CSV): only what goes to standard error is drawn above the bar.
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), AmountColumn(unit),
                   RateColumn(unit), TimeRemainingColumn(), console=console, transient=True, refresh_per_second=4,
                   redirect_stdout=False)
    with bar:
        yield _Bar(bar, description, total, unit, completed)
