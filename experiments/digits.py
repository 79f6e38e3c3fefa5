"""scikit-learn's 1,797 scanned digits (8x8, 17 grey levels; bundled, nothing is downloaded) as the experiments' data:
their one fixed split (`digits_split`), the plain digits as PNGs and shards (`make_data`, for
experiments/pretrain_vs_scratch.py), each seed's labelled subset, and `build-shards` on a tree or list that has its
own splits (`build_shards`, also for experiments/cluttered_digits.py). docs/results.md."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vit_mpp.errors import UserError

SPLIT_SEED = 0  # the split never moves with an experiment's seed: the held-out writers stay the same


def load_digits() -> Any:
    """scikit-learn's bundled digits (its `Bunch`: images, target)."""
    try:
        from sklearn.datasets import load_digits as load
    except ImportError:
        raise UserError("the digits experiments need scikit-learn (its bundled digits): pip install -e '.[dev]'"
                        ) from None
    return load()


def digits_split(labels: np.ndarray, held_out: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) source indices, sorted: a stratified split of `held_out` of the digits, seed SPLIT_SEED."""
    from sklearn.model_selection import train_test_split

    index = np.arange(len(labels))
    train, test = train_test_split(index, test_size=held_out, stratify=labels, random_state=SPLIT_SEED)
    return np.sort(train), np.sort(test)


def build_shards(source: Path, out: Path, shard_size: int) -> None:
    """`build-shards SOURCE OUT` (run as `python -m data_tools.cli`, without relying on the venv's bin/ on PATH) on a
    tree or list that has its own splits, PNG bytes kept as they are; a failure is one UserError line."""
    run_build_shards([str(source), str(out), "--existing-splits", "--format", "png", "--max-side", "0", "--min-side",
                      "8", "--shard-size", str(shard_size), "--workers", "1", "--overwrite"], f"build-shards {source}")


def run_build_shards(args: list[str], what: str) -> None:
    """`build-shards ARGS` as `python -m data_tools.cli` (the product's command, without relying on the venv's bin/
    on PATH) in a child process; its error line becomes one UserError line, `what: ...`."""
    result = subprocess.run([sys.executable, "-m", "data_tools.cli", *args], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise UserError(f"{what} failed: {last.removeprefix('error: ')}")


def write_digits(root: Path, size: int, val_fraction: float) -> dict[str, list[tuple[str, int]]]:
    """The digits as PNGs in `root/{train,val}/<digit>/<index>.png`; returns split -> [(relative path, label)].

    Grey levels 0..16 map to 0..255; nearest-neighbour upsampling keeps the 8x8 pixels as sharp squares and adds no
    made-up detail (at 16x16 a 4x4 patch is exactly 2x2 original pixels).
    """
    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)  # (1797, 8, 8)
    train_idx, val_idx = digits_split(digits.target, val_fraction)
    items: dict[str, list[tuple[str, int]]] = {}
    for split, idx in (("train", train_idx), ("val", val_idx)):
        items[split] = []
        for i in sorted(idx.tolist()):
            label = int(digits.target[i])
            rel = f"{split}/{label}/{i:04d}.png"
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels[i], mode="L").resize((size, size), Image.NEAREST).save(path)
            items[split].append((rel, label))
    return items


def labelled_subset(items: dict[str, list[tuple[str, int]]], per_class: int, seed: int) -> list[tuple[str, int]]:
    """`per_class` training images of each digit, drawn with `seed` (0: all of them)."""
    if per_class <= 0:
        return list(items["train"])
    rng = np.random.default_rng(seed)
    chosen = []
    for label in sorted({lab for _, lab in items["train"]}):
        paths = [it for it in items["train"] if it[1] == label]
        chosen += [paths[j] for j in sorted(rng.permutation(len(paths))[:per_class].tolist())]
    return chosen


def make_data(out: Path, size: int, val_fraction: float, per_class: int, seeds: list[int],
              ) -> tuple[dict[str, list[tuple[str, int]]], dict[int, Path]]:
    """Images, the all-images shards (for pretraining) and each seed's labelled shards: (items, seed -> shards)."""
    images = out / "images"
    shutil.rmtree(images, ignore_errors=True)
    items = write_digits(images, size, val_fraction)
    build_shards(images, out / "shards" / "all", shard_size=250)
    if per_class <= 0:
        return items, {s: out / "shards" / "all" for s in seeds}
    labelled = {}
    for seed in seeds:
        # A list source (path, label, split) over the same PNGs: only the train split is subsampled.
        listing = images / f"labelled_k{per_class}_s{seed}.csv"
        with listing.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["path", "label", "split"])
            w.writerows([(p, lab, "train") for p, lab in labelled_subset(items, per_class, seed)])
            w.writerows([(p, lab, "val") for p, lab in items["val"]])
        labelled[seed] = out / "shards" / f"labelled_k{per_class}_s{seed}"
        build_shards(listing, labelled[seed], shard_size=250)
    return items, labelled
