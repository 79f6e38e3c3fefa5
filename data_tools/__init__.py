"""Turning images into webdataset shards with a manifest: `build-shards SOURCE OUT_DIR` (the command line: cli.py;
the build: builder/; a manifest for tars that exist: indexer/). Beside them: OUT, local or remote (store.py), scratch
folders that survive a killed build (scratch.py), how a build stops (stops.py), `build-shards inspect`
(inspect_shards.py) and its decode check (decode_check.py), `build-shards subset` (subset.py), and the demo's images
(demo_images.py). docs/build_shards.md."""
