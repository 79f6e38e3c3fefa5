"""The one list of image file extensions, used everywhere a file or a shard member is taken for an image.

build-shards reads inputs with these extensions (and writes jpg, png or webp), the data stream decodes a sample's
first member with one of them, predict labels the files with one of them, and `build-shards index` counts the
samples that hold one. PIL decodes all of them.
"""

from __future__ import annotations

from pathlib import PurePath

# In order of preference: a shard sample holding two images is read through the first one listed.
IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
IMAGE_SUFFIXES: frozenset[str] = frozenset(f".{e}" for e in IMAGE_EXTENSIONS)


def is_image_file(path: str | PurePath) -> bool:
    """Whether a file name has one of the image extensions (any case)."""
    return PurePath(path).suffix.lower() in IMAGE_SUFFIXES


def image_member(sample: dict) -> str | None:
    """The extension of a webdataset sample's image member (the first one listed present), or None."""
    return next((e for e in IMAGE_EXTENSIONS if e in sample), None)
