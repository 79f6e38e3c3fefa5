"""The step bookkeeping both loops share (vit_mpp/run/step_meter.py): averages over the steps actually summed (a resumed
run's first log, and a run whose weights really move: tests/end_to_end/test_pipeline.py), bad samples counted in
both stages."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from finetune.__main__ import main as finetune_main
from tests.helpers.runs import read_metrics
from tests.helpers.shards import write_shard_set
from vit_mpp.config.sections import TrainConfig
from vit_mpp.run.run_dir import MetricsLog
from vit_mpp.run.step_meter import StepMeter, plain_number


def step_output(loss: float, frac: float) -> dict:
    return {"loss": torch.tensor(loss), "metrics": {"frac_mask": torch.tensor(frac)}, "bad_samples": 1}


def test_a_log_averages_over_the_steps_summed_since_the_last_one(tmp_path):
    # Resumed at step 3 with log_every 2: the first log (step 4) covers one step, not two.
    meter = StepMeter(Accelerator(cpu=True), MetricsLog(tmp_path, True), TrainConfig(batch_size=8, log_every=2),
                      start_step=3, total_steps=6)
    meter.add([step_output(2.0, 0.8), step_output(4.0, 0.8)])  # two micro-batches: their mean is the step's
    record = meter.log(4, lr=0.1)
    assert record["loss"] == 3.0 and record["frac_mask"] == pytest.approx(0.8) and record["bad_samples"] == 2
    assert meter.log(5, lr=0.1) is None  # not due
    meter.add([step_output(1.0, 0.8)])
    meter.add([step_output(3.0, 0.8)])
    record = meter.log(6, lr=0.1)
    assert record["loss"] == 2.0 and record["frac_mask"] == pytest.approx(0.8) and record["bad_samples_total"] == 4
    assert [r["step"] for r in read_metrics(tmp_path)] == [4, 6]


def test_fine_tuning_counts_and_reports_bad_samples(tmp_path, encoder_export):
    # 24 training images, 4 of them undecodable: one epoch of 3 steps at batch 8 replaces and counts all 4.
    shards = write_shard_set(tmp_path / "bad", {"train": [24], "val": [6]},  # a val split of good images beside it
                             bad={"train": [i for i in range(24) if i % 6 == 1]})
    finetune_main(["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}",
                   f"train.run_dir={tmp_path / 'ft'}", f"init.checkpoint={encoder_export}", "data.num_workers=0",
                   "train.epochs=1", "data.max_bad_fraction=0.5", "data.shuffle_buffer=1", "train.log_every=1"])
    logged = [r for r in read_metrics(tmp_path / "ft") if "loss" in r]
    assert sum(r["bad_samples"] for r in logged) == 4 and logged[-1]["bad_samples_total"] == 4


# Epochs printed as people write them: a long fine-tuning logs `eval epoch 1160`, not `1.16e+03`.
@pytest.mark.parametrize("value, shown", [
    (1160, "1160"), (1160.0, "1160"), (1_000_000 / 1, "1000000"), (30, "30"), (1, "1"),
    (2.5, "2.5"), (1 / 3, "0.33"), (1160.25, "1160.25"), (0.1, "0.1"),
])
def test_an_epoch_count_is_a_plain_number(value, shown):
    assert plain_number(value) == shown
    assert "e+" not in plain_number(value)

