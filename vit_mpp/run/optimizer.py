"""The optimizer both stages build: AdamW, Adam or SGD over timm's parameter groups."""

from __future__ import annotations

import torch
from timm.optim import param_groups_layer_decay, param_groups_weight_decay

from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import OptimConfig


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, lr: float, layer_decay: float | None = None,
                    ) -> torch.optim.Optimizer:
    """AdamW/Adam/SGD over timm's parameter groups (no decay on biases, norms, tokens, position embeddings); with
    `layer_decay`, each group's `lr_scale` follows timm's layer-wise decay (vit_mpp/run/loop.py `set_lr` applies
    it)."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    if layer_decay is not None:
        groups = param_groups_layer_decay(model, weight_decay=optim.weight_decay, no_weight_decay_list=skip,
                                          layer_decay=layer_decay)
    else:
        groups = param_groups_weight_decay(model, weight_decay=optim.weight_decay, no_weight_decay_list=skip)
    on_cuda = next(model.parameters()).is_cuda
    impl = optim.impl if optim.impl != "auto" else ("fused" if on_cuda else "foreach")
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    if impl == "fused" and not on_cuda:
        raise ConfigError("optim.impl=fused needs a CUDA device; use auto or foreach on CPU")
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=optim.momentum, **kernel)
    cls = torch.optim.AdamW if optim.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=lr, betas=tuple(optim.betas), **kernel)
