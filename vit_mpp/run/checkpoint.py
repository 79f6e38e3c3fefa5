"""Training-state checkpoints, `run_dir/checkpoints/step_NNNNNN/`: saved by every rank and marked complete
(trainer_state.json) only once every file is synced, so a crash at any moment leaves a complete checkpoint or one that
resume ignores; `Checkpointer` decides when to save. See docs/pretrain.md and docs/reliability.md."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from vit_mpp.config.sections import TrainConfig
from vit_mpp.durable import fsync, write_atomic
from vit_mpp.errors import Preempted
from vit_mpp.models.pretrained import CheckpointError
from vit_mpp.run.preemption import StepBoundary
from vit_mpp.run.schedule import itstime

TRAINER_STATE = "trainer_state.json"  # written last: a checkpoint without it is incomplete and ignored


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run directory (those whose marker was written), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / TRAINER_STATE).is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def rank_state_file(path: Path, rank: int) -> Path:
    return path / f"rank_state_{rank}.pt"


def save_checkpoint(accelerator: Accelerator, run_dir: str | Path, step: int, trainer_state: dict[str, Any],
                    keep_last: int, rank_state: dict[str, Any] | None = None) -> Path:
    """Save the full training state at `step` (all processes call this), then keep only the newest `keep_last`.

    `rank_state` is this process's own state (e.g. its corruption generator), saved beside accelerate's. The
    checkpoint is marked complete (trainer_state.json) only after every process has written its files and they
    are synced to disk, so a crash at any moment leaves either a complete checkpoint or one that resume skips.
    """
    path = checkpoints_dir(run_dir) / f"step_{step:06d}"
    accelerator.save_state(str(path))
    if rank_state is not None:
        torch.save(rank_state, rank_state_file(path, accelerator.process_index))
    accelerator.wait_for_everyone()  # every rank's files are written before the checkpoint is marked complete
    if accelerator.is_main_process:
        for f in path.rglob("*"):
            if f.is_file():
                fsync(f)
        write_atomic(path / TRAINER_STATE, json.dumps({"step": step, "num_processes": accelerator.num_processes,
                                                       **trainer_state}, indent=1))
        complete = complete_checkpoints(run_dir)
        for old in complete[: max(0, len(complete) - keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Accelerator, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore the full training state from `path`: (its trainer state, with `step`; this rank's own state)."""
    state = json.loads((path / TRAINER_STATE).read_text())
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{TRAINER_STATE} holds no step")
    accelerator.load_state(str(path))
    own = rank_state_file(path, accelerator.process_index)
    return state, (torch.load(own, weights_only=True) if own.is_file() else None)


def resume_latest(accelerator: Accelerator, run_dir: str | Path, changed: list[str],
                  ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore the newest readable checkpoint of `run_dir`: (its trainer state, this rank's own state), ({}, None)
    for a new run.

    A checkpoint that cannot be read on any process (a truncated file, a disk that filled up) is set aside as
    `step_N.unreadable`, saying so, and the next older one is tried; when none can be read the run stops with a
    CheckpointError rather than silently starting over. `changed` lists the config keys that differ from the run
    directory's previous config (printed as a note). The caller cuts its logs back to the resumed step.
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
    return {}, None


class Checkpointer:
    """Decides, after every optimizer step, whether to save (every `train.ckpt_every` steps, every
    `train.ckpt_every_minutes`, at the last step, or on preemption: one collective, the same decision on every rank),
    saves, and stops a preempted run (raises Preempted once its checkpoint is written)."""

    def __init__(self, accelerator: Accelerator, train: TrainConfig, total_steps: int, boundary: StepBoundary,
                 flush: Callable[[], None]) -> None:
        self.accelerator, self.run_dir, self.every, self.keep_last = (accelerator, train.run_dir, train.ckpt_every,
                                                                     train.keep_last)
        self.total, self.boundary, self.flush = total_steps, boundary, flush

    def after_step(self, step: int, trainer_state: Any, rank_state: Any = None) -> None:
        """`trainer_state()` / `rank_state()` build what is saved, only when a save is due."""
        preempt, time_due = self.boundary.check()
        if itstime(step, self.every, self.total) or time_due or preempt:
            self.flush()  # the sample audit's buffered lines reach the disk before the checkpoint says they happened
            save_checkpoint(self.accelerator, self.run_dir, step, {**trainer_state(), "finished": step == self.total},
                            self.keep_last, rank_state() if rank_state is not None else None)
            preempt = self.boundary.saved() or preempt  # a stop agreed while this save was due: it is the last
        if preempt:
            self.boundary.close()
            self.accelerator.end_training()
            raise Preempted(step)

    def close(self) -> None:
        """The loop has ended: the last step-boundary collective is finished on every rank."""
        self.boundary.close()
