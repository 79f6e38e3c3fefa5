"""One training run, the same in both stages, by concept: the loop and its step (loop.py: `fit`; optimizer.py),
starting a run (start/), what survives a stop (durability/: checkpoints) and what a run measures and
reports (metering/: the step meter, metrics.jsonl, the sample audit, trackers, curves, the summary).
docs/architecture.md."""
