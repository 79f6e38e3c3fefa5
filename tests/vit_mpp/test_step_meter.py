"""The loop's step bookkeeping (vit_mpp/run/metering/step_meter.py): averages over the steps actually summed (a resumed
run's first log, and a run whose weights really move: tests/end_to_end/test_pipeline.py), bad samples counted in
both stages; where the time goes (data wait, steps, checkpoints, evaluations, as the loop reports it), the ETA and the
summary on a fake clock; no device synchronisation outside log steps; MFU."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator

from finetune.__main__ import main as finetune_main
from tests.helpers.runs import read_metrics
from tests.helpers.shards import write_shard_set
from vit_mpp.config.sections import TrainConfig
from vit_mpp.run.metering.metrics_log import MetricsLog
from vit_mpp.run.metering.step_meter import Evaluation, StepMeter, Workload, plain_number

BATCH = {"bad": 1, "set": [0, 0]}  # a micro-batch as the meter reads it: one undecodable sample replaced


def step_output(loss: float, frac: float) -> dict:
    return {"loss": torch.tensor(loss), "metrics": {"frac_mask": torch.tensor(frac)}}


def meter_of(tmp_path, train: TrainConfig, total: int, state: dict | None = None, **workload) -> StepMeter:
    return StepMeter(Accelerator(cpu=True), MetricsLog(tmp_path, True), train, total, state or {},
                     Workload(workload.pop("names", ["only"]), **workload))


def add(meter: StepMeter, *outputs: dict, wait: float = 0.0, compute: float = 0.0) -> None:
    meter.step_done(list(outputs), [BATCH] * len(outputs), wait, compute)


def test_a_log_averages_over_the_steps_summed_since_the_last_one(tmp_path):
    # Resumed at step 3 with log_every 2: the first log (step 4) covers one step, not two.
    meter = meter_of(tmp_path, TrainConfig(batch_size=8, log_every=2), 6, {"step": 3})
    add(meter, step_output(2.0, 0.8), step_output(4.0, 0.8))  # two micro-batches: their mean is the step's
    record = meter.log(4, 0.1, 0, {})
    assert record["loss"] == 3.0 and record["frac_mask"] == pytest.approx(0.8) and record["bad_samples"] == 2
    assert meter.log(5, 0.1, 0, {}) is None  # no step since the last log
    add(meter, step_output(1.0, 0.8))
    add(meter, step_output(3.0, 0.8))
    record = meter.log(6, 0.1, 0, {})
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



# Where a run's time goes (vit_mpp/run/metering/step_meter.py), as the loop reports it, on a clock the test turns.
class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def clock(monkeypatch):
    from vit_mpp.run.metering import run_clock, step_meter

    fake = FakeTime()
    monkeypatch.setattr(step_meter, "time", fake)
    monkeypatch.setattr(run_clock, "started", lambda: -4.0)  # the stage's main began 4 s before the meter
    return fake


def timed_step(meter: StepMeter, clock: FakeTime, step: int, wait: float, compute: float, log: bool = True,
               ) -> dict | None:
    """A step of `wait` then `compute` seconds, as the loop reports it, and its log when `log`."""
    clock.advance(wait + compute)
    add(meter, step_output(1.0, 0.5), wait=wait, compute=compute)
    return meter.log(step, 0.1, 2 if step < 4 else 1, {}) if log else None


def test_the_meter_accounts_for_waits_steps_checkpoints_and_evaluations_on_its_clock(tmp_path, clock, capsys):
    meter = meter_of(tmp_path, TrainConfig(batch_size=8, log_every=2), 8)
    timed_step(meter, clock, 1, wait=10.0, compute=1.0, log=False)  # the loader's start: the first step's wait
    record = timed_step(meter, clock, 2, wait=0.5, compute=1.0)
    assert record["data_wait"] == pytest.approx(10.5 / 12.5, abs=1e-4)
    assert record["img_per_s"] == pytest.approx(16 / 12.5)  # over the training time
    # the ETA leaves the first step out: 1.5 s a step for the 6 steps left; no evaluation measured yet
    assert meter.eta(2, 2) == pytest.approx(6 * 1.5) and "eta 0m09s" in capsys.readouterr().out
    timed_step(meter, clock, 3, wait=0.5, compute=1.0, log=False)
    record = timed_step(meter, clock, 4, wait=0.5, compute=1.0)
    assert record["data_wait"] == pytest.approx(1 / 3, abs=1e-4) and record["img_per_s"] == pytest.approx(16 / 3)
    clock.advance(7.0)  # the evaluation after step 4, its exports included (fine-tuning)
    meter.log_eval(4, Evaluation({"val_loss": 1.0, "val_samples": 6}, "step 4", 6), took=7.0)
    clock.advance(3.0)  # a checkpoint is saved
    meter.spent("checkpoint", 3.0)
    timed_step(meter, clock, 5, wait=0.0, compute=1.0, log=False)
    record = timed_step(meter, clock, 6, wait=0.5, compute=1.0)
    assert record["data_wait"] == pytest.approx(0.5 / 5.5, abs=1e-4) and record["img_per_s"] == pytest.approx(16 / 5.5)
    # steps: (21 - 11) s over 5 steps, 2 s each for 2 steps; one evaluation (at step 8) of 7 s measured
    assert meter.eta(6, 1) == pytest.approx(2 * 2.0 + 7.0)
    assert meter.laps.wait == 12.0 and meter.laps.checkpoint == 3.0 and meter.laps.compute == 6.0
    assert meter.laps.evaluation == 7.0 and meter.laps.evaluations == 1
    records = read_metrics(tmp_path)
    assert [r["eval_s"] for r in records if "val_loss" in r] == [7.0]
    assert records[-1]["train_s"] == 21.0 and records[-1]["run_s"] == 4.0 + clock.now
    for step in (7, 8):
        timed_step(meter, clock, step, wait=0.5, compute=1.0, log=step == 8)
    clock.advance(6.0)
    meter.log_eval(8, Evaluation({"val_loss": 0.9, "val_samples": 6}, "step 8", 6), took=6.0)
    clock.advance(2.0)  # the export
    summary = meter.report_run([tmp_path / "export"])
    assert summary["total_s"] == 4.0 + clock.now and summary["train_s"] == 24.0 and summary["eval_s"] == 13.0
    assert summary["other_s"] == pytest.approx(4.0 + clock.now - 37.0)  # start-up and export
    assert summary["img_per_s"] == pytest.approx(64 / 24, abs=0.05)
    assert summary["data_wait"] == pytest.approx(13 / 24, abs=1e-4)
    assert summary["final"] == {"val_loss": 0.9} and summary["best"] == {"val_loss": 0.9}
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert "run done at step 8" in capsys.readouterr().out


@pytest.mark.parametrize("step, every, total, due", [
    (2, 4, 8, 2), (4, 4, 8, 2), (5, 4, 8, 1), (8, 4, 8, 1), (1, 0, 8, 1), (8, 0, 8, 1), (1, 3, 8, 3), (7, 3, 8, 1),
    (1, None, 8, 0),
])
def test_the_evaluations_left_are_those_the_loop_will_run(step, every, total, due):
    from vit_mpp.run.loop import evaluations_due, itstime

    assert evaluations_due(step, every, total) == due
    if every is not None:
        assert due == sum(itstime(s, every, total) for s in range(step, total + 1))


def test_a_step_that_logs_nothing_asks_nothing_of_the_device(tmp_path, monkeypatch):
    # Reading a device tensor's value waits for the device: only log steps may (one reduction, one .tolist())
    meter = meter_of(tmp_path, TrainConfig(batch_size=4, log_every=3), 6, names=["ours", "theirs"])
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    batch = {"set": [0, 1, 1, 0], "bad": 0}
    out = {"loss": torch.tensor(2.0), "metrics": {"acc": torch.tensor(0.5)}}
    for _ in (1, 2):
        meter.step_done([out], [batch], 0.0, 0.0)
    assert reads == []
    meter.step_done([out], [batch], 0.0, 0.0)
    record = meter.log(3, 0.1, 0, {})
    assert reads and record["mix_theirs"] == 0.5  # a log step reads the numbers, once
    assert meter.realised_shares() == {"ours": 0.5, "theirs": 0.5}
    assert meter.state()["set_samples"] == {"0": 6, "1": 6}  # what a checkpoint keeps, to go on counting


def test_mfu_counts_the_model_the_run_prepared_against_the_peak_given(tmp_path, clock):
    from tests.helpers.models import SMALL_MODEL
    from vit_mpp.models.flops import training_flops
    from vit_mpp.models.vit import create_vit

    model = create_vit(SMALL_MODEL)
    train = TrainConfig(batch_size=8, log_every=1, peak_tflops=1e-5)  # 10 MFLOP/s: the tiny model's MFU is seen
    meter = meter_of(tmp_path, train, 1, flops_per_image=training_flops(model))
    clock.advance(4.0)
    add(meter, step_output(1.0, 0.5), wait=2.0, compute=2.0)
    record = meter.log(1, 0.1, 0, {})
    assert record["mfu"] == pytest.approx(training_flops(model) * 8 / 4.0 / 1e7, rel=1e-2) and record["mfu"] > 0.1
    assert "peak_mem_gib" not in record  # a CPU: no device memory to report
    (tmp_path / "b").mkdir()
    no_peak = meter_of(tmp_path / "b", TrainConfig(batch_size=8, log_every=1), 1, flops_per_image=1e9)
    add(no_peak, step_output(1.0, 0.5), compute=1.0)
    assert "mfu" not in no_peak.log(1, 0.1, 0, {})  # a CPU's peak is not in the table


def test_the_progress_line_shows_the_costs_it_is_given():
    from vit_mpp.run.metering.step_meter import progress_line

    line = progress_line(4, 8, {"loss": 1.0, "lr": 1e-3}, 651.2, 61, {"data_wait": 0.031, "mfu": 0.412,
                                                                       "peak_mem_gib": 12.34})
    assert line == "step 4/8 | loss 1 | lr 1.00e-03 | 651 img/s | data wait 3% | MFU 41% | mem 12.3 GiB | eta 1m01s"
