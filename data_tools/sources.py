"""Readers: where the images come from.

`open_source` turns SOURCE into a `Source`: lists of `Item`s per split (a stable id, a reference, a label) and a
picklable `reader` that worker processes use to fetch an item's original bytes. Only references are held in
memory, never image bytes. Kinds:

* `folder`: one sub-folder of images per class (labels are the sorted sub-folder names, as torchvision and HF do);
* `unlabelled`: every image under SOURCE, recursively, label -1;
* `list`: a CSV (header with `path`, optional `label` and `split`) or JSONL file (same keys) of image paths,
  relative to the list's folder;
* `hf`: a Hugging Face `datasets` dataset: a `save_to_disk` folder, parquet file(s), a folder of images read with
  the "imagefolder" builder, or a hub name. Images are read with `Image(decode=False)`: original bytes.
"""

from __future__ import annotations

import bisect
import csv
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import UserError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")  # split names end up in shard names and sample keys
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SPLIT_LIKE = {"train", "val", "valid", "validation", "test"}
KINDS = ("auto", "folder", "unlabelled", "list", "hf")


class SourceError(UserError):
    """SOURCE cannot be read as asked; the message is one line."""


@dataclass(frozen=True, slots=True)
class Item:
    """One input image: `source_id` names it in the metadata and failure report; `ref` is what the reader needs
    (a path, or a row number); label -1 means unlabelled."""

    source_id: str
    ref: str | int
    label: int = -1


class FileReader:
    """Reads items whose `ref` is a file path relative to `base` (items share one string for id and path, which
    halves the memory per input)."""

    def __init__(self, base: str | Path = "") -> None:
        self.base = str(base)

    def read(self, ref: str | int) -> bytes:
        with open(os.path.join(self.base, str(ref)), "rb") as f:
            return f.read()


class HFReader:
    """Reads original image bytes from Hugging Face datasets; `ref` is a row number across all `datasets` in turn.

    The datasets are Arrow tables memory-mapped from disk, so worker processes share them instead of copying."""

    def __init__(self, datasets: list[Any], image_column: str) -> None:
        self.datasets = datasets
        self.image_column = image_column
        self.offsets = [0]
        for ds in datasets:
            self.offsets.append(self.offsets[-1] + len(ds))

    def read(self, ref: str | int) -> bytes:
        i = bisect.bisect_right(self.offsets, int(ref)) - 1
        value = self.datasets[i][int(ref) - self.offsets[i]][self.image_column]
        if isinstance(value, dict):  # the Image feature, undecoded: {"bytes": ..., "path": ...}
            if value.get("bytes") is not None:
                return value["bytes"]
            value = value.get("path")
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            return FileReader().read(value)
        raise OSError(f"row {ref} has no image bytes or path in column '{self.image_column}'")


@dataclass
class Source:
    """What a SOURCE holds: items per split (one unnamed split "" when the source has no splits of its own)."""

    kind: str
    path: str
    splits: dict[str, list[Item]]
    class_names: list[str]
    reader: FileReader | HFReader
    details: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """The manifest's `source` record."""
        return {"kind": self.kind, "path": self.path, "num_inputs": sum(len(v) for v in self.splits.values()),
                **self.details}


def _images_under(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())


def _relative(paths: list[Path], root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in paths]


def _subfolders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _check_split_names(names: list[str], where: str) -> None:
    bad = [n for n in names if not SPLIT_NAME.match(n)]
    if bad:
        raise SourceError(f"split names in {where} must be letters, digits or '_' (got {', '.join(bad)})")


