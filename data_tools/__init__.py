"""Turning images into webdataset shards with a manifest: `build-shards SOURCE OUT_DIR`."""
