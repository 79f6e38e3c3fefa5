"""The process lifecycle, one wing a reader of the training code may skip: how a command's process ends (exits.py: one
line, its status), a rank's side of its launcher (rank_lifecycle.py) and the launcher a scheduler starts
(job_launcher.py, `vit-mpp-launch`), the preemption signals (stop_signals.py) and the ranks' agreement to stop
(stop_agreement.py), a command's signal handlers swapped in for a block or deferred (signal_handlers.py), what a
rank says when a peer or a loader worker failed (failures.py) on a stderr it never loses (stderr.py), the run
directory's lock (run_dir_lock.py), the loader workers from their fork to their end (loader_workers.py), and what a
forked child does not keep (after_fork.py). The training code reaches it through a few named calls
(docs/architecture.md); docs/cluster.md says what it promises."""
