"""Source kind `hf`: a Hugging Face `datasets` dataset, loaded: a `save_to_disk` folder, parquet file(s), an image
folder read with the "imagefolder" builder, or a hub name. Images are read with `Image(decode=False)`: the original
bytes. (With `--streaming`: hf_stream.py, which shares this module's choice of splits and columns.)
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data_tools.builder.catalog import CatalogWriter
from data_tools.builder.sources.base import (
    FailureLog,
    LabelTable,
    Listing,
    Progress,
    Reader,
    SourceError,
    SourceSpec,
    check_split_names,
    image_value_bytes,
    labelled_listing,
)
from vit_mpp.data.labels import BadLabel


class HFReader(Reader):
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
        return image_value_bytes(self.datasets[i][int(ref) - self.offsets[i]][self.image_column], ref,
                                 self.image_column)


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """`datasets` logs its own error line before raising (a parquet file it cannot read); the SourceError made of
    the exception says the same in our one line, so its log is held back to CRITICAL meanwhile."""
    import datasets

    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _load_hf(path: str) -> Any:
    """A Dataset or DatasetDict from a save_to_disk folder, parquet file(s), an image folder, or a hub name."""
    import datasets  # imported here: only this source needs it, and it is slow to import

    p = Path(path)
    try:
        with quiet_datasets():
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
        raise SourceError(f"could not load Hugging Face dataset '{path}': {hf_error(e)}") from None


def hf_error(error: Exception) -> str:
    """The first line of an error from `datasets`, with its type."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"


def choose_splits(available: list[str], spec: SourceSpec, path: str) -> list[str]:
    """The dataset splits to read: --split (comma-separated), or every split with --existing-splits, or train."""
    split = spec.split if spec.split is not None else ("" if spec.existing_splits else "train")
    wanted = [s for s in split.split(",") if s] or list(available)
    missing = [s for s in wanted if s not in available]
    if missing:
        raise SourceError(f"split {', '.join(missing)} not in {path} (has: {', '.join(available)})")
    if not spec.existing_splits and len(wanted) > 1:
        raise SourceError("several --split names need --existing-splits (or pass one split and --val-fraction)")
    if spec.existing_splits:
        check_split_names(wanted, path)
    return wanted


def pick_image_column(features: Any, wanted: str, path: str) -> str:
    """--image-column, or 'image', or the first Image column."""
    import datasets

    column = wanted or ("image" if "image" in features else next(
        (k for k, v in features.items() if isinstance(v, datasets.Image)), ""))
    if column not in features:
        raise SourceError(f"no image column '{column or '?'}' in {path} (columns: {', '.join(features)}); "
                          "pass --image-column")
    return column


def list_hf(spec: SourceSpec, writer: CatalogWriter) -> tuple[HFReader, dict, LabelTable]:
    """List a loaded Hugging Face dataset: ids `<split>/<row>`, refs = catalog rows; returns the reader, the
    manifest details and the label table."""
    import datasets

    loaded, how = _load_hf(spec.path)
    if not isinstance(loaded, datasets.DatasetDict):
        loaded = datasets.DatasetDict({(spec.split or "train").split(",")[0]: loaded})
    parts = {s: loaded[s] for s in choose_splits(list(loaded), spec, spec.path)}
    first = next(iter(parts.values()))
    image_column = pick_image_column(first.features, spec.image_column, spec.path)
    label_column = spec.label_column if spec.label_column and spec.label_column in first.features else None
    names = None
    if label_column and isinstance(first.features[label_column], datasets.ClassLabel):
        names = list(first.features[label_column].names)
    labels = LabelTable(names)
    tables = []
    for name, ds in parts.items():
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # original bytes, no re-encoding
        code = writer.split_code(name if spec.existing_splits else "")
        if label_column is None:
            for i in range(len(ds)):
                writer.add(f"{name}/{i}", -1, code)
        else:
            row = 0
            for batch in ds.select_columns([label_column]).iter(batch_size=10_000):
                for value in batch[label_column]:
                    try:
                        label = labels.code(value)
                    except BadLabel as e:
                        raise SourceError(f"{spec.path} split {name} row {row}: {e}") from None
                    writer.add(f"{name}/{row}", label, code)
                    row += 1
        tables.append(ds.select_columns([image_column]))
    details = {"loader": how, "splits": list(parts), "image_column": image_column, "label_column": label_column}
    return HFReader(tables, image_column), details, labels


def list_dataset(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, seed: int,
                 progress: Progress) -> Listing:
    """Kind `hf` (loaded): items are read by their catalog row."""
    reader, details, labels = list_hf(spec, writer)
    return labelled_listing(reader, labels, details=details, refs_are_rows=True)
