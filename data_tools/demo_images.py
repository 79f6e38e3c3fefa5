"""Generate the demo dataset: a class-folder tree of small JPEG images of drawn textures (nothing downloaded), four
classes told apart by their spatial structure, never by their colours (docs/analysis.md, "Example").

    python -m data_tools.demo_images OUT_DIR [--per-class 500] [--size 48] [--seed 0]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from vit_mpp.cli import ArgumentParser
from vit_mpp.processes.exits import run_main

CLASSES = ("checks", "dots", "horizontal", "vertical")


def _colour(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, 3).astype(np.float64)


def _pattern(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A (size, size) boolean texture of the given class, with a random period and phase."""
    period = rng.uniform(3.0, 7.0)
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) + rng.uniform(0, period, 2)[:, None, None]
    if kind in ("horizontal", "vertical"):
        return ((y if kind == "horizontal" else x) % period) < period / 2
    if kind == "checks":
        return ((x // (period / 2)) + (y // (period / 2))) % 2 == 0
    if kind == "dots":
        return ((x % period) - period / 2) ** 2 + ((y % period) - period / 2) ** 2 < (period / 3.2) ** 2
    raise ValueError(kind)


def draw_texture(kind: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One image: a two-colour texture of class `kind` inside a random ellipse on a noisy background."""
    a, b, bg = _colour(rng), _colour(rng), _colour(rng)
    while np.abs(a - b).sum() < 150:  # keep the texture visible
        b = _colour(rng)
    tex = np.where(_pattern(kind, size, rng)[..., None], a, b)
    y, x = np.mgrid[0:size, 0:size]
    cy, cx = rng.uniform(0.3, 0.7, 2) * size
    ry, rx = rng.uniform(0.3, 0.55, 2) * size
    inside = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2 < 1
    img = np.where(inside[..., None], tex, bg) + rng.normal(0, 12, (size, size, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(0.4))


def generate(out_dir: str | Path, per_class: int = 500, size: int = 48, seed: int = 0) -> Path:
    """Write `per_class` JPEGs of each class to out_dir/<class>/<index>.jpg; returns out_dir."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    for kind in CLASSES:
        folder = out_dir / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            draw_texture(kind, size, rng).save(folder / f"{i:05d}.jpg", quality=92)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m data_tools.demo_images", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--per-class", type=int, default=500)
    p.add_argument("--size", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.per_class < 1 or args.size < 1:
        p.error(f"--per-class and --size must be at least 1, got {args.per_class} and {args.size}")
    generate(args.out_dir, args.per_class, args.size, args.seed)
    print(f"wrote {args.per_class * len(CLASSES)} images in {len(CLASSES)} classes to {args.out_dir}")


if __name__ == "__main__":
    run_main(main)
