"""One training run, the same in both stages: its start (start.py), accelerator, run directory, checkpoints,
preemption, schedule, optimizer, step meter, sample audit, trackers, curves, dry run and Hub upload."""
