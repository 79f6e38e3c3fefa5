"""Run-directory bookkeeping: the metrics log of a resumed run reads as one run."""

import json

from vit_mpp.run.metering.metrics_log import MetricsLog
from vit_mpp.run.metering.step_meter import format_duration, progress_line


def test_rewind_drops_steps_logged_after_the_resumed_checkpoint(tmp_path):
    # A run killed after logging step 10 but before checkpointing it resumes from step 5 and logs 10 again.
    log = MetricsLog(tmp_path, is_main=True)
    for step in (5, 10):
        log.write({"step": step, "loss": 1.0 / step})
    log.rewind(5)
    log.write({"step": 10, "loss": 0.0})
    steps = [json.loads(line)["step"] for line in log.path.read_text().splitlines()]
    assert steps == [5, 10]
    assert json.loads(log.path.read_text().splitlines()[-1])["loss"] == 0.0


def test_rewind_to_zero_clears_a_run_that_never_checkpointed(tmp_path):
    log = MetricsLog(tmp_path, is_main=True)
    log.write({"step": 5})
    log.rewind(0)
    assert log.path.read_text() == ""


def test_rewind_is_a_no_op_off_the_main_process_and_without_a_log(tmp_path):
    MetricsLog(tmp_path, is_main=True).rewind(3)  # no file yet
    main = MetricsLog(tmp_path, is_main=True)
    main.write({"step": 5})
    MetricsLog(tmp_path, is_main=False).rewind(0)
    assert main.path.read_text().count("\n") == 1


def test_progress_line_shows_rate_and_eta():
    line = progress_line(500, 1000, {"loss": 0.7312, "lr": 1.5e-4}, 4830.2, 3725)
    assert line == "step 500/1000 | loss 0.7312 | lr 1.50e-04 | 4830 img/s | eta 1h02m"
    assert format_duration(59) == "0m59s"