def image_folder(root: str | Path, *, existing_splits: bool = False, labelled: bool = True) -> Source:
    """A class-folder tree (`labelled`) or any tree of images (label -1); with `existing_splits`, each sub-folder
    of `root` is a split holding such a tree, and classes are the union over splits (so labels agree)."""
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"source folder not found: {root}")
    split_dirs = {name: root / name for name in _subfolders(root)} if existing_splits else {"": root}
    if existing_splits:
        if not split_dirs:
            raise SourceError(f"--existing-splits: {root} has no split sub-folders (expected {root}/train, ...)")
        _check_split_names(list(split_dirs), str(root))
    classes: list[str] = []
    if labelled:
        classes = sorted({c for d in split_dirs.values() for c in _subfolders(d)})
        if not classes:
            where = f"{root}/<split>" if existing_splits else str(root)
            raise SourceError(f"{where} has no class sub-folders (expected {where}/<class>/<image>; "
                              "use --source-kind unlabelled for a plain tree of images)")
    splits: dict[str, list[Item]] = {}
    for split, folder in split_dirs.items():
        if labelled:
            splits[split] = [Item(rel, rel, label)
                             for label, name in enumerate(classes) if (folder / name).is_dir()
                             for rel in _relative(_images_under(folder / name), root)]
        else:
            splits[split] = [Item(rel, rel) for rel in _relative(_images_under(folder), root)]
    kind = "folder" if labelled else "unlabelled"
    return Source(kind, str(root), splits, classes, FileReader(root))


def _label_table(values: list[Any], names: list[str] | None = None) -> tuple[list[int], list[str]]:
    """Labels as ints plus class names: ints stay as they are (names '0'..'n-1' unless given); strings become
    indices into their sorted set; None or '' is unlabelled (-1)."""
    present = [v for v in values if v is not None and v != ""]
    if not present:
        return [-1] * len(values), []
    if all(isinstance(v, int) or (isinstance(v, str) and re.fullmatch(r"-?\d+", v)) for v in present):
        ints = [int(v) if v is not None and v != "" else -1 for v in values]
        return ints, names or [str(i) for i in range(max(ints) + 1)]
    classes = sorted({str(v) for v in present})
    index = {c: i for i, c in enumerate(classes)}
    return [index[str(v)] if v is not None and v != "" else -1 for v in values], classes


def path_list(list_file: str | Path, *, existing_splits: bool = False) -> Source:
    """A CSV or JSONL list of image paths (relative to the list's folder) with optional `label` and `split`."""
    list_file = Path(list_file)
    if not list_file.is_file():
        raise SourceError(f"list file not found: {list_file}")
    if list_file.suffix.lower() == ".csv":
        with open(list_file, newline="") as f:
            rows = list(csv.DictReader(f))
    elif list_file.suffix.lower() in (".jsonl", ".ndjson"):
        with open(list_file) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise SourceError(f"list file must end in .csv or .jsonl: {list_file}")
    if not rows:
        raise SourceError(f"{list_file} lists no images")
    if "path" not in rows[0]:
        raise SourceError(f"{list_file} has no 'path' column (has: {', '.join(rows[0])})")
    if existing_splits and any(not r.get("split") for r in rows):
        raise SourceError(f"--existing-splits: every row of {list_file} needs a 'split' value")
    labels, classes = _label_table([r.get("label") for r in rows])
    base = list_file.parent
    splits: dict[str, list[Item]] = {}
    for row, label in zip(rows, labels):
        split = str(row["split"]) if existing_splits else ""
        path = str(row["path"])
        splits.setdefault(split, []).append(Item(path, path, label))
    if existing_splits:
        _check_split_names(list(splits), str(list_file))
    return Source("list", str(list_file), dict(sorted(splits.items())), classes, FileReader(base))


def _load_hf(path: str) -> Any:
    """A Dataset or DatasetDict from a save_to_disk folder, parquet file(s), an image folder, or a hub name."""
    import datasets  # imported here: only this source needs it, and it is slow to import

    p = Path(path)
    try:
        if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
            return datasets.load_from_disk(str(p)), "save_to_disk"
        if p.is_file() and p.suffix == ".parquet":
            return datasets.load_dataset("parquet", data_files=str(p)), "parquet"
        if p.is_dir() and any(p.rglob("*.parquet")):
            return datasets.load_dataset("parquet", data_dir=str(p)), "parquet"
        if p.is_dir():
            return datasets.load_dataset("imagefolder", data_dir=str(p)), "imagefolder"
        if p.exists():
            raise SourceError(f"{p} is neither a dataset folder nor a parquet file")
        return datasets.load_dataset(path), "hub"
    except SourceError:
        raise
    except Exception as e:  # datasets raises many types (ConnectionError offline, FileNotFoundError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise SourceError(f"could not load Hugging Face dataset '{path}': {type(e).__name__}: {first}") from None


