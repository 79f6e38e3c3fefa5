"""One optimizer step over this rank's micro-batches, the same in both stages: each stage gives only its forward pass
(pretraining: corruption, encoder, head and loss; fine-tuning: augmentation, classifier and loss)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vit_mpp.data.stream import to_device
from vit_mpp.run.step_meter import micro_batch_output

if TYPE_CHECKING:
    from vit_mpp.run.start import Run


def optimizer_step(run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   micro_batches: list[dict[str, Any]], forward: Callable[[dict[str, Any]], dict[str, Any]],
                   ) -> list[dict[str, Any]]:
    """Each micro-batch to the device, `forward(batch)` (its outputs, with "loss"), backward; gradients are
    synchronised, clipped (`optim.clip_grad_norm` > 0) and applied on the last micro-batch only (Accelerate's
    `accumulate`). Returns what the step meter keeps of each micro-batch; each batch is recorded by the sample
    audit."""
    accelerator, clip = run.accelerator, run.cfg.optim.clip_grad_norm
    outputs = []
    for batch in micro_batches:
        batch = to_device(batch, accelerator.device)
        with accelerator.accumulate(model):
            out = forward(batch)
            accelerator.backward(out["loss"])
            if accelerator.sync_gradients and clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        outputs.append(micro_batch_output(out, batch, run.data.names))
        run.audit.add(batch)
    return outputs
