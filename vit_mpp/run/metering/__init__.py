"""What a run measures and reports: the step meter (step_meter.py), metrics.jsonl (metrics_log.py), the sample audit
(sample_audit.py), the run's clock (run_clock.py), trackers (tracking.py), curves (curves.py), an evaluation's
progress (eval_progress.py) and the summary (summary.py). docs/pretrain.md#what-a-run-prints."""