def hf_dataset(path: str, *, split: str = "train", existing_splits: bool = False, image_column: str = "",
               label_column: str | None = "label") -> Source:
    """A Hugging Face dataset; `split` may be comma-separated; with `existing_splits` and no `split`, every split
    of the dataset is used. `label_column` None or '' means unlabelled (also when the column does not exist)."""
    import datasets

    loaded, how = _load_hf(path)
    if isinstance(loaded, datasets.DatasetDict):
        wanted = [s for s in split.split(",") if s] if split else list(loaded)
        missing = [s for s in wanted if s not in loaded]
        if missing:
            raise SourceError(f"split {', '.join(missing)} not in {path} (has: {', '.join(loaded)})")
        parts = {s: loaded[s] for s in wanted}
    else:
        parts = {(split or "train").split(",")[0]: loaded}
    if not existing_splits and len(parts) > 1:
        raise SourceError("several --split names need --existing-splits (or pass one split and --val-fraction)")
    if existing_splits:
        _check_split_names(list(parts), path)
    first = next(iter(parts.values()))
    if not image_column:
        image_column = "image" if "image" in first.features else next(
            (k for k, v in first.features.items() if isinstance(v, datasets.Image)), "")
    if image_column not in first.features:
        raise SourceError(f"no image column '{image_column or '?'}' in {path} "
                          f"(columns: {', '.join(first.features)}); pass --image-column")
    use_labels = bool(label_column) and label_column in first.features
    names = None
    if use_labels and isinstance(first.features[label_column], datasets.ClassLabel):
        names = list(first.features[label_column].names)
    tables, splits, all_labels, sizes = [], {}, [], []
    for ds in parts.values():
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # original bytes, no re-encoding
        all_labels += list(ds[label_column]) if use_labels else [None] * len(ds)
        tables.append(ds.select_columns([image_column]))
        sizes.append(len(ds))
    labels, classes = _label_table(all_labels, names)
    row = 0
    for (name, _), n in zip(parts.items(), sizes):
        splits[name if existing_splits else ""] = [Item(f"{name}/{i}", row + i, labels[row + i]) for i in range(n)]
        row += n
    details = {"loader": how, "splits": list(parts), "image_column": image_column,
               "label_column": label_column if use_labels else None}
    return Source("hf", path, splits, classes, HFReader(tables, image_column), details)


def detect_kind(path: str) -> str:
    """`auto`: .csv/.jsonl is a list; a datasets folder, parquet, or a missing path shaped like a hub name
    ("name", "owner/name") is `hf`; any other folder is a class-folder tree; any other missing path an error."""
    p = Path(path)
    if p.suffix.lower() in (".csv", ".jsonl", ".ndjson"):
        return "list"
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists() or any(p.glob("*.parquet")):
            return "hf"
        return "folder"
    if p.suffix == ".parquet" and p.exists():
        return "hf"
    if not p.exists():
        if HUB_NAME.match(path):  # "name" or "owner/name": a dataset on the Hugging Face hub
            return "hf"
        raise SourceError(f"source not found: {path}")
    raise SourceError(f"cannot tell what kind of source {path} is; pass --source-kind")


def open_source(path: str, kind: str = "auto", *, existing_splits: bool = False, split: str = "train",
                image_column: str = "", label_column: str | None = "label") -> Source:
    """Open SOURCE as the given kind (see the module docstring)."""
    if kind == "auto":
        kind = detect_kind(path)
    if kind in ("folder", "unlabelled"):
        source = image_folder(path, existing_splits=existing_splits, labelled=kind == "folder")
        if kind == "folder" and not existing_splits and set(source.class_names) <= SPLIT_LIKE:
            print(f"note: the class folders of {path} look like splits ({', '.join(source.class_names)}); "
                  "pass --existing-splits to use them as splits")
        return source
    if kind == "list":
        return path_list(path, existing_splits=existing_splits)
    if kind == "hf":
        return hf_dataset(path, split=split, existing_splits=existing_splits, image_column=image_column,
                          label_column=label_column)
    raise SourceError(f"unknown source kind {kind!r} (one of {', '.join(KINDS)})")
