"""Readers: where the images come from. Each yields `Item`s (a stable id, a way to get the bytes, a label)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass(frozen=True)
class Item:
    """One input image: `source_id` names it in the metadata and failure report; label -1 means unlabelled."""

    source_id: str
    path: str
    label: int = -1

    def read(self) -> bytes:
        return Path(self.path).read_bytes()


def image_folder(root: str | Path) -> tuple[list[Item], list[str]]:
    """A folder with one sub-folder per class; classes are the sorted sub-folder names (as torchvision and HF do)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"source folder not found: {root}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"{root} has no class sub-folders (expected {root}/<class>/<image>)")
    items = [
        Item(str(f.relative_to(root)), str(f), label)
        for label, name in enumerate(classes)
        for f in sorted((root / name).rglob("*"))
        if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()
    ]
    return items, classes
