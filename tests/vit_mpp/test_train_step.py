"""One optimizer step over micro-batches (vit_mpp/run/loop.py `optimizer_step`), the same for both stages:
accumulation equals one step on the whole batch, clipping acts once on the summed gradient; every batch of the step
reaches the sample audit's line."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from vit_mpp.run.loop import optimizer_step
from vit_mpp.run.metering.sample_audit import SampleAudit, audit_file


def batch(x: torch.Tensor, start: int) -> dict:
    return {"x": x, "key": [f"k{start + i}" for i in range(len(x))], "set": [0] * len(x), "bad": 0,
            "epoch": [0] * len(x), "bad_keys": []}


def step(micro_batches: list[dict], clip: float) -> tuple[torch.Tensor, list[dict]]:
    """The weights of a linear model after one step over `micro_batches` (SGD, lr 1), and the step's outputs."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(micro_batches))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)

    def forward(b: dict) -> dict:
        return {"loss": model(b["x"]).pow(2).mean(), "metrics": {}}

    outputs = optimizer_step(accelerator, model, optimizer, micro_batches, forward, clip)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return weights, outputs


@pytest.mark.parametrize("clip", [0.0, 0.01])
def test_two_accumulated_micro_batches_make_the_step_of_the_whole_batch(clip):
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10
    whole, _ = step([batch(x, 0)], clip)
    halves, outputs = step([batch(x[:2], 0), batch(x[2:], 2)], clip)
    assert torch.allclose(whole, halves, atol=1e-6), (whole, halves)
    assert len(outputs) == 2 and all("loss" in out for out in outputs)


def test_the_audit_line_of_a_step_holds_every_micro_batch(tmp_path):
    x = torch.zeros(4, 3)
    audit = SampleAudit(tmp_path, rank=0, is_main=True, set_names=["only"], enabled=True)
    audit.write(1, [batch(x[:2], 0), batch(x[2:], 2)])
    audit.flush()
    line = json.loads(audit_file(tmp_path, 0).read_text())
    assert line == {"step": 1, "keys": ["k0", "k1", "k2", "k3"], "epochs": [0, 0, 0, 0]}


def test_clipping_bounds_the_update_of_the_summed_gradient():
    torch.manual_seed(0)
    start = torch.cat([p.detach().flatten() for p in torch.nn.Linear(3, 1).parameters()])
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    clipped, _ = step([batch(x[:2], 0), batch(x[2:], 2)], 0.01)
    free, _ = step([batch(x[:2], 0), batch(x[2:], 2)], 0.0)
    assert (clipped - start).norm().item() == pytest.approx(0.01, rel=1e-4)  # lr 1: the update is the gradient
    assert (free - start).norm().item() > 1.0
