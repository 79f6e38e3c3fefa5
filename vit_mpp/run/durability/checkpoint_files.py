"""A run directory's checkpoints as files, without torch (the entry point asks before torch is imported): their
folder, which are complete (`trainer_state.json`, written last, marks one), the newest, the name an unreadable one is
set aside under. Saving and restoring them: checkpoint.py."""

from __future__ import annotations

from pathlib import Path

from vit_mpp.errors import UserError

TRAINER_STATE = "trainer_state.json"  # written last: a checkpoint without it is incomplete and ignored
MODEL_OPTIM = "model_optim"  # the model and optimizer of a run launched with FSDP, sharded (sharded_state.py)


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


def check_sharding(run_dir: str | Path, sharded: bool) -> None:
    """A run launched with FSDP (`sharded`) resumes only sharded checkpoints, and a run without it only whole ones:
    a UserError, before the run directory is touched, when the newest is the other kind."""
    path = latest_checkpoint(run_dir)
    if path is None or (path / MODEL_OPTIM).is_dir() == sharded:
        return
    if sharded:
        raise UserError(f"{path} holds the whole model (the run was launched without FSDP), and this run is launched "
                        "with the FSDP accelerate config: resume it as it was launched, or start a new "
                        "train.run_dir to shard")
    raise UserError(f"{path} is sharded (the run was launched with FSDP): resume it with the FSDP accelerate config "
                    "(accelerate launch --config_file configs/accelerate/fsdp_vit_large.yaml ..., on any number of "
                    "processes)")
