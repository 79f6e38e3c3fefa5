"""Image checks and encoding: fully decode every input; keep the original bytes when they are fine as they are,
else convert to 8-bit RGB (EXIF rotation, alpha, exact 16-bit scaling, CMYK, palette), resize and re-encode once.
`prepare_image` is the one function that turns input bytes into the stored image; whatever else must see images as
training does (prediction on new images) calls it too. See docs/build_shards.md#images.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps

FORMAT_EXT = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}  # MPO: camera JPEGs with extra frames
PIL_FORMAT = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
ORIENTATION = 0x0112  # EXIF tag
WHITE = (255, 255, 255)

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file must fail here, not silently become grey pixels


class BadImage(ValueError):
    """An input that cannot become a sample. `reason` is a short code; the message says more."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class EncodeSettings:
    max_side: int = 0  # 0: never resize; otherwise `resize_side` is brought down to this
    min_side: int = 1  # images whose shorter side is smaller are rejected
    quality: int = 90  # JPEG/WebP quality when re-encoding
    format: str = "jpg"  # re-encoding format: jpg, png or webp
    resize_side: str = "longer"  # which side `max_side` limits: longer or shorter
    max_pixels: int = 100_000_000  # larger images are rejected as decompression bombs

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict | None) -> EncodeSettings:
        """The settings recorded in a manifest's `encoder` entry (unknown keys ignored); conversions only if None."""
        return cls(**{k: v for k, v in (record or {}).items() if k in cls.__dataclass_fields__})


def clean_detail(text: str) -> str:
    """An error message made reproducible: no object addresses (PIL names the BytesIO it failed on), one line."""
    return " ".join(re.sub(r"<([\w.]+) object at 0x[0-9a-fA-F]+>", r"<\1>", text).split())


def _sixteen_bit_rawmode(img: Image.Image) -> str | None:
    """The raw mode of an image whose 16-bit colour samples PIL reduces to 8 bits (e.g. 'RGB;16B'), else None."""
    if img.mode not in ("RGB", "RGBA") or not img.tile:
        return None
    rawmode = img.tile[0].args if isinstance(img.tile[0].args, str) else (img.tile[0].args or ("",))[0]
    return rawmode if isinstance(rawmode, str) and rawmode.endswith((";16B", ";16L")) else None


def _exact_16bit(data: bytes, img: Image.Image, rawmode: str) -> Image.Image:
    """`img` (decoded by PIL from 16-bit samples: the high bytes) with each channel rounded from 16 bits exactly.

    A second decode with the opposite byte order reads the low bytes. If PIL has no unpacker for that order, PIL's
    own reduction is kept (off by at most one level)."""
    swapped = rawmode[:-1] + ("L" if rawmode.endswith("B") else "B")
    low = Image.open(io.BytesIO(data))
    low.tile = [t._replace(args=swapped if isinstance(t.args, str) else (swapped, *t.args[1:])) for t in low.tile]
    try:
        low.load()
    except (ValueError, OSError):
        return img
    value = np.asarray(img, dtype=np.uint32) * 256 + np.asarray(low, dtype=np.uint32)  # (H, W, C), 0..65535
    return Image.fromarray(((value * 255 + 32767) // 65535).astype(np.uint8), img.mode)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB: alpha composited on white, 16/32-bit and float scaled to 0..255."""
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        arr = np.asarray(img, dtype=np.float64)
        # 16-bit data stored as I/I;16 spans 0..65535; a float image is assumed to be 0..1 when it fits there
        top = 65535.0 if arr.max(initial=0) > 255 else (1.0 if img.mode == "F" and arr.max(initial=0) <= 1 else 255.0)
        img = Image.fromarray(np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, WHITE)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img if img.mode == "RGB" else img.convert("RGB")  # convert() to the same mode copies the image


def _target_size(w: int, h: int, settings: EncodeSettings) -> tuple[int, int] | None:
    """The new size when the limited side exceeds `max_side`, else None."""
    if not settings.max_side:
        return None
    side = max(w, h) if settings.resize_side == "longer" else min(w, h)
    if side <= settings.max_side:
        return None
    scale = settings.max_side / side
    return max(1, round(w * scale)), max(1, round(h * scale))


def prepare_image(data: bytes, settings: EncodeSettings) -> tuple[bytes, str, int, int]:
    """Decode fully and check; return (bytes, extension, width, height), re-encoded only when needed.

    Raises `BadImage` with reason empty, undecodable, truncated, decompression_bomb, too_small or unencodable."""
    if not data:
        raise BadImage("empty", "0 bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked below, against our limit
            img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > settings.max_pixels:
            raise BadImage("decompression_bomb", f"{w}x{h} exceeds --max-pixels {settings.max_pixels}")
        fmt = img.format
        sixteen = _sixteen_bit_rawmode(img)
        img.load()  # full decode: truncated and corrupt files fail here, not at training time
        if sixteen is not None:
            img = _exact_16bit(data, img, sixteen)
    except BadImage:
        raise
    except Image.DecompressionBombError as e:
        raise BadImage("decompression_bomb", clean_detail(str(e))) from None
    except Exception as e:  # PIL raises many types for bad input
        text = clean_detail(f"{type(e).__name__}: {e}")
        reason = "truncated" if "truncated" in str(e) or "broken data stream" in str(e) else "undecodable"
        raise BadImage(reason, text) from None
    if min(w, h) < settings.min_side:
        raise BadImage("too_small", f"{w}x{h} < --min-side {settings.min_side}")
    rotated = img.getexif().get(ORIENTATION, 1) != 1
    size = _target_size(w, h, settings)
    if fmt in FORMAT_EXT and img.mode == "RGB" and sixteen is None and not rotated and size is None:
        return data, FORMAT_EXT[fmt], w, h
    try:
        img = _to_rgb(ImageOps.exif_transpose(img) if rotated else img)  # exif_transpose copies even when upright
        size = _target_size(img.width, img.height, settings)  # again: a 90-degree rotation swaps the sides
        if size is not None:
            img = img.resize(size, Image.BICUBIC, reducing_gap=3.0)
        out = io.BytesIO()
        options = {} if settings.format == "png" else {"quality": settings.quality}
        img.save(out, format=PIL_FORMAT[settings.format], **options)
    except (OSError, ValueError) as e:  # e.g. WebP holds at most 16383 pixels a side
        raise BadImage("unencodable", clean_detail(f"{type(e).__name__}: {e}")) from None
    return out.getvalue(), settings.format, img.width, img.height
