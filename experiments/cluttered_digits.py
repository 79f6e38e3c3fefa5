"""Cluttered digits: scikit-learn's 1,797 scanned digits rendered as small RGB images with random placement, scale,
rotation, stroke thickness and colour over cluttered backgrounds (photo crops, gradients, lines, faint strokes of
other digits): a harder real-image set to tell pretraining recipes apart (docs/results.md, "Cluttered digits").

    python -m experiments.cluttered_digits OUT [--size 32] [--pool 20000] [--test 2000] [--labels-per-class 20]
                                          [--clutter full|light] [--seed 0] [--overwrite]

The source digits are split once (80/20, stratified, split seed 0, the split of experiments/pretrain_vs_scratch.py):
the pool and its labelled subset are drawn from the first part only, the test images from the second, so test
images show digits (writers' strokes) never seen in training. Writes class-folder trees of PNGs under OUT/images
(pool/{train,val}, labelled/{train,val}, test/test), their shards under OUT/shards (build-shards, run as a
subprocess), OUT/sources.csv (each image's source digit and the digits of its faint strokes) and OUT/samples.png.
"""

from __future__ import annotations

import csv
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from experiments.clutter_render import Clutter, Sources, load_sources, render_all
from experiments.digits import build_shards
from vit_mpp.cli import ArgumentParser
from vit_mpp.processes.exits import run_main

VAL_FRACTION = 0.05  # of the pool, for the MPP validation loss and the k-NN monitor


