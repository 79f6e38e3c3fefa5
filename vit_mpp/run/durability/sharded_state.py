"""The model and optimizer of a run launched with FSDP, in its checkpoints: `step_N/model_optim/`, written with
torch.distributed.checkpoint (each process its own shard, `__R_0.distcp`, the main one the `.metadata` that maps
them), read back on any number of processes (resharded). Accelerate's `save_state`/`load_state` call these through
their pre-hooks (`keep_in_checkpoints`), so a checkpoint is written, marked complete and restored as any other
(vit_mpp/run/durability/checkpoint.py): the rest (the random states) stays Accelerate's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from vit_mpp.run.durability.checkpoint_files import MODEL_OPTIM


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every process writes its shards of the model and optimizer into `path` (collective)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    with _one_process_quietly():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path,
                 no_dist=not dist.is_initialized())


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Restore the model and optimizer from `path`, whatever number of processes wrote it (collective)."""
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}/.metadata: the checkpoint holds no sharded model state")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with _one_process_quietly():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Without the warning torch.distributed.checkpoint gives every write and read of one process (a run launched
    with FSDP on one process, whose checkpoints another number of processes may resume)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def keep_in_checkpoints(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Have `accelerator.save_state` and `load_state` write and read `model` and `optimizer` (neither of which was
    given to `accelerator.prepare`) in the sharded format."""
    accelerator.register_save_state_pre_hook(
        lambda models, weights, out: save_sharded(model, optimizer, Path(out) / MODEL_OPTIM))
    accelerator.register_load_state_pre_hook(
        lambda models, path: load_sharded(model, optimizer, Path(path) / MODEL_OPTIM))
