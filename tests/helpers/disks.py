"""A small disk for the full-disk tests: a tmpfs of a given size, mounted for the test and resized to free space
(`mount` needs root and a kernel that lets the container mount; where it cannot, the test is skipped and the
injected-ENOSPC tests still run)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(folder: Path, size_kib: int) -> Iterator[Path]:
    """`folder`, a tmpfs of `size_kib` KiB for the block; `resize(folder, kib)` gives it more room."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def resize(folder: Path, size_kib: int) -> None:
    """Free space on a `small_disk` by making it larger."""
    subprocess.run(["mount", "-o", f"remount,size={size_kib}k", str(folder)], check=True, capture_output=True)
