"""`build-shards SOURCE OUT` (build_shards.py): list the sources (sources/) into a catalog (catalog.py), shuffle
(shuffle.py) and plan (build_plan.py, shard_layout.py; by plan part: plan_parts.py) against what OUT holds
(out_state.py), write ranges in workers (executors.py, shard_ranges.py, writer.py), publish and journal them
(committer.py, journal.py), merge the manifest (merge.py). docs/build_shards.md."""
