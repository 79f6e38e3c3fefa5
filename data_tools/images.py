"""Image checks and encoding: fully decode every input; keep the original bytes when they are fine as they are."""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps

FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
ORIENTATION = 0x0112  # EXIF tag


class BadImage(ValueError):
    """An input that cannot become a sample; the message is the reason recorded in the failures file."""


@dataclass(frozen=True)
class EncodeSettings:
    max_side: int = 0  # 0: never resize; otherwise the longer side is brought down to this
    min_side: int = 1  # smaller images are rejected
    quality: int = 90  # JPEG quality when re-encoding
    format: str = "jpg"  # re-encoding format: jpg, png or webp


def prepare_image(data: bytes, settings: EncodeSettings) -> tuple[bytes, str, int, int]:
    """Decode fully and check; return (bytes, extension, width, height), re-encoded only when needed."""
    if not data:
        raise BadImage("empty file")
    try:
        img = Image.open(io.BytesIO(data))
        fmt = img.format
        img.load()  # full decode: truncated files fail here, not at training time
    except Exception as e:  # PIL raises many types for bad input
        raise BadImage(f"undecodable: {type(e).__name__}: {e}") from None
    w, h = img.size
    if min(w, h) < settings.min_side:
        raise BadImage(f"too small: {w}x{h}")
    rotated = img.getexif().get(ORIENTATION, 1) != 1
    needs_resize = settings.max_side and max(w, h) > settings.max_side
    if fmt in FORMAT_EXT and img.mode == "RGB" and not rotated and not needs_resize:
        return data, FORMAT_EXT[fmt], w, h
    img = ImageOps.exif_transpose(img).convert("RGB")
    if needs_resize:
        scale = settings.max_side / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.BICUBIC)
    out = io.BytesIO()
    pil_format = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[settings.format]
    img.save(out, format=pil_format, **({"quality": settings.quality} if settings.format != "png" else {}))
    return out.getvalue(), settings.format, img.width, img.height
