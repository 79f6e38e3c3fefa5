"""Choosing the kind of SOURCE and listing it: `open_source`, `detect_kind` and the table of kinds.

Adding a kind of source is adding its module beside this one (a lister, see base.py) and one line to `LISTERS`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse

from data_tools.builder.catalog import CatalogWriter
from data_tools.builder.sources import folders, hf_datasets, hf_stream, list_files, lists
from data_tools.builder.sources.base import (
    REPEATED_ROWS,
    UNLABELLED_ROWS,
    FailureLog,
    Lister,
    Progress,
    Source,
    SourceError,
    SourceSpec,
    apply_repeated_rows,
    apply_unlabelled_rows,
    is_url,
)

# kind -> lister, in the order --source-kind lists them
LISTERS: dict[str, Lister] = {
    "folder": folders.list_class_folders,
    "unlabelled": folders.list_image_tree,
    "list": lists.list_path_list,
    "hf": hf_datasets.list_dataset,
}
STREAMING_LISTERS: dict[str, Lister] = {"hf": hf_stream.list_streamed_dataset}  # the kinds --streaming reads
KINDS = ("auto", *LISTERS)
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def detect_kind(path: str) -> str:
    """`auto`: .csv/.jsonl, a glob pattern, or a folder of list files (list_files.is_list_folder) is a list; a
    datasets folder (parquet files in it or in its data/ folder, or a save_to_disk folder), a parquet file, or a
    missing path shaped like a hub name ("name", "owner/name") is `hf`; any other folder is a class-folder tree; any
    other missing path an error."""
    lowered = (urlparse(path).path if is_url(path) else path).lower()
    if lowered.endswith((".csv", ".jsonl", ".ndjson")) or list_files.is_pattern(path):
        return "list"  # a pattern names list files (lists/*.parquet)
    if lowered.endswith(".parquet") and (is_url(path) or os.path.isfile(path)) and list_files.is_path_list(path):
        return "list"
    p = Path(path)
    if p.is_dir() and list_files.is_list_folder(path):
        return "list"
    if p.is_dir():
        if ((p / "dataset_dict.json").exists() or (p / "state.json").exists() or any(p.glob("*.parquet"))
                or any(p.glob("data/*.parquet"))):  # data/: the Hub's layout
            return "hf"
        return "folder"
    if p.suffix == ".parquet" and p.exists():
        return "hf"
    if not p.exists():
        if HUB_NAME.match(path):  # "name" or "owner/name": a dataset on the Hugging Face hub
            return "hf"
        raise SourceError(f"source not found: {path}")
    raise SourceError(f"cannot tell what kind of source {path} is; pass --source-kind")


def _choose_lister(spec: SourceSpec) -> tuple[str, Lister]:
    """The kind of SOURCE and its lister; a kind, --streaming or --unlabelled-rows that does not fit is an error."""
    kind = spec.kind
    if kind == "auto":
        kind = "hf" if spec.streaming and (os.path.isdir(spec.path) or not os.path.exists(spec.path)) else \
            detect_kind(spec.path)
    if kind not in LISTERS:
        raise SourceError(f"unknown source kind {kind!r} (one of {', '.join(KINDS)})")
    if spec.streaming and kind not in STREAMING_LISTERS:
        raise SourceError(f"--streaming reads Hugging Face datasets; {spec.path} is a {kind} source")
    if spec.unlabelled_rows not in UNLABELLED_ROWS:
        raise SourceError(f"--unlabelled-rows must be one of {', '.join(UNLABELLED_ROWS)}")
    if spec.repeated_rows not in REPEATED_ROWS:
        raise SourceError(f"--repeated-rows must be one of {', '.join(REPEATED_ROWS)}")
    return kind, (STREAMING_LISTERS if spec.streaming else LISTERS)[kind]


def open_source(spec: SourceSpec, workdir: Path, seed: int = 0,
                progress: Progress = lambda rows, done: None) -> Source:
    """List SOURCE as its kind (--source-kind, or `detect_kind`) into a catalog under `workdir` (local scratch
    space). `seed` orders the files of a streaming dataset. The caller closes the returned source."""
    kind, lister = _choose_lister(spec)
    writer = CatalogWriter(workdir, check_repeats=kind == "list")
    failures = FailureLog(Path(workdir) / "listing_failures.jsonl")
    listing = lister(spec, writer, failures, seed, progress)
    catalog = writer.finish(listing.label_map)
    failures.file.flush()
    source = Source(kind, spec.path, catalog, listing.class_names, listing.reader, failures, listing.details,
                    listing.ordered, listing.refs_are_rows)
    apply_repeated_rows(source, spec.repeated_rows)
    apply_unlabelled_rows(source, spec.unlabelled_rows)
    failures.close()
    return source
