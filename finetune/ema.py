"""Model EMA (`train.ema_decay`): timm's ModelEmaV3, an exponential moving average of the weights, kept on the device
by every process (`build_ema`), saved in every checkpoint and restored exactly. See docs/finetune.md#recipes.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from timm.utils import ModelEmaV3


def build_ema(accelerator: Accelerator, model: torch.nn.Module, decay: float) -> ModelEmaV3 | None:
    """An EMA of `model` (the plain model, before `accelerator.prepare`), registered for checkpointing; None when
    `decay` is 0. Call it before resuming, so that `load_state` restores it."""
    if decay <= 0:
        return None
    ema = ModelEmaV3(model, decay=decay)
    accelerator.register_for_checkpointing(ema)
    return ema
