"""Sources: where the images come from, listed once into a catalog (data_tools/builder/catalog.py) before anything
is read. One module per kind: folders.py (`folder`, `unlabelled`), lists.py with list_files.py (`list`),
hf_datasets.py and hf_stream.py (`hf`); base.py holds what they share, registry.py the table of kinds,
`detect_kind` and `open_source`. See docs/build_shards.md#sources.
"""
