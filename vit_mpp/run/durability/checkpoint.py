"""Training-state checkpoints, `run_dir/checkpoints/step_NNNNNN/`: saved by every rank and marked complete
(trainer_state.json) only once every file is synced, so a crash at any moment leaves a complete checkpoint or one that
resume ignores (`save_checkpoint`, `Checkpointer`); restored newest first, an unreadable one set aside
(`resume_latest`). When to save is the loop's decision (vit_mpp/run/loop.py). See docs/pretrain.md and
docs/reliability.md."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.checkpoint import CheckpointException

from vit_mpp.durable import WriteFailed, fsync, os_error_of, write_atomic, write_failed
from vit_mpp.models.weight_files import CheckpointError
from vit_mpp.run.durability.checkpoint_files import (
    TRAINER_STATE,
    checkpoints_dir,
    complete_checkpoints,
    latest_checkpoint,
    set_aside_name,
)


def rank_state_file(path: Path, rank: int) -> Path:
    return path / f"rank_state_{rank}.pt"


def save_checkpoint(accelerator: Accelerator, run_dir: str | Path, step: int, trainer_state: dict[str, Any],
                    keep_last: int, rank_state: dict[str, Any] | None = None) -> Path:
    """Save the full training state at `step` (all processes call this), then keep only the newest `keep_last`.

    `rank_state` is this process's own state (e.g. its corruption generator), saved beside accelerate's. The
    checkpoint is marked complete (trainer_state.json) only after every process has written its files and they
    are synced to disk, so a crash at any moment leaves either a complete checkpoint or one that resume skips. A
    write that fails on any process (a full disk) fails on every process alike: the half-written folder is removed,
    the previous checkpoints are left as they were, and every rank raises the one-line WriteFailed.
    """
    path = checkpoints_dir(run_dir) / f"step_{step:06d}"
    failure = _attempt(lambda: _write_rank_files(accelerator, path, rank_state))
    _agree_written(accelerator, path, failure, run_dir)
    if accelerator.is_main_process:
        failure = _attempt(lambda: _mark_complete(accelerator, path, step, trainer_state))
    _agree_written(accelerator, path, failure, run_dir)
    if accelerator.is_main_process:
        complete = complete_checkpoints(run_dir)
        for old in complete[: max(0, len(complete) - keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def _write_rank_files(accelerator: Accelerator, path: Path, rank_state: dict[str, Any] | None) -> None:
    accelerator.save_state(str(path))
    if rank_state is not None:
        torch.save(rank_state, rank_state_file(path, accelerator.process_index))


def _mark_complete(accelerator: Accelerator, path: Path, step: int, trainer_state: dict[str, Any]) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            fsync(f)
    write_atomic(path / TRAINER_STATE, json.dumps({"step": step, "num_processes": accelerator.num_processes,
                                                   **trainer_state}, indent=1))


def _attempt(write: Callable[[], None]) -> Exception | None:
    """Run `write`; the error it met writing (a WriteFailed, an OSError, or what another writer raises for a full disk:
    vit_mpp/durable.py `os_error_of`), if any. Anything else is a bug and keeps its traceback."""
    try:
        write()
    except WriteFailed as e:
        return e
    except (Exception, CheckpointException) as e:  # the sharded writer's (a BaseException), on every rank alike
        os_error = os_error_of(e)
        if os_error is None:
            raise
        return os_error
    return None


def _agree_written(accelerator: Accelerator, path: Path, failure: Exception | None, run_dir: str | Path) -> None:
    """Every rank learns whether every rank wrote its part; when one did not, the checkpoint is removed and every
    rank raises WriteFailed, naming it and about what it needs (the size of the newest complete checkpoint)."""
    failed = torch.tensor(float(failure is not None), device=accelerator.device)
    if accelerator.num_processes > 1:
        failed = accelerator.reduce(failed, reduction="sum")
    if failed.item() == 0:
        return
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(path, ignore_errors=True)  # never visible as the newest: it had no marker, and now is gone
    accelerator.wait_for_everyone()
    previous = latest_checkpoint(run_dir)
    needed = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file()) if previous is not None else None
    if isinstance(failure, WriteFailed):
        raise failure
    raise write_failed(path, failure if failure is not None else OSError(0, "another rank could not write its part"),
                       needed)


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
    `step_N.unreadable` (`set_aside_name`), saying so, and the next older one is tried; when none can be read the
    run stops with a CheckpointError rather than silently starting over. `changed` lists the config keys that differ
    from the run directory's previous config (printed as a note). The caller cuts its logs back to the resumed step.
    """
    candidates = complete_checkpoints(run_dir)[::-1]  # newest first
    for ckpt in candidates:
        try:
            state, own = load_checkpoint(accelerator, ckpt)
            problem = ""
        except (Exception, CheckpointException) as e:  # corruption shows up as many types (safetensors, pickle, ...)
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
            ckpt.rename(set_aside_name(ckpt))
        accelerator.wait_for_everyone()
    if candidates:
        raise CheckpointError(f"no checkpoint of {run_dir} can be read (they were set aside as *.unreadable): move "
                              "them away to start the run over, or use another train.run_dir")
    return {}, None


class Checkpointer:
    """Saves a run's checkpoints (`save`) and knows which step's exists (`saved`): the loop decides when
    (vit_mpp/run/loop.py). `start_step`: where the run resumed (its checkpoint exists unless it is 0)."""

    def __init__(self, accelerator: Accelerator, run_dir: str | Path, keep_last: int, start_step: int = 0) -> None:
        self.accelerator, self.run_dir, self.keep_last = accelerator, run_dir, keep_last
        self.saved: int | None = start_step if start_step else None  # the step whose checkpoint exists

    def save(self, step: int, trainer_state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        """The checkpoint of `step` (every process calls it; see `save_checkpoint`)."""
        save_checkpoint(self.accelerator, self.run_dir, step, trainer_state, self.keep_last, rank_state)
        self.saved = step
