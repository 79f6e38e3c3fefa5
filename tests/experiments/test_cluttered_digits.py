"""experiments/cluttered_digits.py: the harder digits set (split sizes, balance, held-out writers, determinism, not
separable by a class-mean template, shards built, one-line errors). Small sizes, so that it runs in seconds."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("sklearn")  # the dev extra; its bundled digits and photos are the dataset

from experiments import clutter_render as cr  # noqa: E402
from experiments import cluttered_digits as cd  # noqa: E402
from tests.helpers.processes import in_process  # noqa: E402

POOL, TEST, PER_CLASS = 400, 60, 3


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under root."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def labels_of(root: Path) -> Counter:
    return Counter(p.parent.name for p in root.rglob("*.png"))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, str]:
    """One whole command, build-shards included: (OUT, its summary line)."""
    out = tmp_path_factory.mktemp("cluttered") / "set"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cd.main([str(out), "--pool", str(POOL), "--test", str(TEST), "--labels-per-class", str(PER_CLASS)])
    return out, buf.getvalue()


def test_split_sizes_labels_and_balance(made):
    out, line = made
    images = out / "images"
    val = max(1, round(POOL * cd.VAL_FRACTION / 10)) * 10
    assert sum(labels_of(images / "pool" / "train").values()) == POOL - val
    assert labels_of(images / "pool" / "val") == {str(d): val // 10 for d in range(10)}
    assert labels_of(images / "pool") == {str(d): POOL // 10 for d in range(10)}  # balanced
    assert labels_of(images / "labelled" / "train") == {str(d): PER_CLASS for d in range(10)}
    assert tree(images / "labelled" / "val") == tree(images / "pool" / "val")  # a copy of the pool's val
    assert labels_of(images / "test" / "test") == {str(d): TEST // 10 for d in range(10)}
    # The labelled images are pool training images, byte for byte.
    pool = tree(images / "pool" / "train")
    assert all(pool.get(path) == digest for path, digest in tree(images / "labelled" / "train").items())
    for name, splits in (("pool", {"train": POOL - val, "val": val}), ("labelled", {"train": 10 * PER_CLASS,
                         "val": val}), ("test", {"test": TEST})):
        info = json.loads((out / "shards" / name / "_info.json").read_text())
        assert {k: v["num_samples"] for k, v in info["splits"].items()} == splits
        assert info["num_classes"] == 10 and info["class_names"] == [str(d) for d in range(10)]
    assert (out / "samples.png").is_file() and Image.open(out / "samples.png").size[0] > 8 * 32
    assert line.startswith(f"wrote {POOL:,} pool images") and line.count("\n") == 1


def test_images_are_small_rgb_and_test_writers_are_held_out(made):
    out, _ = made
    img = Image.open(next((out / "images" / "test").rglob("*.png")))
    assert img.size == (32, 32) and img.mode == "RGB"
    with (out / "sources.csv").open() as f:
        rows = list(csv.DictReader(f))
    used = {"pool": set(), "test": set()}
    for r in rows:
        used[r["set"]] |= {int(r["source"]), *map(int, r["faint_sources"].split())}
    assert len(rows) == POOL + TEST
    assert used["pool"] and used["test"] and not used["pool"] & used["test"]  # faint strokes included
    sources = cr.load_sources()
    assert used["pool"] <= set(sources.train.tolist()) and used["test"] <= set(sources.test.tolist())
    assert all(int(r["label"]) == sources.labels[int(r["source"])] for r in rows)
    assert all(r["path"].split("/")[2] == r["label"] for r in rows)  # the folder is the label


def test_the_same_seed_writes_the_same_files_and_another_seed_others(tmp_path, monkeypatch):
    # the images only: build-shards is tested above
    monkeypatch.setattr(cd, "build_shards", lambda source, out, shard_size: None)
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cd.generate(cd.Options(tmp_path / name, pool=200, test=20, labels_per_class=2, seed=seed))
        runs[name] = tree(tmp_path / name)
    assert runs["a"] == runs["b"]
    assert len(runs["a"]) == len(runs["c"]) and runs["a"] != runs["c"]
    pool = [k for k in runs["a"] if k.startswith("images/pool/")]
    assert sum(runs["a"][k] != runs["c"].get(k) for k in pool) > 0.9 * len(pool)  # other images, not a few


def nearest_mean_top1(train: np.ndarray, train_y: np.ndarray, test: np.ndarray, test_y: np.ndarray) -> float:
    """Top-1 of a classifier that picks the class whose mean training image is nearest (a template matcher)."""
    train, test = train.reshape(len(train), -1).astype(float), test.reshape(len(test), -1).astype(float)
    means = np.stack([train[train_y == d].mean(0) for d in range(10)])
    return float((((test[:, None] - means[None]) ** 2).sum(-1).argmin(1) == test_y).mean())


def test_a_class_mean_template_works_on_plain_digits_and_fails_here():
    """The plain digits are nearly separable by their class-mean images (~0.9); the cluttered renders of the same
    source digits are not (near chance, 0.1): placement, scale, colour and clutter wash the class means out."""
    sources, clutter = cr.load_sources(), cr.Clutter.named("full")
    p = cd.plan(sources, 1000, 300, 1, seed=0)
    pool, _ = cr.render_all(sources, p.pool, sources.train, (0, 1), 32, clutter)
    test, _ = cr.render_all(sources, p.test, sources.test, (0, 2), 32, clutter)
    from sklearn.datasets import load_digits

    plain = np.kron(load_digits().images, np.ones((4, 4)))  # the same digits, 32x32, nearest upsampling
    y_pool, y_test = sources.labels[p.pool], sources.labels[p.test]
    assert nearest_mean_top1(plain[p.pool], y_pool, plain[p.test], y_test) > 0.8
    assert nearest_mean_top1(pool, y_pool, test, y_test) < 0.3


def test_light_clutter_is_a_gradient_a_digit_and_noise(tmp_path, monkeypatch):
    """--clutter light: no faint strokes, no lines, no photos. In a corner the digit does not cover, an image is its
    gradient (a plane) plus pixel noise of at most 8 grey levels' spread; with full clutter, lines and photo
    texture make most images' corners far from a plane."""
    sources = cr.load_sources()
    idx = sources.train[:400]
    light, others = cr.render_all(sources, idx, sources.train, (0, 1), 32, cr.Clutter.named("light"))
    full, full_others = cr.render_all(sources, idx, sources.train, (0, 1), 32, cr.Clutter.named("full"))
    assert (others == -1).all() and (full_others >= 0).any()

    def off_plane(images: np.ndarray) -> np.ndarray:
        """(4 corners, n): the spread (grey levels) of each 6x6 corner around its best-fitting plane."""
        grey = images.astype(float) @ cr.LUMA
        yy, xx = np.mgrid[0:6, 0:6]
        plane = np.stack([np.ones(36), yy.ravel(), xx.ravel()], 1)
        spreads = []
        for corner in (grey[:, :6, :6], grey[:, :6, -6:], grey[:, -6:, :6], grey[:, -6:, -6:]):
            flat = corner.reshape(len(corner), -1).T
            fit = plane @ np.linalg.lstsq(plane, flat, rcond=None)[0]
            spreads.append((flat - fit).std(0))
        return np.array(spreads)

    light_spread, full_spread = off_plane(light), off_plane(full)
    assert light_spread.min(0).max() < 8  # every light image has a corner that is a plane and noise
    assert np.median(light_spread.max(0)) < 6 < 9 < np.median(full_spread.max(0))
    monkeypatch.setattr(cd, "build_shards", lambda source, out, shard_size: None)
    code = cd.main([str(tmp_path / "light"), "--pool", "200", "--test", "20", "--labels-per-class", "2",
                    "--clutter", "light"])
    assert code is None
    with (tmp_path / "light" / "sources.csv").open() as f:
        assert all(r["faint_sources"] == "" for r in csv.DictReader(f))


@pytest.mark.parametrize("args, says", [
    (["--size", "8"], "--size must be at least 16"),
    (["--pool", "50"], "--pool must be at least 200"),
    (["--labels-per-class", "0"], "--labels-per-class must be in [1,"),
    (["--pool", "200", "--labels-per-class", "50"], "--labels-per-class must be in [1, 19]"),
    (["--seed", "x"], "invalid int value"),
    (["--clutter", "none"], "invalid choice: 'none'"),
])
def test_a_bad_argument_is_one_error_line(tmp_path, capsys, args, says):
    code, out, err = in_process(cd.main, [str(tmp_path / "out"), *args], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_an_existing_set_is_refused_without_overwrite(made, capsys):
    out, _ = made
    code, _, err = in_process(cd.main, [str(out)], capsys)
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1
