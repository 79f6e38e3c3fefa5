"""Starting a run: the entry point's checks before torch (entry.py), the accelerator and the global batch
(accelerator.py), the run directory's lock and config (run_dir.py), `start_run` and the `Run` (run.py), and the dry
run (dry_run.py)."""
