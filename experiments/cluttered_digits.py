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

from experiments.digits import build_shards, digits_split, load_digits
from vit_mpp.cli import ArgumentParser
from vit_mpp.processes.exits import run_main

TEST_FRACTION = 0.2
VAL_FRACTION = 0.05  # of the pool, for the MPP validation loss and the k-NN monitor
CHUNK = 2000  # images rendered at once (memory: a few float32 arrays of CHUNK x size x size x 3)
DISTRACTORS = 2  # faint other digits per image, each present with probability 0.7
LINES = 3  # line segments per image, each present with probability 0.6
MIN_CONTRAST = 90.0  # luminance difference (0-255) between the digit and the background under it
# The backgrounds are dark and the digits bright, whatever their colours: a ViT this small, trained from scratch on
# 20,000 images, stayed at chance when either could be the brighter (measured 2026-11-26; docs/results.md)
BACKGROUND_MAX = 110.0
PAD = 2  # zero pixels around each source digit: what sampling reads outside it
UP = 8  # the source digits are upsampled this many times (bilinear) once, then sampled at the nearest pixel
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


@dataclass(frozen=True)
class Sources:
    """The source digits (grey levels scaled to [0, 1]) and their fixed split into a train and a test part."""

    images: np.ndarray  # (1797, 96, 96) float32: the 8x8 digits with a border of PAD zero pixels, upsampled UP x
    labels: np.ndarray  # (1797,) int
    train: np.ndarray  # source indices of the train part, sorted
    test: np.ndarray  # source indices of the test part, sorted


@dataclass(frozen=True)
class Clutter:
    """What surrounds the digit. `full`: photo crops or gradients, up to LINES line segments and DISTRACTORS faint
    strokes of other digits; `light`: gradients only (placement, scale, rotation, stroke, colour and noise as in
    full), for a set that a small model learns at a small budget."""

    photos: np.ndarray | None  # background texture (load_photos); None: gradients only
    lines: int
    distractors: int

    @classmethod
    def named(cls, name: str) -> Clutter:
        return cls(load_photos(), LINES, DISTRACTORS) if name == "full" else cls(None, 0, 0)


def load_sources() -> Sources:
    """scikit-learn's bundled digits and the experiments' one fixed split (experiments/digits.py)."""
    digits = load_digits()
    train, test = digits_split(digits.target, TEST_FRACTION)
    images = _upsampled(np.pad(digits.images / 16.0, ((0, 0), (PAD, PAD), (PAD, PAD))).astype(np.float32))
    return Sources(images, digits.target.astype(int), train, test)


def _upsampled(images: np.ndarray) -> np.ndarray:
    """(n, h, w) images upsampled UP times with bilinear interpolation (pixel centres aligned), as two products."""
    def weights(n: int) -> np.ndarray:
        coarse = (np.arange(n * UP) + 0.5) / UP - 0.5
        return np.maximum(0, 1 - np.abs(coarse[:, None] - np.arange(n)[None, :])).astype(np.float32)

    rows, cols = weights(images.shape[1]), weights(images.shape[2])
    return np.einsum("yh,nhw,xw->nyx", rows, images, cols, optimize=True)


def load_photos() -> np.ndarray:
    """scikit-learn's two bundled sample photos, each in the 6 orders of its colour channels: (12, 427, 640, 3)
    float32, background texture."""
    from sklearn.datasets import load_sample_images

    photos = np.stack(load_sample_images().images).astype(np.float32)
    orders = [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]
    return np.concatenate([photos[..., list(order)] for order in orders])


