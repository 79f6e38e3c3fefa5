"""Matplotlib, set up once for every figure the tool draws: PNG files only (the Agg backend), never a window, so
figures work on servers, in data-loader workers and under a launcher. Imported when the first figure is drawn, not
when a run starts: matplotlib costs half a second of every process's start-up, and most never draw."""

from __future__ import annotations

import functools
import io
from pathlib import Path
from types import ModuleType
from typing import Any

from vit_mpp.config.engine import ConfigError
from vit_mpp.tools.args import write_out_bytes

__all__ = ["check_figure_name", "pyplot", "save_figure"]


@functools.cache
def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (chosen before pyplot is first imported)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_figure_name(path: str | Path, flag: str = "--out") -> str:
    """The format matplotlib writes for `path`'s suffix (png, pdf, svg, ...); a ConfigError for any other name."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(path).suffix.lower().removeprefix(".")
    if suffix not in formats:
        raise ConfigError(f"{flag} {path}: a figure is written as {', '.join('.' + f for f in sorted(formats))}; "
                          f"give a file name with one of these suffixes")
    return suffix


def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> Path:
    """Write `fig` (a matplotlib Figure) to `path` (tight bounding box; its folder created if need be) and free it;
    returns the path.

    The figure is drawn in memory and written with a plain write, because matplotlib's own file writing lets a failed
    write pass (a full disk left a truncated figure and no error); a file that cannot be written is one line."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=check_figure_name(path), dpi=dpi, bbox_inches="tight")
    finally:
        pyplot().close(fig)
    write_out_bytes(path, buffer.getvalue())
    return Path(path)
