"""Turning images into webdataset shards with a manifest: `build-shards SOURCE OUT_DIR` (the command line:
data_tools/cli.py; the build: data_tools/builder/build_shards.py)."""
