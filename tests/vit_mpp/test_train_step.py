"""One optimizer step over micro-batches (vit_mpp/run/train_step.py), the same for both stages: accumulation equals
one step on the whole batch, clipping acts once on the summed gradient, every batch reaches the audit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from vit_mpp.run.train_step import optimizer_step


class Audit:
    def __init__(self) -> None:
        self.keys: list[str] = []

    def add(self, batch: dict) -> None:
        self.keys += batch["key"]


def batch(x: torch.Tensor, start: int) -> dict:
    return {"x": x, "key": [f"k{start + i}" for i in range(len(x))], "set": [0] * len(x), "bad": 0}


def step(micro_batches: list[dict], clip: float) -> tuple[torch.Tensor, Audit, list[dict]]:
    """The weights of a linear model after one step over `micro_batches` (SGD, lr 1), and what was recorded."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(micro_batches))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    run = SimpleNamespace(accelerator=accelerator, cfg=SimpleNamespace(optim=SimpleNamespace(clip_grad_norm=clip)),
                          data=SimpleNamespace(names=["only"]), audit=Audit())

    def forward(b: dict) -> dict:
        return {"loss": model(b["x"]).pow(2).mean(), "metrics": {}}

    outputs = optimizer_step(run, model, optimizer, micro_batches, forward)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return weights, run.audit, outputs


@pytest.mark.parametrize("clip", [0.0, 0.01])
def test_two_accumulated_micro_batches_make_the_step_of_the_whole_batch(clip):
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10
    whole, _, _ = step([batch(x, 0)], clip)
    halves, audit, outputs = step([batch(x[:2], 0), batch(x[2:], 2)], clip)
    assert torch.allclose(whole, halves, atol=1e-6), (whole, halves)
    assert audit.keys == ["k0", "k1", "k2", "k3"] and len(outputs) == 2
    assert all(out["bad_samples"] == 0 and "loss" in out for out in outputs)


def test_clipping_bounds_the_update_of_the_summed_gradient():
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in torch.nn.Linear(3, 1).parameters()])
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    clipped, _, _ = step([batch(x[:2], 0), batch(x[2:], 2)], 0.01)
    free, _, _ = step([batch(x[:2], 0), batch(x[2:], 2)], 0.0)
    assert (clipped - start).norm().item() == pytest.approx(0.01, rel=1e-4)  # lr 1: the update is the gradient
    assert (free - start).norm().item() > 1.0
