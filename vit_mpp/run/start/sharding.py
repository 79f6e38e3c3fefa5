"""A model sharded over the run's processes with FSDP2 (torch's `fully_shard`), when the launch config asks for FSDP
(vit_mpp/config/fsdp_settings.py): each timm `Block` one unit, the root (embeddings, norms, heads) the rest;
parameters, gradients and optimizer state held as DTensor shards, a unit's parameters gathered for its forward and
backward. The same code runs on CPU processes (gloo) and GPUs (NCCL): Accelerate 1.15 shards only on GPUs, so the
project applies `fully_shard` itself. See docs/cluster.md#sharding-fsdp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import convert_outputs_to_fp32
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from vit_mpp.config.engine import ConfigError
from vit_mpp.config.fsdp_settings import FsdpSettings


def shard(accelerator: Accelerator, model: torch.nn.Module, settings: FsdpSettings) -> torch.nn.Module:
    """`model` (on its device) sharded in place over every process, its forward under the run's autocast (what
    `accelerator.prepare` gives a model it wraps). With one process there is nothing to shard over: the model stays
    whole, and its checkpoints are still the sharded format (vit_mpp/run/durability/sharded_state.py), so that a run
    goes on over any number of processes."""
    if settings.activation_checkpointing:
        for module in model.modules():
            if hasattr(module, "set_grad_checkpointing") and hasattr(module, "blocks"):
                module.set_grad_checkpointing(True)  # timm's: the blocks' activations recomputed in the backward
    units = [m for m in model.modules() if type(m).__name__ in settings.units and m is not model]
    if settings.units and not units:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"fsdp_transformer_layer_cls_to_wrap names {', '.join(settings.units)}, and the model has "
                          f"no module of that class (it has {', '.join(present)}); timm's ViT blocks are Block")
    if dist.is_initialized() and dist.get_world_size() > 1:
        policy = MixedPrecisionPolicy()
        if accelerator.mixed_precision == "bf16":  # bf16 gathers and compute, fp32 gradient reduction and master copy
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        with torch.no_grad():  # rank 0's initial weights everywhere, as data parallel does: each rank drew its own
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        for unit in units:
            fully_shard(unit, reshard_after_forward=settings.reshard_after_forward, mp_policy=policy)
        fully_shard(model, mp_policy=policy)  # the root keeps its parameters gathered from forward to backward
        held = sum(p.to_local().numel() for p in model.parameters())
        accelerator.print(f"FSDP over {dist.get_world_size()} processes ({settings.describe()}): rank 0 holds "
                          f"{held / 1e6:.3g}M of the model's {sum(p.numel() for p in model.parameters()) / 1e6:.3g}M "
                          "parameters, with their gradients and optimizer state")
    else:
        accelerator.print("FSDP on one process: the model is whole; its checkpoints are in the sharded format, and "
                          "resume on any number of processes")
    if accelerator.native_amp:
        forward = model.forward

        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with accelerator.autocast():
                return forward(*args, **kwargs)

        model.forward = convert_outputs_to_fp32(autocast_forward)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def whole_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict on the main process, in host memory for a sharded model (gathered unit by unit:
    every process calls this), as Accelerate gives it for any other ({} on the other processes of a sharded one)."""
    if is_sharded(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return accelerator.get_state_dict(model)


@contextlib.contextmanager
def root_gathered(model: torch.nn.Module) -> Iterator[None]:
    """The root's own parameters gathered for the block, for a call that bypasses its forward (the k-NN monitor's
    `encoder.forward_features`); the blocks gather their own. Every process calls it."""
    if not is_sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
