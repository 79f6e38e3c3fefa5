"""Shard sets made on the fly (nothing is downloaded), and the images in them.

`write_shard_set` is the one factory: sample i of a split is keyed `<split>_<i>` (i counted over the split's shards)
and labelled i % 3 unless told otherwise, so tests can check exactly which samples arrive. It can also write
samples without a label, undecodable samples, and a manifest that claims other shard lengths than the shards hold.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from data_tools.builder.writer import ShardWriter
from vit_mpp.data.manifest import write_manifest

UNDECODABLE = b"not an image"


def image_bytes(rng: np.random.Generator, w: int = 24, h: int = 20, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    """An image of random pixels, encoded as `fmt`."""
    arr = rng.integers(0, 256, (h, w, len(mode) if mode != "L" else 1), dtype=np.uint8).squeeze()
    out = io.BytesIO()
    Image.fromarray(arr, mode).save(out, format=fmt)
    return out.getvalue()


def png_bytes(rng: np.random.Generator, size: int = 16) -> bytes:
    """A square RGB PNG of random pixels."""
    return image_bytes(rng, size, size, "PNG")


def write_shard_set(out_dir: Path, lengths: dict[str, list[int]], size: int = 16, seed: int = 0, *,
                    labels: dict[str, list[int | None]] | None = None, bad: dict[str, Iterable[int]] | None = None,
                    claimed: dict[str, list[int]] | None = None, meta: bool = True) -> Path:
    """Shards with the given per-shard sample counts per split, and their manifest (3 classes: a, b, c).

    labels: per split, the label of each sample (None: no .cls at all); by default sample i is labelled i % 3.
    bad: per split, the indices of samples whose image is not an image (undecodable).
    claimed: per split, the shard lengths the manifest states instead of the true ones (a manifest that lies).
    meta: whether each sample also carries a .json holding its index.
    """
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, counts in lengths.items():
        split_labels = (labels or {}).get(split)
        split_bad = set((bad or {}).get(split, ()))
        filenames, index = [], 0
        for s, n in enumerate(counts):
            name = f"{split}-{s:06d}.tar"
            w = ShardWriter(out_dir / name)
            for _ in range(n):
                label = index % 3 if split_labels is None else split_labels[index]
                files = {"png": UNDECODABLE if index in split_bad else png_bytes(rng, size)}
                if label is not None:
                    files["cls"] = str(label).encode()
                if meta:
                    files["json"] = json.dumps({"i": index}).encode()
                w.write(f"{split}_{index:06d}", files)
                index += 1
            w.close()
            filenames.append(name)
        stated = (claimed or {}).get(split, counts)
        splits[split] = {"name": split, "num_samples": sum(stated), "filenames": filenames, "shard_lengths": stated}
    write_manifest(out_dir, {"name": "test", "splits": splits, "num_classes": 3, "class_names": ["a", "b", "c"]})
    return out_dir


def shard_set(root: Path, labels: list[int | None], corrupt: Iterable[int] = (), manifest_count: int | None = None,
              val: int = 0) -> Path:
    """One train shard (sample i labelled labels[i]; None: no .cls; i in `corrupt`: not an image), a manifest that
    says it holds `manifest_count` samples, and optionally a val shard of `val` good images labelled 0."""
    lengths = {"train": [len(labels)], **({"val": [val]} if val else {})}
    claimed = {"train": [manifest_count]} if manifest_count is not None else None
    return write_shard_set(root, lengths, labels={"train": labels, "val": [0] * val}, bad={"train": corrupt},
                           claimed=claimed, meta=False)


def bad_shard_set(root: Path, good: int, bad: int, size: int = 8) -> Path:
    """One train shard of `good` decodable and `bad` undecodable images, interleaved (evenly spread), all labelled 0."""
    n = good + bad
    return write_shard_set(root, {"train": [n]}, size, labels={"train": [0] * n},
                           bad={"train": [i for i in range(n) if i % (n // bad) == 1]}, meta=False)


# Shards other tools wrote (no manifest): what `build-shards index` reads.

def jpeg(rng: np.random.Generator, size: int = 20) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def img2dataset_folder(root: Path, lengths: list[int], seed: int = 0, corrupt: str | None = None) -> Path:
    """Shards as img2dataset writes them (with webdataset's TarWriter: a pax header with a float mtime before every
    member; a fixed one here): `NNNNN.tar` of `KEY.jpg`, `KEY.txt`, `KEY.json` (keys of 9 digits: shard and
    position), no labels, no manifest. `corrupt` names a key whose jpg is cut short (undecodable)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for s, n in enumerate(lengths):
        with wds.TarWriter(str(root / f"{s:05d}.tar"), mtime=1700000000.5) as sink:
            for i in range(n):
                key = f"{s:05d}{i:04d}"
                image = jpeg(rng)
                sink.write({"__key__": key, "jpg": image[:40] if key == corrupt else image,
                            "txt": f"a caption for {key}".encode(),
                            "json": json.dumps({"key": key, "status": "success"}).encode()})
    return root


def timm_style_folder(root: Path, train: list[int], val: list[int], classes: int = 3) -> Path:
    """Labelled shards as timm's `*-wds` datasets hold them: `<name>-train-NNNN.tar` and `<name>-validation-NN.tar`
    of `KEY.jpg` and `KEY.cls`, in one folder."""
    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    index = 0
    for split, lengths, digits in (("train", train, 4), ("validation", val, 2)):
        for s, n in enumerate(lengths):
            with tarfile.open(root / f"toy-{split}-{s:0{digits}d}.tar", "w") as tar:
                for _ in range(n):
                    add(tar, f"{index:08d}.jpg", jpeg(rng, 28))
                    add(tar, f"{index:08d}.cls", str(index % classes).encode())
                    index += 1
    return root


TAR_NAMES = [  # what webdataset tars out there hold, for the tar readers' tests
    "000001.jpg", "000001.txt", "000001.json",  # img2dataset
    "000002.JPG", "000002.Cls",  # upper case suffixes (webdataset lower-cases them)
    "000003.seg.png", "000003.jpg",  # a suffix with a dot
    "a/b.c/000004.jpg", "a/b.c/000004.cls",  # keys in folders whose names hold dots
    "x" * 120 + ".jpg", "x" * 120 + ".json",  # long names (GNU long name, pax path, or a ustar prefix)
    "deep/" * 30 + "k5.webp",  # a long path
    "__meta__", "__key__.txt", "README", ".hidden.jpg", "dir/.x.jpg",  # members webdataset passes over or splits
    "ключ.png", "ключ.json",  # non-ASCII
    "000006.txt",  # a sample without an image
    "000007.jpg",
]


def make_tar(fmt: int, big: int = 0, names: list[str] = TAR_NAMES) -> bytes:
    """A tar of `names` (each with a little data; 000007.jpg `big` bytes more), a folder and a link, in tarfile's
    format `fmt`."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        folder = tarfile.TarInfo("a")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i, name in enumerate(names):
            data = (b"%d" % i) * (1 + i * 37 + (big if name == "000007.jpg" else 0))
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("000007.link")
        link.type, link.linkname = tarfile.SYMTYPE, "000007.jpg"
        tar.addfile(link)
    return out.getvalue()
