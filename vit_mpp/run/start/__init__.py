"""Starting a run: the entry point's checks before torch (entry.py), the accelerator and the global batch
(accelerator.py), sharding with FSDP (sharding.py), the run directory and its config (run_dir.py), `start_run` and
the `Run` (run.py), and the dry run (dry_run.py)."""
