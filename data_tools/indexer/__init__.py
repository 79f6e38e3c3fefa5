"""`build-shards index LOCATION`: a manifest for tars that already exist, counted shard by shard.
docs/build_shards.md."""
