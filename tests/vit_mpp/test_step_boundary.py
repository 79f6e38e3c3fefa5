"""A stop is agreed at the start of a step or of an evaluation batch, once every rank holds its data, and it saves
the last completed step (vit_mpp/run/checkpoint.py `Checkpointer`, vit_mpp/run/preemption.py `StopGate`): whatever
the periodic checkpoints around it do, during an evaluation, before the first step, and when a rank waits for data
that does not come. One process here: the agreement over ranks is the sum of their flags, tested under a launcher in
tests/end_to_end/."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from vit_mpp.config.sections import TrainConfig
from vit_mpp.errors import Preempted, StoppedUnsaved
from vit_mpp.run import checkpoint
from vit_mpp.run.checkpoint import Checkpointer, RunState
from vit_mpp.run.preemption import StopGate, StopSignals


def checkpointer(monkeypatch, ckpt_every: int, steps: int, start: int = 0, signals=None) -> tuple[Checkpointer, list]:
    """A Checkpointer of one process whose saves are recorded, not written; returns it and the saved steps."""
    signals = signals or SimpleNamespace(received=None, interruptible=StopSignals([]).interruptible)
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, device="cpu", end_training=lambda: None)
    saves: list[int] = []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda acc, run_dir, step, *a: saves.append(step))
    gate = StopGate(accelerator, signals, every_minutes=0)
    cfg = TrainConfig(run_dir="run", ckpt_every=ckpt_every, keep_last=3)
    return Checkpointer(accelerator, cfg, steps, gate, RunState(trainer=dict), start), saves


def train(ckpt: Checkpointer, steps: int, signal_at: int, evaluate_every: int = 0) -> None:
    """A loop as the stages write it; the signal comes during step `signal_at + 1`."""
    batches = iter(range(10**6))
    for step in range(ckpt.step, steps):
        ckpt.next_step(batches, 2)
        if step == signal_at:
            ckpt.gate.signals.received = signal.SIGTERM
        ckpt.completed(step + 1)
        if evaluate_every and (step + 1) % evaluate_every == 0:
            list(ckpt.evaluation(range(5)))
        ckpt.save_if_due()


@pytest.mark.parametrize("ckpt_every", [1, 2, 3, 5, 1000])
def test_a_signal_stops_the_run_at_the_next_step_with_that_step_saved(monkeypatch, ckpt_every):
    # Periodic checkpoints once swallowed the stop (a collective that carried it was finished by every save, and
    # dropped): ranks orphaned by a killed launcher trained on. The stop now never depends on them.
    ckpt, saves = checkpointer(monkeypatch, ckpt_every, 200)
    with pytest.raises(Preempted) as stop:
        train(ckpt, 200, signal_at=5)
    assert stop.value.step == 6 and saves[-1] == 6 and saves.count(6) == 1
    assert "preempted at step 6: checkpoint saved" in str(stop.value)


def test_without_a_signal_the_checkpoints_are_the_periodic_ones(monkeypatch):
    ckpt, saves = checkpointer(monkeypatch, 4, 20)
    train(ckpt, 20, signal_at=-1, evaluate_every=3)
    assert saves == [4, 8, 12, 16, 20]


def test_a_signal_during_an_evaluation_saves_the_step_evaluated_and_stops_before_the_next_batch(monkeypatch):
    # SIGTERM at the start of an evaluation killed the run (its workers died); later, evaluations let a signal wait
    # for dozens of steps: an evaluation's batches now pass the same agreement as the steps.
    ckpt, saves = checkpointer(monkeypatch, 1000, 100)
    for step in range(4):
        ckpt.next_step(iter(range(10)), 1)
        ckpt.completed(step + 1)
    seen = []
    with pytest.raises(Preempted) as stop:
        for batch in ckpt.evaluation(range(10)):
            seen.append(batch)
            if batch == 2:
                ckpt.gate.signals.received = signal.SIGTERM
    assert seen == [0, 1, 2] and stop.value.step == 4 and saves == [4]


def test_a_stop_before_the_first_step_saves_nothing_and_says_so(monkeypatch):
    ckpt, saves = checkpointer(monkeypatch, 1000, 100)
    ckpt.gate.signals.received = signal.SIGUSR1
    with pytest.raises(StoppedUnsaved) as stop:
        ckpt.next_step(iter(range(10)), 1)
    assert saves == [] and stop.value.status == 128 + signal.SIGUSR1
    assert "before the first step: nothing was saved" in str(stop.value)

    resumed, saves = checkpointer(monkeypatch, 1000, 100, start=40)  # its checkpoint of step 40 exists
    resumed.gate.signals.received = signal.SIGTERM
    with pytest.raises(Preempted) as stop:
        resumed.next_step(iter(range(10)), 1)
    assert saves == [] and stop.value.step == 40 and "its checkpoint was saved before" in str(stop.value)


def test_a_step_already_saved_is_not_saved_twice(monkeypatch):
    ckpt, saves = checkpointer(monkeypatch, 5, 100)
    with pytest.raises(Preempted) as stop:
        train(ckpt, 100, signal_at=4)  # the signal comes in step 5, which the periodic checkpoint saves
    assert saves == [5] and stop.value.step == 5


def test_time_based_checkpoints(monkeypatch):
    ckpt, saves = checkpointer(monkeypatch, 1000, 100)
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    ckpt.gate.every_s, ckpt.gate.last_save = 10.0, 0.0
    batches = iter(range(100))
    for step in range(8):
        ckpt.next_step(batches, 1)
        ckpt.completed(step + 1)
        clock[0] += 4.0  # a step takes 4 s: a save is due every third step start
    assert saves == [3, 6]


def slow_batches(seconds: float):
    """A data source that gives one batch, then waits `seconds` for the next (a stalled read)."""
    yield {"step": 1}
    time.sleep(seconds)
    yield {"step": 2}


def test_a_wait_for_data_is_cut_short_by_a_signal_and_the_last_step_saved(monkeypatch):
    # Preempted during a stalled read, a rank waited out the read's deadline (60 s) and the launcher's SIGKILL
    # came first: everything since the last checkpoint was lost.
    with StopSignals(["SIGUSR1"]) as signals:
        ckpt, saves = checkpointer(monkeypatch, 1000, 100, signals=signals)
        signals.in_loop = True
        batches = slow_batches(60)
        ckpt.next_step(batches, 1)
        ckpt.completed(1)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        with pytest.raises(Preempted) as stop:
            ckpt.next_step(batches, 1)
        took = time.monotonic() - start
    assert took < 5 and stop.value.step == 1 and saves == [1]
