"""Sources: where the images come from, listed once into a catalog (data_tools/builder/catalog.py) before anything is read.

`open_source` lists SOURCE into a `Source`: the catalog of inputs (an id, a label and a split per input), the class
names, and a picklable `reader` that worker processes (or Ray tasks) use to fetch an input's original bytes. Only
ids are listed, never image bytes, and no Python object is kept per input. Kinds, one module each:

* `folder`: one sub-folder of images per class (labels are the sorted sub-folder names, as torchvision and HF do);
* `unlabelled`: every image under SOURCE, recursively, label -1 (both: folders.py);
* `list`: a CSV, JSONL or Parquet list of image paths (`path`, optional `label` and `split`), relative to the
  list's folder; the list may be a local file or a URL (lists.py);
* `hf`: a Hugging Face `datasets` dataset (hf_datasets.py), or with `streaming` its parquet files read where they
  are, row group by row group (hf_stream.py).

base.py holds what they share (the user's `SourceSpec`, the listed `Source`, the `FailureLog` of inputs met and not
used, labels, readers) and imports no kind; registry.py holds the table of kinds, `detect_kind` and `open_source`.
"""
