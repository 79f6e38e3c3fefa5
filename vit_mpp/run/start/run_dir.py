"""The run directory: owned by one run at a time (a lock), and its resolved config.yaml (metrics.jsonl:
vit_mpp/run/metering/metrics_log.py).

    run_dir/.lock          held by the run's main process for its whole life (who holds it is written inside)
    run_dir/config.yaml    the resolved config; a resumed run may change settings, but not its architecture
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import yaml

from vit_mpp.config.engine import ConfigError, flatten, save_config, to_dict
from vit_mpp.data.manifest import MANIFEST_NAME
from vit_mpp.durable import writing
from vit_mpp.errors import UserError
from vit_mpp.run.durability.checkpoint_files import TRAINER_STATE, latest_checkpoint
from vit_mpp.tools.args import make_out_folder

LOCK_NAME = ".lock"
_held: dict[str, int] = {}  # run dir -> descriptor of its lock, kept open (so held) until this process ends


def _drop_in_child() -> None:
    """A forked child (a data-loader worker) shares the lock's open file; it must not keep the lock alive after the
    run's own process is gone, so it closes its copy (the parent's lock stays)."""
    for fd in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


class RunDirBusy(UserError):
    """Another live run holds the run directory."""


def lock_run_dir(run_dir: Path, flag: str = "train.run_dir") -> None:
    """Hold an exclusive lock on `run_dir` until this process ends, or raise RunDirBusy naming the holder (and
    `flag`, the setting that chooses another).

    The lock is the kernel's (flock on run_dir/.lock): it goes with the process that holds it, however that process
    ends (kill -9 included), so a lock is never left stale by a dead run. On NFSv4 and Lustre (flock mount option)
    flock is a lock between machines too; on a filesystem without locks a warning says the run dir is unprotected.
    """
    key = str(run_dir.resolve())
    if key in _held:
        return
    path = run_dir / LOCK_NAME
    with writing(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(f"{run_dir} is in use by another run ({_describe(holder)}): wait for it to end, or use "
                         f"another {flag}") from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        print(f"warning: {run_dir} is on a filesystem without file locks ({e.strerror}): nothing stops a second run "
              "from using it at the same time", file=sys.stderr, flush=True)
    since = datetime.datetime.now().isoformat(" ", "seconds")
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": since, "command": " ".join(sys.argv)[:300]}
    with writing(path):  # a full disk: one line, before the run writes anything else
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    _held[key] = fd


def _describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on {h['host']} since {h['since']}: {h['command']}"
    except (ValueError, KeyError, TypeError):
        return holder[:200]


def prepare_run_dir(run_dir: str | Path, cfg: Any, is_main: bool, dry_run: bool = False) -> list[str]:
    """Take `run_dir` for this run and write its config.yaml; returns the keys that differ from the previous run's.

    The main process locks the directory first (a second run gets RunDirBusy). When the directory holds a checkpoint
    to resume from, a change to a key the config class lists in `FIXED_ON_RESUME` (the architecture, the target,
    the optimizer) is refused with a ConfigError before anything is written, and so is what `train.resume` and
    `train.extend` do not allow (`check_resume`). A dry run makes the same checks and writes nothing.
    """
    run_dir = Path(run_dir)
    if (run_dir / MANIFEST_NAME).is_file():  # checkpoints, logs and a lock written among someone's shards
        raise ConfigError(f"train.run_dir {run_dir} is a shard folder (it holds {MANIFEST_NAME}): a run writes its "
                          "checkpoints and logs into a folder of its own; use another train.run_dir")
    if dry_run:
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"train.run_dir {run_dir} is a file, not a folder")
        busy = _holder_if_locked(run_dir)
        if busy:
            raise RunDirBusy(f"{run_dir} is in use by another run ({busy}): wait for it to end, or use another "
                             "train.run_dir")
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


def _holder_if_locked(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock, when a live run does; None otherwise (or when this process holds it). Creates
    nothing (for dry runs)."""
    if str(run_dir.resolve()) in _held:
        return None
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _describe(os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown")
    except OSError:
        return None
    finally:
        os.close(fd)


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
