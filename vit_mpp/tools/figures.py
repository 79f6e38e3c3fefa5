"""Matplotlib, set up once for every figure the tool draws: PNG files only (the Agg backend), never a window, so
figures work on servers, in data-loader workers and under a launcher."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from vit_mpp.config.engine import ConfigError  # noqa: E402
from vit_mpp.tools.args import write_out_bytes  # noqa: E402

__all__ = ["check_figure_name", "plt", "save_figure"]


def check_figure_name(path: str | Path, flag: str = "--out") -> str:
    """The format matplotlib writes for `path`'s suffix (png, pdf, svg, ...); a ConfigError for any other name."""
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(path).suffix.lower().removeprefix(".")
    if suffix not in formats:
        raise ConfigError(f"{flag} {path}: a figure is written as {', '.join('.' + f for f in sorted(formats))}; "
                          f"give a file name with one of these suffixes")
    return suffix


def save_figure(fig: plt.Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write `fig` to `path` (tight bounding box; its folder created if need be) and free it; returns the path.

    The figure is drawn in memory and written with a plain write, because matplotlib's own file writing lets a failed
    write pass (a full disk left a truncated figure and no error); a file that cannot be written is one line."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=check_figure_name(path), dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    write_out_bytes(path, buffer.getvalue())
    return Path(path)
