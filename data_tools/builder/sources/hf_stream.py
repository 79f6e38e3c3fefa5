"""Source kind `hf` with `--streaming`: a Hugging Face dataset read from its parquet files where they are, row group
by row group with pyarrow, without a full download (`list_streamed_dataset`, `ParquetStreamReader`). Remote files
are read through vit_mpp/data/urls.py's seekable opener, with its idle deadline and bounded retries.
See docs/build_shards.md#sources.
"""

from __future__ import annotations

import array
import bisect
import os
import random
from collections.abc import Callable, Iterator
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
    image_value_bytes,
    labelled_listing,
)
from data_tools.builder.sources.hf_datasets import choose_splits, hf_error, pick_image_column, quiet_datasets
from vit_mpp.data import urls
from vit_mpp.data.labels import BadLabel


def resolve_files(path: str) -> tuple[dict[str, list[str]], str]:
    """The parquet data files of each split of a local parquet file or folder, or of a dataset on the Hub."""
    import datasets

    try:
        with quiet_datasets():
            if os.path.isfile(path):
                builder, how = datasets.load_dataset_builder("parquet", data_files=path), "parquet-stream"
            elif os.path.isdir(path):
                builder, how = datasets.load_dataset_builder("parquet", data_dir=path), "parquet-stream"
            else:
                builder, how = datasets.load_dataset_builder(path), "hub-stream"
            data_files = builder.config.data_files or {}
    except Exception as e:  # datasets raises many types (offline, not found, no data files)
        raise SourceError(f"could not resolve the data files of '{path}': {hf_error(e)}") from None
    files = {str(split): [str(f) for f in found] for split, found in data_files.items()}
    other = sorted({os.path.splitext(f)[1] or f for fs in files.values() for f in fs if not f.endswith(".parquet")})
    if not files or other:
        raise SourceError(f"--streaming reads parquet data files; '{path}' has {', '.join(other) or 'none'}: "
                          "drop --streaming to load it instead")
    return files, how


class ArrowReadError(OSError):
    """pyarrow could not parse what was read (a remote stream cut short can leave a footer or a row group
    unparseable): retried like a network error. The pyarrow error is its `__cause__`."""


def _read_parquet(location: str, read: Callable[[Any], Any]) -> Any:
    """`read(pyarrow.parquet.ParquetFile)` of the parquet file at `location`, retried as `urls.read_seekable` does
    when it fails with an OSError or a pyarrow error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def attempt(handle: Any) -> Any:
        try:
            return read(pq.ParquetFile(handle))
        except pa.ArrowException as e:
            raise ArrowReadError(str(e)) from e

    return urls.read_seekable(location, attempt)


def _unwrap(error: BaseException) -> BaseException:
    """pyarrow's own error for an `ArrowReadError`, else the error itself (what messages name)."""
    return error.__cause__ if isinstance(error, ArrowReadError) and error.__cause__ is not None else error


def _error_text(error: BaseException) -> str:
    """An error as `Type: message` on one line."""
    error = _unwrap(error)
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _features(location: str) -> Any:
    import datasets

    return _read_parquet(location, lambda parquet: datasets.Features.from_arrow_schema(parquet.schema_arrow))


class ParquetStreamReader(Reader):
    """Reads image bytes from parquet files; a ref is a row number across `files` in turn (the catalog's order).

    Consecutive refs in the same row group cost one read of that row group's image column. A file or row group
    that cannot be read is retried (remote files) and then reported for each of its rows."""

    def __init__(self, files: list[str], groups: list[list[int]], image_column: str) -> None:
        self.files, self.groups, self.image_column = files, groups, image_column
        self.file_starts = [0]
        for sizes in groups:
            self.file_starts.append(self.file_starts[-1] + sum(sizes))

    def _locate(self, ref: int) -> tuple[int, int, int]:
        """(file, row group, row within the group) of a global row."""
        f = bisect.bisect_right(self.file_starts, ref) - 1
        row, g = ref - self.file_starts[f], 0
        while row >= self.groups[f][g]:
            row -= self.groups[f][g]
            g += 1
        return f, g, row

    def _read_group(self, f: int, g: int) -> list[Any]:
        import pyarrow as pa

        try:
            table = _read_parquet(self.files[f], lambda parquet: parquet.read_row_group(g, columns=[self.image_column]))
        except (OSError, pa.ArrowException) as e:  # after the retries (a local file: at once)
            raise OSError(f"{os.path.basename(self.files[f])} row group {g}: {_error_text(e)}") from None
        return table.column(0).to_pylist()

    def read_many(self, refs: list) -> Iterator[bytes | OSError]:
        loaded: tuple[int, int] | None = None
        values: list[Any] | OSError = []
        for ref in refs:
            f, g, row = self._locate(int(ref))
            if loaded != (f, g):
                loaded = (f, g)
                try:
                    values = self._read_group(f, g)
                except OSError as e:
                    values = e
            if isinstance(values, OSError):
                yield values
                continue
            try:
                yield image_value_bytes(values[row], ref, self.image_column)
            except OSError as e:
                yield e


