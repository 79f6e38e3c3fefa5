"""The run directory: owned by one run at a time (its lock: vit_mpp/processes/run_dir_lock.py), and its resolved
config.yaml (metrics.jsonl: vit_mpp/run/metering/metrics_log.py).

    run_dir/.lock          held by the run's main process for its whole life (who holds it is written inside)
    run_dir/config.yaml    the resolved config; a resumed run may change settings, but not its architecture
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from vit_mpp.config.engine import ConfigError, flatten, save_config, to_dict
from vit_mpp.data.manifest import MANIFEST_NAME
from vit_mpp.processes.run_dir_lock import check_not_locked, lock_run_dir
from vit_mpp.run.durability.checkpoint_files import TRAINER_STATE, latest_checkpoint
from vit_mpp.tools.args import RUN_DIR, folder_role, make_out_folder


def prepare_run_dir(run_dir: str | Path, cfg: Any, is_main: bool, dry_run: bool = False) -> list[str]:
    """Take `run_dir` for this run and write its config.yaml; returns the keys that differ from the previous run's.

    The main process locks the directory first (`lock_run_dir`: a second run gets one line naming the holder). When
    the directory holds a checkpoint to resume from, a change to a key the config class lists in `FIXED_ON_RESUME`
    (the architecture, the target, the optimizer) is refused with a ConfigError before anything is written, and so is
    what `train.resume` and `train.extend` do not allow (`check_resume`). A dry run makes the same checks and writes
    nothing.
    """
    run_dir = Path(run_dir)
    if (run_dir / MANIFEST_NAME).is_file():  # checkpoints, logs and a lock written among someone's shards
        raise ConfigError(f"train.run_dir {run_dir} is a shard folder (it holds {MANIFEST_NAME}): a run writes its "
                          "checkpoints and logs into a folder of its own; use another train.run_dir")
    role = folder_role(run_dir, shards=False)
    if role and role != RUN_DIR:  # among a model's files: its curves.png overwritten
        raise ConfigError(f"train.run_dir {run_dir} is {role}: a run writes its checkpoints and logs into a folder "
                          "of its own; use another train.run_dir")
    if dry_run:
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"train.run_dir {run_dir} is a file, not a folder")
        check_not_locked(run_dir)
    elif is_main:
        make_out_folder(run_dir, "train.run_dir")
        if not os.access(run_dir, os.W_OK):
            raise ConfigError(f"train.run_dir {run_dir} is not writable")
        lock_run_dir(run_dir)
    changed: list[str] = []
    old, new = {}, flatten(to_dict(cfg))
    previous = run_dir / "config.yaml"
    if previous.is_file():
        try:
            old = flatten(yaml.safe_load(previous.read_text()) or {})
        except yaml.YAMLError:
            old = {}  # unreadable: nothing to compare with; it is rewritten below
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    checkpoint = latest_checkpoint(run_dir)
    fixed = [k for k in changed if k in getattr(type(cfg), "FIXED_ON_RESUME", ()) and k in old]
    if fixed and checkpoint is not None:
        listed = ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in fixed)
        raise ConfigError(f"{run_dir} holds a run to resume, and a resumed run cannot change {listed}: use another "
                          "train.run_dir, or the same values")
    check_resume(run_dir, cfg, checkpoint)
    if is_main and not dry_run:
        save_config(cfg, previous)
    return changed


def check_resume(run_dir: Path, cfg: Any, checkpoint: Path | None) -> None:
    """What `train.resume` and `train.extend` allow, decided from the newest checkpoint before anything is written:
    a run dir that holds a run (never) or none (must); a length that ends before the step reached; a finished run
    asked to go on (only with train.extend, since its learning rate then rises again)."""
    tc = cfg.train
    if tc.resume == "never" and checkpoint is not None:
        raise ConfigError(f"train.resume=never, but {run_dir} holds a run ({checkpoint.name}): use another "
                          "train.run_dir, or train.resume=auto to continue it")
    if tc.resume == "must" and checkpoint is None:
        raise ConfigError(f"train.resume=must, but {run_dir} holds no checkpoint to resume")
    if checkpoint is None:
        return
    try:
        state = json.loads((checkpoint / TRAINER_STATE).read_text())
        reached, finished = int(state["step"]), bool(state.get("finished"))
    except (OSError, ValueError, KeyError, TypeError):
        return  # unreadable: resume sets it aside and says so
    total, key = cfg.total_steps(state.get("steps_per_epoch")), type(cfg).LENGTH_KEY
    if total is None:
        return
    if total < reached:
        raise ConfigError(f"{key}={_get(cfg, key)} ends at step {total}, before step {reached}, which the run in "
                          f"{run_dir} has reached: give a larger {key}, or another train.run_dir")
    if finished and total > reached and not tc.extend:
        raise ConfigError(f"{run_dir} holds a finished run (step {reached}); {key}={_get(cfg, key)} would extend "
                          f"it to step {total}, and its learning rate, which had decayed, would rise again: set "
                          "train.extend=true to do so, or use another train.run_dir")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
