"""What pretraining measures at each evaluation: the MPP loss and target accuracy on the validation split (a fixed
corruption draw, each sample once) and, when the shards carry labels, the k-NN monitor of representation quality
(pretrain/knn.py)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator

from pretrain.knn import knn_monitor
from pretrain.mpp import MaskedPatchPrediction
from pretrain.targets import CLASS_TARGETS
from vit_mpp.data.manifest import Split, load_split
from vit_mpp.data.stream import to_device
from vit_mpp.run.loop import Gate
from vit_mpp.run.metering.eval_progress import with_progress
from vit_mpp.run.start.run import Run
from vit_mpp.run.start.sharding import root_gathered


@torch.no_grad()
def mpp_validation(accelerator: Accelerator, model: MaskedPatchPrediction, loader: Any, seed: int,
                   ) -> dict[str, float]:
    """MPP loss (and accuracy) on the validation split, each sample once, with a fixed corruption draw."""
    model.eval()
    gen = torch.Generator(device=accelerator.device).manual_seed(seed + accelerator.process_index)
    totals = torch.zeros(4, device=accelerator.device)  # loss sum, acc sum, weight, samples
    for batch in loader:
        batch = to_device(batch, accelerator.device)
        with accelerator.autocast():
            out = model(batch["image"], valid=batch["valid"], generator=gen)
        w = out["weight"] if batch["valid"].any() else torch.zeros((), device=accelerator.device)
        acc = out["metrics"].get("acc", torch.zeros((), device=accelerator.device))
        totals += torch.stack([out["loss"].float() * w, acc * w, w, batch["valid"].sum().float()])
    totals = accelerator.reduce(totals, reduction="sum")
    model.train()
    result = {"val_loss": (totals[0] / totals[2].clamp(min=1)).item()}
    if model.cfg.target in CLASS_TARGETS:
        result["val_acc"] = (totals[1] / totals[2].clamp(min=1)).item()
    result["val_samples"] = int(totals[3].item())
    return result


class Validation:
    """`validation(model, gated)`: the MPP validation, plus the k-NN monitor while the shards carry labels (it turns
    itself off, saying so once, when they do not); every batch is taken through `gated` (the loop's stop agreement).
    Every process calls it: its reductions are collective."""

    def __init__(self, run: Run, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        cfg = run.cfg
        self.run, self.mean, self.std = run, mean, std
        self.loader = run.eval_loader(run.data.val_split)
        # The k-NN monitor's labelled references (pretrain/knn.py) come from the set evaluation reads.
        self.knn_split = None
        if cfg.knn.train_images:
            self.knn_split = load_split(run.data.val_location, cfg.knn.train_split or cfg.data.train_split)[0]

    @property
    def knn_references(self) -> tuple[Split, int] | None:
        """The k-NN monitor's labelled references (split, images), while it is on: what the export records."""
        return (self.knn_split, self.run.cfg.knn.train_images) if self.knn_split is not None else None

    def __call__(self, model: torch.nn.Module, gated: Gate) -> dict[str, float]:
        accelerator, split = self.run.accelerator, self.run.data.val_split
        mpp = accelerator.unwrap_model(model)
        with with_progress(accelerator, gated(self.loader), f"validation ({split.name})",
                           split.num_samples) as batches:
            result = mpp_validation(accelerator, mpp, batches, self.run.cfg.train.seed)
        if self.knn_split is not None:
            with root_gathered(mpp):  # the monitor calls the encoder's forward_features, not the model's forward
                knn = knn_monitor(self.run, mpp.encoder, self.knn_split, (self.mean, self.std), gated)
            if knn is None:
                accelerator.print("note: the k-NN monitor is off: the shards carry no labels")
                self.knn_split = None
            else:
                result.update(knn)
        return result