def _bilinear(src: np.ndarray, which: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sample `src[which]` (images stacked on axis 0, each with a border that is sampled outside it) at float
    coordinates y, x (n, H, W), bilinear; float32, with the source's channels last when it has them."""
    h, w = src.shape[1:3]
    flat = src.reshape(len(src) * h * w, -1)
    y, x = np.clip(y, 0, h - 1.001), np.clip(x, 0, w - 1.001)
    y0, x0 = y.astype(np.int64), x.astype(np.int64)  # floor: the coordinates are >= 0
    fy, fx = (y - y0).astype(np.float32)[..., None], (x - x0).astype(np.float32)[..., None]
    base = which.reshape(-1, 1, 1) * (h * w) + y0 * w + x0
    top = flat[base] * (1 - fx) + flat[base + 1] * fx
    bottom = flat[base + w] * (1 - fx) + flat[base + w + 1] * fx
    out = top * (1 - fy) + bottom * fy
    return out if src.ndim == 4 else out[..., 0]


def _nearest(src: np.ndarray, which: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Sample `src[which]` ((n, h, w) images whose border is zero) at the pixels holding y, x (n, H, W); a
    coordinate outside reads the border."""
    h, w = src.shape[1:3]
    yi, xi = np.clip(y, 0, h - 1).astype(np.int64), np.clip(x, 0, w - 1).astype(np.int64)
    return src.reshape(-1)[which.reshape(-1, 1, 1) * (h * w) + yi * w + xi]


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres (1, size, size) for y and x (they broadcast against per-image values of shape (n, 1, 1))."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + np.float32(0.5)
    return y[None], x[None]


def _u(rng: np.random.Generator, lo: float, hi: float, n: int) -> np.ndarray:
    """n uniform draws in [lo, hi), float32, shaped (n, 1, 1) to broadcast over an image."""
    return rng.uniform(lo, hi, n).astype(np.float32).reshape(n, 1, 1)


def _digit_field(sources: Sources, idx: np.ndarray, rng: np.random.Generator, size: int,
                 box: tuple[float, float]) -> np.ndarray:
    """Grey fields (n, size, size) in [0, 1]: digits `idx` scaled to a box of `box` x size pixels, rotated (+-25
    degrees), sheared and stretched a little, centred at a random place with most of the digit inside."""
    n = len(idx)
    side = _u(rng, *box, n) * size
    angle = np.deg2rad(_u(rng, -25, 25, n))
    aspect, shear = _u(rng, 0.85, 1.15, n), _u(rng, -0.2, 0.2, n)
    cy, cx = (side / 2 + _u(rng, 0, 1, n) * (size - side) for _ in range(2))
    y, x = _grid(size)
    dy, dx = y - cy, x - cx
    cos, sin = np.cos(angle), np.sin(angle)
    ry, rx = cos * dy - sin * dx, sin * dy + cos * dx  # undo the rotation
    rx = rx - shear * ry
    per_px = 8.0 * UP / side  # upsampled source pixels per output pixel
    centre = (4 + PAD) * UP  # the digit's centre in the upsampled source, in pixel units from its corner
    return _nearest(sources.images, idx, ry * per_px * aspect + centre, rx * per_px / aspect + centre)


def _strokes(field: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Opacity of the strokes: the field thresholded softly at a random level (low: thick strokes, high: thin)."""
    level = _u(rng, 0.3, 0.6, len(field))
    return np.clip((field - level) * np.float32(1 / 0.15) + np.float32(0.5), 0.0, 1.0)


def _gradients(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """(n, size, size, 3) float32 two-colour gradients in a random direction (channels up to BACKGROUND_MAX)."""
    y, x = _grid(size)
    a, b = (rng.uniform(0, BACKGROUND_MAX, (n, 1, 1, 3)).astype(np.float32) for _ in range(2))
    theta = _u(rng, 0, 2 * np.pi, n)
    t = np.clip(((x - size / 2) * np.cos(theta) + (y - size / 2) * np.sin(theta)) / size + 0.5, 0, 1)[..., None]
    return a + (b - a) * t


def _backgrounds(n: int, size: int, rng: np.random.Generator, photos: np.ndarray | None) -> np.ndarray:
    """(n, size, size, 3) float32 backgrounds, dark: half random crops of the sample photos (zoomed, mirrored, dimmed
    to 15-45%), half gradients; without photos, all gradients."""
    if photos is None:
        return _gradients(n, size, rng)
    y, x = _grid(size)
    scale = _u(rng, 0.75, 6, n)  # photo pixels per image pixel
    h, w = photos.shape[1:3]
    top, left = _u(rng, 0, 1, n) * (h - scale * size), _u(rng, 0, 1, n) * (w - scale * size)
    xs = np.where(_u(rng, 0, 1, n) < 0.5, size - x, x)  # mirrored or not
    which, brightness = rng.integers(0, len(photos), n), _u(rng, 0.15, 0.45, n)[..., None]
    out = _gradients(n, size, rng)  # then a photo crop in half of them
    photo = np.flatnonzero(rng.random(n) < 0.5)
    out[photo] = _bilinear(photos, which[photo], top[photo] + y * scale[photo] - 0.5,
                           left[photo] + xs[photo] * scale[photo] - 0.5) * brightness[photo]
    return out


def _over(img: np.ndarray, colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """`colour` (n, 3) painted over `img` (n, H, W, 3) with opacity `alpha` (n, H, W), in place."""
    img += (colour.astype(np.float32)[:, None, None, :] - img) * alpha[..., None]
    return img


def _lines(img: np.ndarray, rng: np.random.Generator, count: int) -> np.ndarray:
    """Up to `count` random line segments (1-2.5 px wide, half to fully opaque, random colours)."""
    n, size = img.shape[:2]
    y, x = _grid(size)
    for _ in range(count):
        dy, dx = y - _u(rng, 0, size, n), x - _u(rng, 0, size, n)
        phi = _u(rng, 0, np.pi, n)
        length, width = _u(rng, 0.3, 1.5, n) * size, _u(rng, 1.0, 2.5, n)
        along = dx * np.cos(phi) + dy * np.sin(phi)
        across = np.abs(dy * np.cos(phi) - dx * np.sin(phi))
        opacity = (_u(rng, 0, 1, n) < 0.6) * _u(rng, 0.5, 1.0, n)
        alpha = np.clip(width / 2 + 0.5 - across, 0, 1) * (np.abs(along) < length / 2) * opacity
        img = _over(img, rng.uniform(0, 255, (n, 3)), alpha)
    return img


def _contrasting(colour: np.ndarray, under: np.ndarray) -> np.ndarray:
    """`colour` (n, 3), made darker or brighter where its luminance is within MIN_CONTRAST of `under` (n,), the
    background's luminance beneath the digit, so that the digit stays readable."""
    luma = colour @ LUMA
    dark = under >= 127.5  # push away from the background, towards the side with room
    target = np.where(dark, np.minimum(luma, under - MIN_CONTRAST), np.maximum(luma, under + MIN_CONTRAST))
    target = np.clip(target, 0, 255)
    darker = colour * (target / np.maximum(luma, 1e-3))[:, None]
    brighter = 255 - (255 - colour) * ((255 - target) / np.maximum(255 - luma, 1e-3))[:, None]
    return np.clip(np.where(dark[:, None], darker, brighter), 0, 255)


def render(sources: Sources, idx: np.ndarray, part: np.ndarray, rng: np.random.Generator,
           size: int, clutter: Clutter) -> tuple[np.ndarray, np.ndarray]:
    """Images (n, size, size, 3) uint8 of the source digits `idx`, and (n, DISTRACTORS) the source indices of their
    faint strokes (-1: none), drawn from `part` (the same part of the source split as `idx`)."""
    n = len(idx)
    img = _lines(_backgrounds(n, size, rng, clutter.photos), rng, clutter.lines)
    others = np.full((n, DISTRACTORS), -1)
    for k in range(clutter.distractors):
        on = rng.random(n) < 0.7
        other = rng.choice(part, n)
        alpha = _strokes(_digit_field(sources, other, rng, size, (0.4, 0.9)), rng)
        alpha = alpha * (on[:, None, None] * _u(rng, 0.2, 0.4, n))  # faint
        img = _over(img, rng.uniform(0, 255, (n, 3)), alpha)
        others[:, k] = np.where(on, other, -1)
    alpha = _strokes(_digit_field(sources, idx, rng, size, (0.5, 0.85)), rng)
    under = (img @ LUMA * alpha).sum((1, 2)) / np.maximum(alpha.sum((1, 2)), 1e-6)
    img = _over(img, _contrasting(rng.uniform(0, 255, (n, 3)), under), alpha)
    noise = rng.standard_normal(img.shape, dtype=np.float32) * _u(rng, 0, 8, n)[..., None]
    return np.clip(np.rint(img + noise), 0, 255).astype(np.uint8), others


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


def render_all(sources: Sources, idx: np.ndarray, part: np.ndarray, seed: tuple[int, int], size: int,
               clutter: Clutter) -> tuple[np.ndarray, np.ndarray]:
    """`render` in chunks of CHUNK images, each with its own generator (seed, part, chunk): the same images for a
    seed whatever else is drawn."""
    images, others = [], []
    for start in range(0, len(idx), CHUNK):
        rng = np.random.default_rng([*seed, start // CHUNK])
        img, oth = render(sources, idx[start:start + CHUNK], part, rng, size, clutter)
        images.append(img)
        others.append(oth)
    return np.concatenate(images), np.concatenate(others)


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