def _file_rows(location: str, image_column: str, label_column: str | None, labels: LabelTable,
               ) -> tuple[list[int], array.array | None]:
    """(rows of each row group, the label code of each row or None when unlabelled) of one parquet file: its footer
    and its label column only. Read whole, so that a retried read adds nothing twice."""
    name = os.path.basename(location)

    def read(parquet: Any) -> tuple[list[int], array.array | None]:
        sizes = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
        if image_column not in parquet.schema_arrow.names:
            raise SourceError(f"{name} has no column '{image_column}'")
        if label_column is None:
            return sizes, None
        codes = array.array("q")
        for batch in parquet.iter_batches(columns=[label_column], batch_size=65536):
            for value in batch.column(0).to_pylist():
                try:
                    codes.append(labels.code(value))
                except BadLabel as e:
                    raise SourceError(f"{name} row {len(codes)}: {e}") from None
        return sizes, codes

    return _read_parquet(location, read)


def list_parquet_stream(spec: SourceSpec, writer: CatalogWriter, seed: int,
                        progress: Progress) -> tuple[ParquetStreamReader, dict, LabelTable]:
    """List a streamed dataset into `writer` in its final order (files shuffled per split, rows in file order);
    ids are `<split>/<file name>/<row>`. Returns the reader, the manifest details and the label table."""
    import datasets
    import pyarrow as pa

    files_by_split, how = resolve_files(spec.path)
    splits = choose_splits(list(files_by_split), spec, spec.path)
    try:
        features = _features(files_by_split[splits[0]][0])
    except (OSError, pa.ArrowException) as e:
        error = _unwrap(e)
        raise SourceError(f"cannot read the parquet schema of '{spec.path}': {type(error).__name__}: {error}") from None
    image_column = pick_image_column(features, spec.image_column, spec.path)
    label_column = spec.label_column if spec.label_column and spec.label_column in features else None
    names = None
    if label_column and isinstance(features[label_column], datasets.ClassLabel):
        names = list(features[label_column].names)
    labels = LabelTable(names)
    files: list[str] = []
    groups: list[list[int]] = []
    for split in splits:
        order = list(files_by_split[split])
        random.Random(f"{seed}/{split}").shuffle(order)
        code = writer.split_code(split if spec.existing_splits else "")
        for location in order:
            name = os.path.basename(location)
            try:
                sizes, codes = _file_rows(location, image_column, label_column, labels)
            except (OSError, pa.ArrowException) as e:
                raise SourceError(f"cannot read {location}: {_error_text(e)}") from None
            if codes is None:
                for row in range(sum(sizes)):
                    writer.add(f"{split}/{name}/{row}", -1, code)
            else:
                for row, label in enumerate(codes):
                    writer.add(f"{split}/{name}/{row}", label, code)
            files.append(location)
            groups.append(sizes)
            progress(len(writer), 0)
    details = {"loader": how, "splits": splits, "image_column": image_column, "label_column": label_column,
               "files": len(files), "order": "files shuffled with the seed, rows in file order"}
    return ParquetStreamReader(files, groups, image_column), details, labels


def list_streamed_dataset(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, seed: int,
                          progress: Progress) -> Listing:
    """Kind `hf` with --streaming: the catalog is in its final order; items are read by their catalog row."""
    reader, details, labels = list_parquet_stream(spec, writer, seed, progress)
    return labelled_listing(reader, labels, details=details, ordered=True, refs_are_rows=True)
