"""Matplotlib, set up once for every figure the tool draws: PNG files only (the Agg backend), never a window, so
figures work on servers, in data-loader workers and under a launcher."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

__all__ = ["plt", "save_figure"]


def save_figure(fig: plt.Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write `fig` to `path` (tight bounding box; its folder created if need be) and free it; returns the path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
