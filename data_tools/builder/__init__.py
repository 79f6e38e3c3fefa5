"""`build-shards SOURCE OUT`: list the sources (sources/), plan, write ranges in workers, journal, merge.
docs/build_shards.md."""
