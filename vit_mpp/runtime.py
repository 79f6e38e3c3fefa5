"""Accelerate set-up shared by both stages: global batch -> per-device batch and accumulation, optimizer, LR."""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import ProjectConfiguration
from timm.optim import param_groups_layer_decay, param_groups_weight_decay

from vit_mpp.checkpoint import CheckpointError, complete_checkpoints, load_checkpoint
from vit_mpp.config import ConfigError, OptimConfig, TrainConfig
from vit_mpp.data_stream import to_device
from vit_mpp.run_dir import MetricsLog
from vit_mpp.tracking import check_trackers


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is made: processes x micro-batch x accumulation steps."""

    global_batch: int
    num_processes: int
    micro_batch: int
    accum_steps: int

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = {self.num_processes} process(es) x {self.micro_batch} "
                f"per device x {self.accum_steps} accumulation step(s)")


def plan_batches(global_batch: int, micro_batch: int | None, num_processes: int) -> BatchPlan:
    """Derive per-device batch and accumulation steps from the global batch; fail clearly if they do not divide."""
    if global_batch % num_processes:
        raise ConfigError(f"train.batch_size={global_batch} is not divisible by the {num_processes} processes")
    per_process = global_batch // num_processes
    micro = micro_batch or per_process
    if micro <= 0 or per_process % micro:
        raise ConfigError(f"train.micro_batch_size={micro} does not divide the per-process batch {per_process} "
                          f"(train.batch_size={global_batch} / {num_processes} processes)")
    return BatchPlan(global_batch, num_processes, micro, per_process // micro)


LAUNCHER_POLL_S = 1.0


def stop_with_launcher() -> None:
    """Under a launcher (torchrun, `accelerate launch`), end this rank when its launcher is gone.

    A launcher killed with -9 leaves its ranks running in their own sessions: they would train on, holding the run
    directory, and a re-run would meet a run it cannot see. A thread watches the parent process instead.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        print(f"error: [rank {os.environ.get('RANK', '?')}] the launcher (pid {parent}) is gone; this rank stops",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def make_accelerator(train: TrainConfig) -> tuple[Accelerator, BatchPlan]:
    """One Accelerator for the run, with gradient accumulation derived from the global batch size."""
    stop_with_launcher()
    check_trackers(train.trackers)  # a missing package is an error now, not a warning after which nothing is logged
    # Without CUDA, accelerate only sets up gloo for several processes (`accelerate launch --multi_gpu` on a CPU
    # machine) when told to use the CPU; the first PartialState fixes the process group for the whole run.
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    plan = plan_batches(train.batch_size, train.micro_batch_size, PartialState(cpu=cpu).num_processes)
    project = ProjectConfiguration(project_dir=train.run_dir, logging_dir=str(Path(train.run_dir) / "logs"))
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=plan.accum_steps,
        log_with=train.trackers or None,
        project_config=project,
        step_scheduler_with_optimizer=False,  # the LR is set by hand from the step (see vit_mpp/schedule.py)
    )
    if cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.is_main_process:
        # accelerate silently drops FSDP for CPU processes; say so rather than let a user believe it sharded
        print("warning: FSDP needs CUDA devices; these CPU processes run as plain data parallel (gloo), each "
              "holding the whole model")
    return accelerator, plan


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, lr: float, layer_decay: float | None = None,
                    ) -> torch.optim.Optimizer:
    """AdamW/Adam/SGD over timm's parameter groups (no decay on biases, norms, tokens, position embeddings)."""
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


def optimizer_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   batches, forward, accum_steps: int, clip_grad_norm: float) -> list[dict]:
    """One optimizer step over `accum_steps` micro-batches drawn from `batches`; returns each forward's output.

    `forward(model, batch)` returns a dict with "loss". Gradients sync on the last micro-batch only (accumulate()).
    """
    outputs = []
    for _ in range(accum_steps):
        batch = to_device(next(batches), accelerator.device)
        with accelerator.accumulate(model):
            out = forward(model, batch)
            accelerator.backward(out["loss"])
            if accelerator.sync_gradients and clip_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out["bad_samples"] = batch.get("bad", 0)  # undecodable samples the stream replaced
        outputs.append(out)
    return outputs


def prepare_model(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  compile: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`accelerator.prepare` the model and optimizer, then (with `compile`) torch.compile the model in place.

    In place (nn.Module.compile): `torch.compile(model)` would return a wrapper whose state dict keys start with
    `_orig_mod.`, and the exports would then find no encoder keys.
    """
    model, optimizer = accelerator.prepare(model, optimizer)
    if compile:
        model.compile()
    return model, optimizer


def resume_latest(accelerator: Accelerator, run_dir: str | Path, changed: list[str], log: MetricsLog,
                  ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore the newest readable checkpoint of `run_dir`: (its trainer state, this rank's own state), ({}, None)
    for a new run.

    A checkpoint that cannot be read on any process (a truncated file, a disk that filled up) is set aside as
    `step_N.unreadable`, saying so, and the next older one is tried; when none can be read the run stops with a
    CheckpointError rather than silently starting over. `changed` lists the config keys that differ from the run
    directory's previous config (printed as a note). `log` is cut back to the resumed step.
    """
    candidates = complete_checkpoints(run_dir)[::-1]  # newest first
    for ckpt in candidates:
        try:
            state, own = load_checkpoint(accelerator, ckpt)
            problem = ""
        except Exception as e:  # corruption shows up as many exception types (safetensors, pickle, torch, json)
            state, own, problem = {}, None, " ".join(f"{type(e).__name__}: {e}".split())[:300]
        failed = torch.tensor(float(bool(problem)), device=accelerator.device)
        if accelerator.reduce(failed, reduction="sum").item() == 0:  # every rank read it: the same decision on all
            log.rewind(state["step"])
            accelerator.print(f"resuming from {ckpt} (step {state['step']})")
            if changed:
                accelerator.print(f"note: config differs from the previous run in: {', '.join(changed)}")
            return state, own
        if problem:
            print(f"warning: [rank {accelerator.process_index}] checkpoint {ckpt} cannot be read ({problem}); "
                  "setting it aside and trying the one before", file=sys.stderr, flush=True)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            ckpt.rename(ckpt.with_name(ckpt.name + ".unreadable"))
        accelerator.wait_for_everyone()
    if candidates:
        raise CheckpointError(f"no checkpoint of {run_dir} can be read (they were set aside as *.unreadable): move "
                              "them away to start the run over, or use another train.run_dir")
    log.rewind(0)
    return {}, None
