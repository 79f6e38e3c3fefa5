"""A preemption signal stops a multi-process run at a step boundary, whatever the checkpoints around it do
(vit_mpp/run/preemption.py StepBoundary, vit_mpp/run/checkpoint.py Checkpointer). The collective is replaced by one that
returns the flags it was given, as an all-reduce over ranks that all saw them would."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vit_mpp.config.sections import TrainConfig
from vit_mpp.errors import Preempted
from vit_mpp.run import checkpoint
from vit_mpp.run.checkpoint import Checkpointer
from vit_mpp.run.preemption import StepBoundary


class _Done:
    def __init__(self, flags: list[float]) -> None:
        self.flags = flags

    def wait(self) -> None:
        pass

    def tolist(self) -> list[float]:
        return list(self.flags)


def boundary(monkeypatch, every: int) -> tuple[StepBoundary, SimpleNamespace]:
    signals = SimpleNamespace(received=None)
    accelerator = SimpleNamespace(num_processes=2, is_main_process=True, device="cpu", end_training=lambda: None)
    b = StepBoundary(accelerator, signals, every_minutes=0)

    def launch(flags: list[float]) -> None:
        done = _Done(flags)
        b._pending = (done, done)

    monkeypatch.setattr(b, "_launch", launch)
    monkeypatch.setattr(b, "_spacing", lambda step_s: float(every))  # the main rank's proposal, fixed
    return b, signals


def run_until_stopped(monkeypatch, ckpt_every: int, check_every: int, signal_at: int, steps: int = 200) -> list[int]:
    """Steps of a run whose rank is signalled after step `signal_at`; returns the steps saved (the last one is where
    it stopped), or fails when the run never stops."""
    b, signals = boundary(monkeypatch, check_every)
    saves: list[int] = []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda acc, run_dir, step, *a: saves.append(step))
    ckpt = Checkpointer(b.accelerator, TrainConfig(run_dir="run", ckpt_every=ckpt_every, keep_last=3), steps, b,
                        flush=lambda: None)
    for step in range(1, steps + 1):
        if step == signal_at + 1:
            signals.received = 15
        try:
            ckpt.after_step(step, lambda: {})
        except Preempted as stop:
            assert stop.step == saves[-1] == step
            return saves
    pytest.fail(f"the signal after step {signal_at} was never acted upon; saves at {saves}")


@pytest.mark.parametrize("ckpt_every, check_every", [(2, 3), (3, 3), (4, 7), (1, 1), (5, 2), (0, 4)])
def test_a_signal_stops_the_run_within_two_checks_even_with_frequent_checkpoints(monkeypatch, ckpt_every, check_every):
    # CI: ranks orphaned by a killed launcher got their SIGTERM and trained on: each periodic checkpoint finished the
    # collective that carried the stop and dropped it, and checkpoints came more often than two checks
    saves = run_until_stopped(monkeypatch, ckpt_every, check_every, signal_at=5)
    assert 5 < saves[-1] <= 5 + 2 * check_every + 1, saves


def test_without_a_signal_the_checkpoints_are_the_periodic_ones(monkeypatch):
    b, _ = boundary(monkeypatch, 3)
    saves: list[int] = []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda acc, run_dir, step, *a: saves.append(step))
    ckpt = Checkpointer(b.accelerator, TrainConfig(run_dir="run", ckpt_every=4, keep_last=3), 20, b, flush=lambda: None)
    for step in range(1, 21):
        ckpt.after_step(step, lambda: {})
    assert saves == [4, 8, 12, 16, 20]
