"""Training-state checkpoints, `run_dir/checkpoints/step_NNNNNN/`: saved by every rank and marked complete
(trainer_state.json) only once every file is synced, so a crash at any moment leaves a complete checkpoint or one that
resume ignores; `Checkpointer` decides when to save. See docs/pretrain.md and docs/reliability.md."""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from vit_mpp.config.sections import TrainConfig
from vit_mpp.durable import WriteFailed, fsync, write_atomic, write_failed
from vit_mpp.errors import Preempted, StoppedUnsaved
from vit_mpp.models.pretrained import CheckpointError
from vit_mpp.run.preemption import StopGate, WaitInterrupted
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


def set_aside_name(path: Path) -> Path:
    """A free name for a checkpoint that cannot be read: `step_N.unreadable`, or `.unreadable-2`, `-3`, ... when the
    same step was set aside before (a run damaged at the same step twice)."""
    name, n = path.with_name(path.name + ".unreadable"), 1
    while name.exists():
        n += 1
        name = path.with_name(f"{path.name}.unreadable-{n}")
    return name


def saved_step(run_dir: str | Path) -> int | None:
    """The step of the newest complete checkpoint of a run directory, or None."""
    path = latest_checkpoint(run_dir)
    return int(path.name[5:]) if path is not None else None


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
    """Run `write`; the OSError (or WriteFailed) it met, if any. torch's own writer reports a full disk as a
    RuntimeError (`unexpected pos`, `basic_ios::clear`): it is taken for one."""
    try:
        write()
    except (OSError, WriteFailed) as e:
        return e
    except RuntimeError as e:
        if "unexpected pos" in str(e) or "basic_ios" in str(e) or "No space left" in str(e):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise
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
            ckpt.rename(set_aside_name(ckpt))
        accelerator.wait_for_everyone()
    if candidates:
        raise CheckpointError(f"no checkpoint of {run_dir} can be read (they were set aside as *.unreadable): move "
                              "them away to start the run over, or use another train.run_dir")
    return {}, None


@dataclass
class RunState:
    """What a checkpoint saves, built only when a save is due: the trainer state (every rank builds it: it may reduce
    over ranks), this rank's own state, and what must reach the disk first (the sample audit's buffered lines)."""

    trainer: Callable[[], dict[str, Any]]
    rank: Callable[[], dict[str, Any]] | None = None
    flush: Callable[[], None] = lambda: None


class Checkpointer:
    """Saves a run and stops it when told: every `train.ckpt_every` steps and at the last (`save_if_due`), every
    `train.ckpt_every_minutes`, and when a stop is agreed (`StopGate`) at the start of a step (`next_step`) or of an
    evaluation batch (`evaluation`): the last completed step is then saved, if it is not yet, and the run ends with
    Preempted. `start_step`: where the run resumed (its checkpoint exists unless it is 0)."""

    def __init__(self, accelerator: Accelerator, train: TrainConfig, total_steps: int, gate: StopGate,
                 state: RunState, start_step: int = 0) -> None:
        self.accelerator, self.run_dir, self.every, self.keep_last = (accelerator, train.run_dir, train.ckpt_every,
                                                                     train.keep_last)
        self.total, self.gate, self.state = total_steps, gate, state
        self.start = self.step = start_step  # where this process started, the last completed step
        self.saved: int | None = start_step if start_step else None  # the step whose checkpoint exists

    def next_step(self, batches: Iterator[dict[str, Any]], count: int) -> list[dict[str, Any]]:
        """The next step's `count` micro-batches, once every rank holds its own: a wait cut short by a signal, or a
        signal on any rank, stops the run here, before any rank commits to the step."""
        got = self._take(batches, count)
        self._agree(got is None)
        return got

    def evaluation(self, batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """An evaluation's batches, each passing the same agreement: a stop during an evaluation saves the last
        completed step (the evaluation is not needed for it) and ends the run. Every rank gets as many batches."""
        it = iter(batches)
        while True:
            got = self._take(it, 1)
            self._agree(got is None)
            if not got:
                return
            yield got[0]

    def completed(self, step: int) -> None:
        """`step` is done on every rank: what a stop from now on saves."""
        self.step = step

    def save_if_due(self) -> None:
        """The periodic checkpoint of the last completed step (every `train.ckpt_every` steps, and the last)."""
        if itstime(self.step, self.every, self.total) and self.saved != self.step:
            self._save()

    def _take(self, batches: Iterator[dict[str, Any]], count: int) -> list[dict[str, Any]] | None:
        """Up to `count` batches (fewer at the end of an evaluation), or None when a signal cut the wait short."""
        try:
            with self.gate.signals.interruptible():
                return list(itertools.islice(batches, count))
        except WaitInterrupted:
            return None

    def _agree(self, stuck: bool) -> None:
        stop, time_due = self.gate.agree(stuck)
        saved_now = (stop or time_due) and self.saved != self.step and self.step > 0
        if saved_now:
            self._save()
        if not stop:
            return
        self.accelerator.end_training()
        if self.saved is None:
            signum = self.gate.signals.received or signal.SIGTERM
            raise StoppedUnsaved(signum, signal.Signals(signum).name)
        raise Preempted(self.step, saved_now=self.step > self.start)  # else: the checkpoint resumed from

    def _save(self) -> None:
        self.state.flush()  # the sample audit's buffered lines reach the disk before the checkpoint says they happened
        save_checkpoint(self.accelerator, self.run_dir, self.step,
                        {**self.state.trainer(), "finished": self.step == self.total}, self.keep_last,
                        self.state.rank() if self.state.rank is not None else None)
        self.gate.saved()
        self.saved = self.step
