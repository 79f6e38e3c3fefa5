"""One Accelerator per run, and how its global batch is made: processes x micro-batch x accumulation steps."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

from vit_mpp.config.engine import ConfigError
from vit_mpp.config.fsdp_settings import FsdpSettings, accelerate_fsdp_off
from vit_mpp.config.sections import TrainConfig
from vit_mpp.processes.rank_lifecycle import process_group_kwargs
from vit_mpp.run.metering.tracking import check_trackers


@dataclass(frozen=True)
class GlobalBatch:
    """How the global batch is made: processes x micro-batch x accumulation steps."""

    global_batch: int
    num_processes: int
    micro_batch: int
    accum_steps: int

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = {self.num_processes} process(es) x {self.micro_batch} "
                f"per device x {self.accum_steps} accumulation step(s)")


def split_global_batch(global_batch: int, micro_batch: int | None, num_processes: int) -> GlobalBatch:
    """Derive per-device batch and accumulation steps from the global batch; fail clearly if they do not divide."""
    if global_batch % num_processes:
        raise ConfigError(f"train.batch_size={global_batch} is not divisible by the {num_processes} processes")
    per_process = global_batch // num_processes
    micro = micro_batch or per_process
    if micro <= 0 or per_process % micro:
        raise ConfigError(f"train.micro_batch_size={micro} does not divide the per-process batch {per_process} "
                          f"(train.batch_size={global_batch} / {num_processes} processes)")
    return GlobalBatch(global_batch, num_processes, micro, per_process // micro)


def cpu_processes() -> bool:
    """Whether this run is several CPU processes (`accelerate launch --multi_gpu` on a machine without CUDA).

    Accelerate sets up gloo for them only when told to use the CPU, and the first PartialState fixes the process
    group for the whole run, so every Accelerator of this tool asks this first.
    """
    return not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def make_accelerator(train: TrainConfig) -> tuple[Accelerator, GlobalBatch]:
    """One Accelerator for a training run, with gradient accumulation derived from the global batch size. A run
    launched with FSDP shards itself (`accelerate_fsdp_off`; vit_mpp/run/start/sharding.py)."""
    check_trackers(train.trackers)  # a missing package is an error now, not a warning after which nothing is logged
    cpu = cpu_processes()
    with accelerate_fsdp_off():
        # The first PartialState makes the process group: its timeout bounds how long a rank waits for a dead peer.
        state = PartialState(cpu=cpu, **process_group_kwargs(train.collective_timeout_s))
        batch = split_global_batch(train.batch_size, train.micro_batch_size, state.num_processes)
        project = ProjectConfiguration(project_dir=train.run_dir, logging_dir=str(Path(train.run_dir) / "logs"))
        accelerator = Accelerator(
            cpu=cpu,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=train.collective_timeout_s))],
            mixed_precision=train.mixed_precision,
            gradient_accumulation_steps=batch.accum_steps,
            log_with=train.trackers or None,
            project_config=project,
            step_scheduler_with_optimizer=False,  # the LR is set by hand from the step (see vit_mpp/run/loop.py)
        )
    return accelerator, batch


def make_eval_accelerator(mixed_precision: str, collective_timeout_s: float = 600.0) -> Accelerator:
    """An Accelerator for evaluation without training, for any process count (each holds the whole model, also
    under an FSDP launch config)."""
    with accelerate_fsdp_off():
        PartialState(cpu=cpu_processes(), **process_group_kwargs(collective_timeout_s))
        return Accelerator(cpu=cpu_processes(), mixed_precision=mixed_precision)


def prepare_model(accelerator: Accelerator, model: torch.nn.Module,
                  make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], train: TrainConfig,
                  sharding: FsdpSettings | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (on its device) made ready to train, and its optimizer (`make_optimizer(model)`, built over the
    parameters as they will be trained): with `train.fp8`, the linear layers swapped for FP8 ones
    (vit_mpp/models/fp8.py); with `sharding` (the launch asks for FSDP), sharded over the processes
    (vit_mpp/run/start/sharding.py) and its state kept in checkpoints in the sharded format, else
    `accelerator.prepare`d (data parallel); with `train.compile`, torch.compiled in place.

    In place (nn.Module.compile): `torch.compile(model)` would return a wrapper whose state dict keys start with
    `_orig_mod.`, and the exports would then find no encoder keys.
    """
    if train.fp8:
        from vit_mpp.models.fp8 import to_fp8

        swapped = to_fp8(model, train.fp8_recipe)
        accelerator.print(f"fp8: {len(swapped)} linear layers in FP8 ({train.fp8_recipe} scaling, torchao)"
                          + ("" if train.compile else "; without train.compile=true its casts are slower than bf16"))
    if sharding is not None:
        from vit_mpp.run.durability.sharded_state import keep_in_checkpoints
        from vit_mpp.run.start.sharding import shard

        model = shard(accelerator, model, sharding)
        optimizer = make_optimizer(model)  # over the shards: its state is sharded as they are
        keep_in_checkpoints(accelerator, model, optimizer)
    else:
        model, optimizer = accelerator.prepare(model, make_optimizer(model))
    if train.compile:
        model.compile()
    return model, optimizer
