"""Progress (rate and ETA) on an evaluation's batches, shown by the main process only: a bar on a terminal, a plain
line every 30 s in a log (vit_mpp/progress.py), so a redirected output stays readable. See
docs/pretrain.md#what-a-run-prints."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from accelerate import Accelerator

from vit_mpp.progress import progress


def counting(loader: Iterable[dict[str, Any]], advance: Callable[[int], None], processes: int,
             ) -> Iterator[dict[str, Any]]:
    """The batches of `loader`, telling `advance` of the images each holds (this process's valid ones times the
    number of processes: every process reads an equal share). The batches are still on the host: no device
    synchronisation."""
    for batch in loader:
        yield batch
        advance(int(batch["valid"].sum()) * processes)


@contextlib.contextmanager
def with_progress(accelerator: Accelerator, loader: Iterable[dict[str, Any]], description: str,
                  total: int) -> Iterator[Iterable[dict[str, Any]]]:
    """`loader`'s batches, counted into a progress display of `total` images on the main process; the others get
    `loader` itself."""
    if not accelerator.is_main_process:
        yield loader
        return
    with progress(description, total) as advance:
        yield counting(loader, advance, accelerator.num_processes)
