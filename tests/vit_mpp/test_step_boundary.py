"""A stop is agreed at the start of a step or of an evaluation batch, once every rank holds its data, and it saves
the last completed step (vit_mpp/run/loop.py `Loop`, vit_mpp/processes/stop_agreement.py `StopGate`): whatever the
periodic checkpoints around it do, during an evaluation, before the first step, and when a rank waits for data that
does not come. One process here: the agreement over ranks is the sum of their flags, tested under a launcher in
tests/end_to_end/."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from vit_mpp.errors import Preempted, StoppedUnsaved
from vit_mpp.processes.stop_agreement import StopGate
from vit_mpp.processes.stop_signals import StopSignals
from vit_mpp.run.durability.checkpoint import Checkpointer
from vit_mpp.run.loop import Loop, Objective


class Meter:
    """What the loop tells its meter, minus the telling."""

    def spent(self, what: str, seconds: float) -> None:
        pass

    def state(self) -> dict:
        return {}

    def log(self, *args) -> None:
        pass


def loop(monkeypatch, ckpt_every: int, steps: int, start: int = 0, signals=None) -> tuple[Loop, list]:
    """The loop of one process, its steps' work left out, whose saves are recorded, not written; returns it and the
    saved steps."""
    signals = signals or StopSignals([])
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, device="cpu", end_training=lambda: None)
    saves: list[int] = []
    checkpointer = Checkpointer(accelerator, "run", keep_last=3, start_step=start)
    monkeypatch.setattr(checkpointer, "save", lambda step, *a: (saves.append(step), setattr(checkpointer, "saved",
                                                                                           step)))
    it = Loop.__new__(Loop)
    train = SimpleNamespace(ckpt_every=ckpt_every, log_every=10**9)
    it.run = SimpleNamespace(accelerator=accelerator, signals=signals, cfg=SimpleNamespace(train=train),
                             audit=SimpleNamespace(flush=lambda: None))
    it.gate, it.checkpointer = StopGate(accelerator, signals, 0), checkpointer
    it.meter, it.objective = Meter(), Objective()
    it.schedule, it.generation = SimpleNamespace(total=steps), SimpleNamespace(to_dict=dict)
    it.start = it.done = start
    it.mark = time.perf_counter()
    monkeypatch.setattr("vit_mpp.run.loop.to_dict", lambda cfg: {})
    return it, saves


def step(it: Loop, batches, count: int = 2) -> None:
    """A step as `Loop.step` takes it, with nothing trained: the batches, the agreement, the step done, what is due."""
    got = it.run.signals.take(batches, count)
    it._agree(stuck=got is None)
    it.done += 1
    it._when_due(lr=0.0)


def train(it: Loop, steps: int, signal_at: int, evaluate_every: int = 0) -> None:
    """The loop; the signal comes during step `signal_at + 1`; evaluations of 5 batches every `evaluate_every`."""
    batches = iter(range(10**6))
    for s in range(it.done, steps):
        got = it.run.signals.take(batches, 2)
        it._agree(stuck=got is None)
        if s == signal_at:
            it.gate.signals.received = signal.SIGTERM
        it.done = s + 1
        if evaluate_every and (s + 1) % evaluate_every == 0:
            list(it._gated(range(5)))
        it._when_due(lr=0.0)


@pytest.mark.parametrize("ckpt_every", [1, 2, 3, 5, 1000])
def test_a_signal_stops_the_run_at_the_next_step_with_that_step_saved(monkeypatch, ckpt_every):
    # Periodic checkpoints once swallowed the stop (a collective that carried it was finished by every save, and
    # dropped): ranks orphaned by a killed launcher trained on. The stop now never depends on them.
    it, saves = loop(monkeypatch, ckpt_every, 200)
    with pytest.raises(Preempted) as stop:
        train(it, 200, signal_at=5)
    assert stop.value.step == 6 and saves[-1] == 6 and saves.count(6) == 1
    assert "preempted at step 6: checkpoint saved" in str(stop.value)


def test_without_a_signal_the_checkpoints_are_the_periodic_ones(monkeypatch):
    it, saves = loop(monkeypatch, 4, 20)
    train(it, 20, signal_at=-1, evaluate_every=3)
    assert saves == [4, 8, 12, 16, 20]


def test_a_signal_during_an_evaluation_saves_the_step_evaluated_and_stops_before_the_next_batch(monkeypatch):
    # SIGTERM at the start of an evaluation killed the run (its workers died); later, evaluations let a signal wait
    # for dozens of steps: an evaluation's batches now pass the same agreement as the steps.
    it, saves = loop(monkeypatch, 1000, 100)
    for _ in range(4):
        step(it, iter(range(10)), 1)
    seen = []
    with pytest.raises(Preempted) as stop:
        for batch in it._gated(range(10)):
            seen.append(batch)
            if batch == 2:
                it.gate.signals.received = signal.SIGTERM
    assert seen == [0, 1, 2] and stop.value.step == 4 and saves == [4]


def test_a_stop_before_the_first_step_saves_nothing_and_says_so(monkeypatch):
    it, saves = loop(monkeypatch, 1000, 100)
    it.gate.signals.received = signal.SIGUSR1
    with pytest.raises(StoppedUnsaved) as stop:
        step(it, iter(range(10)), 1)
    assert saves == [] and stop.value.status == 128 + signal.SIGUSR1
    assert "before the first step: nothing was saved" in str(stop.value)

    resumed, saves = loop(monkeypatch, 1000, 100, start=40)  # its checkpoint of step 40 exists
    resumed.gate.signals.received = signal.SIGTERM
    with pytest.raises(Preempted) as stop:
        step(resumed, iter(range(10)), 1)
    assert saves == [] and stop.value.step == 40 and "its checkpoint was saved before" in str(stop.value)


def test_a_step_already_saved_is_not_saved_twice(monkeypatch):
    it, saves = loop(monkeypatch, 5, 100)
    with pytest.raises(Preempted) as stop:
        train(it, 100, signal_at=4)  # the signal comes in step 5, which the periodic checkpoint saves
    assert saves == [5] and stop.value.step == 5


def test_time_based_checkpoints(monkeypatch):
    it, saves = loop(monkeypatch, 1000, 100)
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    it.gate.every_s, it.gate.last_save = 10.0, 0.0
    batches = iter(range(100))
    for _ in range(8):
        step(it, batches, 1)
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
        it, saves = loop(monkeypatch, 1000, 100, signals=signals)
        signals.in_loop = True
        batches = slow_batches(60)
        step(it, batches, 1)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        with pytest.raises(Preempted) as stop:
            step(it, batches, 1)
        took = time.monotonic() - start
    assert took < 5 and stop.value.step == 1 and saves == [1]