def balanced_sources(sources: Sources, part: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` source indices from `part`, the ten digits in turn (as balanced as `count` allows), each a random
    digit of its class, in a random order."""
    labels = rng.permutation(np.arange(count) % 10)
    chosen = np.empty(count, dtype=np.int64)
    for digit in range(10):
        of_digit = part[sources.labels[part] == digit]
        where = labels == digit
        chosen[where] = rng.choice(of_digit, int(where.sum()))
    return chosen


@dataclass(frozen=True)
class Plan:
    """What to write: the pool, which of it is val, the labelled subset, the test images (source indices)."""

    pool: np.ndarray
    pool_val: np.ndarray  # bool per pool image
    labelled: np.ndarray  # pool positions of the labelled training images
    test: np.ndarray


def plan(sources: Sources, pool: int, test: int, per_class: int, seed: int) -> Plan:
    """The source digit of every image, deterministic for `seed`; the val images are the first VAL_FRACTION of each
    digit's pool images (balanced), the labelled ones `per_class` of each digit's pool training images."""
    rng = np.random.default_rng([seed, 0])
    pool_src = balanced_sources(sources, sources.train, pool, rng)
    test_src = balanced_sources(sources, sources.test, test, rng)
    labels = sources.labels[pool_src]
    val = np.zeros(pool, dtype=bool)
    labelled = []
    per_val = max(1, round(pool * VAL_FRACTION / 10))
    for digit in range(10):
        positions = np.flatnonzero(labels == digit)
        val[positions[:per_val]] = True
        labelled += sorted(rng.choice(positions[per_val:], per_class, replace=False).tolist())
    return Plan(pool_src, val, np.array(sorted(labelled)), test_src)


def write_png(root: Path, name: str, label: int, image: np.ndarray) -> Path:
    path = root / str(label) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image, "RGB").save(path)
    return path


def samples_grid(images: np.ndarray, labels: np.ndarray, path: Path, zoom: int = 4) -> None:
    """A PNG of the images in an 8-column grid, zoomed `zoom` times (nearest), each with its label in a corner."""
    n, size = len(images), images.shape[1]
    cell = size * zoom + 4
    rows = (n + 7) // 8
    grid = Image.new("RGB", (8 * cell, rows * cell), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, label) in enumerate(zip(images, labels)):
        x, y = (i % 8) * cell + 2, (i // 8) * cell + 2
        grid.paste(Image.fromarray(image).resize((size * zoom, size * zoom), Image.NEAREST), (x, y))
        draw.rectangle((x, y, x + 9, y + 11), fill="black")
        draw.text((x + 2, y), str(label), fill="white")
    grid.save(path)


@dataclass(frozen=True)
class Options:
    """The command line, checked."""

    out: Path
    size: int = 32
    pool: int = 20000
    test: int = 2000
    labels_per_class: int = 20
    seed: int = 0
    clutter: str = "full"


def generate(opts: Options) -> dict[str, float]:
    """Write everything under opts.out (see the module's docstring); returns seconds per phase."""
    times, start = {}, time.perf_counter()
    sources, clutter = load_sources(), Clutter.named(opts.clutter)
    p = plan(sources, opts.pool, opts.test, opts.labels_per_class, opts.seed)
    pool_img, pool_oth = render_all(sources, p.pool, sources.train, (opts.seed, 1), opts.size, clutter)
    test_img, test_oth = render_all(sources, p.test, sources.test, (opts.seed, 2), opts.size, clutter)
    times["render"] = time.perf_counter() - start
    images, rows = opts.out / "images", []
    pool_labels, test_labels = sources.labels[p.pool], sources.labels[p.test]
    written = {}
    for i, (image, label) in enumerate(zip(pool_img, pool_labels)):
        split = "val" if p.pool_val[i] else "train"
        written[i] = write_png(images / "pool" / split, f"{i:05d}.png", label, image)
        rows.append(("pool", split, f"pool/{split}/{label}/{i:05d}.png", label, p.pool[i], pool_oth[i]))
    for i, (image, label) in enumerate(zip(test_img, test_labels)):
        write_png(images / "test" / "test", f"{i:05d}.png", label, image)
        rows.append(("test", "test", f"test/test/{label}/{i:05d}.png", label, p.test[i], test_oth[i]))
    for i in [*p.labelled.tolist(), *np.flatnonzero(p.pool_val).tolist()]:
        split = "val" if p.pool_val[i] else "train"
        target = images / "labelled" / split / str(pool_labels[i]) / written[i].name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(written[i], target)
    with (opts.out / "sources.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["set", "split", "path", "label", "source", "faint_sources"])
        w.writerows((*r[:5], " ".join(str(o) for o in r[5] if o >= 0)) for r in rows)
    shown = np.random.default_rng([opts.seed, 3]).choice(np.flatnonzero(~p.pool_val), 64, replace=False)
    samples_grid(pool_img[shown], pool_labels[shown], opts.out / "samples.png")
    times["png"] = time.perf_counter() - start - times["render"]
    for name in ("pool", "labelled", "test"):
        build_shards(images / name, opts.out / "shards" / name, shard_size=1000)
    times["shards"] = time.perf_counter() - start - times["render"] - times["png"]
    return times


def parse(argv: list[str] | None) -> Options:
    p = ArgumentParser(prog="python -m experiments.cluttered_digits", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the folder to write (images/, shards/, sources.csv, samples.png)")
    p.add_argument("--size", type=int, default=32, help="image side in pixels (default: %(default)s)")
    p.add_argument("--pool", type=int, default=20000,
                   help="images of the unlabelled pool, 5%% of them its val split (default: %(default)s)")
    p.add_argument("--test", type=int, default=2000, help="test images, of held-out digits (default: %(default)s)")
    p.add_argument("--labels-per-class", type=int, default=20,
                   help="labelled training images per digit, drawn from the pool's train split (default: %(default)s)")
    p.add_argument("--clutter", choices=("full", "light"), default="full",
                   help="full: photo or gradient backgrounds, lines, faint other digits; light: gradients only "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="everything drawn follows it (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace what an earlier run wrote in OUT")
    args = p.parse_args(argv)
    if args.size < 16:
        p.error(f"--size must be at least 16, got {args.size}")
    if args.pool < 200 or args.test < 10:
        p.error(f"--pool must be at least 200 and --test at least 10, got {args.pool} and {args.test}")
    per_class_train = args.pool // 10 - max(1, round(args.pool * VAL_FRACTION / 10))
    if not 1 <= args.labels_per_class <= per_class_train:
        p.error(f"--labels-per-class must be in [1, {per_class_train}] (the pool's training images per digit), "
                f"got {args.labels_per_class}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    mine = [args.out / name for name in ("images", "shards", "sources.csv", "samples.png")]
    if any(path.exists() for path in mine) and not args.overwrite:
        p.error(f"{args.out} already holds a generated set: give --overwrite to replace it, or another OUT")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"{args.out} is a file, not a folder")
    for path in mine if args.overwrite else ():
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return Options(args.out, args.size, args.pool, args.test, args.labels_per_class, args.seed, args.clutter)


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    t = generate(opts)
    val = max(1, round(opts.pool * VAL_FRACTION / 10)) * 10
    print(f"wrote {opts.pool:,} pool images ({opts.pool - val:,} train / {val:,} val), "
          f"{opts.labels_per_class * 10} labelled ({opts.labels_per_class} per digit), {opts.test:,} test images "
          f"at {opts.size}x{opts.size} to {opts.out} in {sum(t.values()):.1f} s (render {t['render']:.1f} s, "
          f"PNG {t['png']:.1f} s, shards {t['shards']:.1f} s); shards: {opts.out / 'shards'}/{{pool,labelled,test}}, "
          f"samples: {opts.out / 'samples.png'}")


if __name__ == "__main__":
    run_main(main)
