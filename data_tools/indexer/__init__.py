"""`build-shards index LOCATION` (index_tars.py): a manifest for tars that already exist (which ones, and where the
manifest goes: find_tars.py), counted shard by shard in workers (count_shard.py, each shard's stream read ahead by
read_ahead.py). docs/build_shards.md."""
