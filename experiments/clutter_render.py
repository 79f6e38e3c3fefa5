"""The cluttered digits' images (experiments/cluttered_digits.py writes the set): scikit-learn's scanned digits
(`load_sources`, split once) rendered at random placement, scale, rotation, stroke thickness and colour, in a colour
that contrasts with what lies under it, over a `Clutter` of gradients or photo crops, line segments and faint
strokes of other digits (`render`, `render_all`: deterministic for a seed, in chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from experiments.digits import digits_split, load_digits

TEST_FRACTION = 0.2
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
