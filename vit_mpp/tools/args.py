"""Checks of the command-line values the tools share (predict, evaluate, analysis, `build-shards index --out`):
`--device` and the outputs (`--out`, `--csv`), made before any model is loaded or image read, so that a mistake is
one line at the start, not a traceback at the end of the work; and the writing of those outputs, where what no
check can foresee is one line too."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from vit_mpp.config.engine import ConfigError
from vit_mpp.data.manifest import MANIFEST_NAME
from vit_mpp.durable import TMP_SUFFIX, WriteFailed, write_failed
from vit_mpp.errors import StoppedWriting
from vit_mpp.models.export_folder import is_export
from vit_mpp.processes.signal_handlers import handling


def check_device(name: str) -> str:
    """`name` when torch knows it and this machine has it (`cpu`, `cuda`, `cuda:N`, `mps`); a ConfigError otherwise."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {name}: not a device (cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ConfigError(f"--device {name}: this machine has {have} CUDA device(s); use --device cpu"
                          + (f" or cuda:0..cuda:{have - 1}" if have else ""))
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name}: MPS is not available here; use --device cpu")
    return name


def check_writable_place(flag: str, path: Path, folder: Path) -> None:
    """`folder`, where output `path` goes, or the nearest of its parents that exists, must be a writable folder
    (the rest is created when the output is written)."""
    place = folder.absolute()
    while not place.exists():
        place = place.parent
    if not place.is_dir():
        raise ConfigError(f"{flag} {path}: {place} is a file, not a folder")
    if not os.access(place, os.W_OK | os.X_OK):  # also a read-only file system, for root too
        raise ConfigError(f"{flag} {path}: {place} is not writable")


def check_distinct_runs(run_dirs: list[str]) -> None:
    """No run directory named twice (`runs/a` and `runs/a/` are the same run): a table or a figure would show it
    twice, or one curve would hide the other."""
    seen: dict[Path, str] = {}
    for run_dir in run_dirs:
        where = Path(run_dir).resolve()
        if where in seen:
            same = "" if seen[where] == run_dir else f" (as {seen[where]} and {run_dir})"
            raise ConfigError(f"run directory {run_dir} is named twice{same}: name each run once")
        seen[where] = run_dir


def check_out_file(path: str, flag: str = "--out") -> Path:
    """An output file written when the work is done: not a folder, not inside an export or a checkpoint, not one of a
    shard set's files nor of a run directory's records (a typo there replaced a model's config.json or a run's
    metrics.jsonl), and its folder, or the nearest one of its parents that exists, a writable folder."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: give a file name")
    checked = [(out, str(path))]
    if out.is_symlink():  # an output is written through a link (`_target`): its target is held to the same rules
        checked.append((out.resolve(), f"{path} (a link to {out.resolve()})"))
    for target, named in checked:
        role = folder_role(target.absolute().parent, shards=True)
        if role == RUN_DIR and target.name in RUN_RECORDS:
            raise ConfigError(f"{flag} {named} is one of a training run's records: give a file of its own")
        if role == SHARD_SET and (target.name == MANIFEST_NAME or target.suffix in (".tar", ".jsonl")):
            raise ConfigError(f"{flag} {named} is one of a shard set's files: give a file of its own")
        if role and role not in (RUN_DIR, SHARD_SET):  # a new file beside a run's or shards (OUT/_samples.png) is fine
            raise ConfigError(f"{flag} {named} is inside {role}: give a file of its own")
    folder = out.absolute().parent
    check_writable_place(flag, out, folder)
    return out


RUN_RECORDS = ("config.yaml", "metrics.jsonl", "summary.json")  # what a run writes that nothing can make again
RUN_DIR = "a training run's directory (config.yaml, metrics.jsonl)"  # folder_role's answers that allow a new file
SHARD_SET = f"a shard set ({MANIFEST_NAME})"


def folder_role(folder: Path, shards: bool) -> str | None:
    """What an existing folder already is, that a tool's output must not be written into (said as `an export`), or
    None: an export, a training run's directory (its config.yaml beside its metrics.jsonl or checkpoints/: the names
    vit_mpp/run writes, a floor above this one), one of its checkpoints, and with `shards` a shard set."""
    def run_dir(f: Path) -> bool:
        return (f / "config.yaml").is_file() and ((f / "metrics.jsonl").is_file() or (f / "checkpoints").is_dir())

    if not folder.is_dir():
        return None
    if is_export(folder):
        return "an export"
    if shards and (folder / MANIFEST_NAME).exists():
        return SHARD_SET
    if run_dir(folder):
        return RUN_DIR
    return "a checkpoint" if folder.parent.name == "checkpoints" and run_dir(folder.parent.parent) else None


def check_out_folder(out: Path) -> Path:
    """A folder for a tool's results: new (in a writable place), or an existing, writable folder that is neither an
    export, a shard set, a run directory nor a checkpoint (results never go into the model's own folder, among a data
    set's shards, nor over the files a training run wrote, its confusion matrix say)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder for the results")
    if role := folder_role(out, shards=True):
        raise ConfigError(f"--out {out} is {role}: give a folder for the results")
    check_writable_place("--out", out, out)
    return out


def make_out_folder(out: Path, flag: str = "--out") -> Path:
    """Create an output folder (a tool's `--out`, a run directory); what no check foresees (a file in the way, a
    special file system, no space left) is one line too."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{flag} {out} is (or lies under) a file, not a folder") from None
    except OSError as e:  # no permission, a read-only or special file system (/proc), no space
        raise ConfigError(f"{flag} {out} cannot be created: {(e.strerror or str(e)).lower()}") from None
    return out


def _cannot_write(path: str | Path, flag: str, error: OSError) -> WriteFailed:
    return write_failed(f"{flag} {path}" if flag else str(path), error)


def _target(path: str | Path) -> tuple[Path, Path | None]:
    """The file an output replaces (a link's target, not the link) and the temporary name it is written under first;
    None for an existing file that is not a regular one (a pipe, /dev/stdout), which is written straight into."""
    path = Path(path)
    if path.exists():
        if not path.is_file():
            return path, None
        path = path.resolve()
    return path, path.with_name(path.name + TMP_SUFFIX)


class _OutFile:
    """The text stream `open_out_file` gives: each write that fails (a full disk) is the one-line WriteFailed."""

    def __init__(self, f: TextIO, path: Path, flag: str) -> None:
        self._f, self._path, self._flag = f, path, flag

    def write(self, text: str) -> int:
        try:
            return self._f.write(text)
        except OSError as e:
            raise _cannot_write(self._path, self._flag, e) from None


# What `timeout`, a scheduler or a closed terminal sends a tool: by default each ends the process where it stands,
# leaving the output's temporary file behind (a kill -9 still does; nothing can run then).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def stopped_as_exception(path: Path) -> contextlib.AbstractContextManager[None]:
    """In the block, a stop signal (`STOP_SIGNALS`) whose handler is the default one raises `StoppedWriting` (exit
    status 128 + its number, a line saying `path` was not written) instead of ending the process, so the writer's
    clean-up runs. A handler someone set (a training run's preemption) is left alone, as is any thread but the main
    one."""

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        raise StoppedWriting(f"stopped ({name}): {path} was not written; run the same command again", 128 + signum)

    return handling(STOP_SIGNALS, stop, takes=lambda current: current is signal.SIG_DFL)


@contextlib.contextmanager
def open_out_file(path: str | Path, flag: str = "--out") -> Iterator[TextIO]:
    """A (checked) output file to write text into, whole or not at all: written under a temporary name, renamed
    over `path` when the block ends without an error (a failed or killed writer leaves the old file as it was and
    no half-written one that looks whole, nor its temporary file when it was stopped by a signal,
    `stopped_as_exception`); its folder created; a write that fails is one line. A pipe or a device (`/dev/stdout`)
    is written straight into."""
    path, tmp = _target(path)
    with stopped_as_exception(path), _open_out_file(path, tmp, flag) as f:
        yield f


@contextlib.contextmanager
def _open_out_file(path: Path, tmp: Path | None, flag: str) -> Iterator[TextIO]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(tmp or path, "w", newline="")
    except OSError as e:
        raise _cannot_write(path, flag, e) from None
    done = False
    try:
        yield _OutFile(f, path, flag)  # type: ignore[misc]  # a write-only stream: what csv.writer and print use
        try:
            f.close()
            if tmp:
                os.replace(tmp, path)
        except OSError as e:
            raise _cannot_write(path, flag, e) from None
        done = True
    finally:
        if not done:
            with contextlib.suppress(OSError):
                f.close()
            if tmp:
                tmp.unlink(missing_ok=True)


def write_out_bytes(path: str | Path, data: bytes, flag: str = "") -> None:
    """Write an output file whole or not at all (under a temporary name, then renamed over the old one, which a full
    disk then leaves as it was), creating its folder; a write that fails (no space, a special file system) is one
    line, naming `flag` where the user gave the path."""
    path, tmp = _target(path)
    done = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with stopped_as_exception(path):
            (tmp or path).write_bytes(data)
            if tmp:
                os.replace(tmp, path)
        done = True
    except OSError as e:
        raise _cannot_write(path, flag, e) from None
    finally:
        if tmp and not done:
            tmp.unlink(missing_ok=True)


def write_out_text(path: str | Path, text: str, flag: str = "") -> None:
    """`write_out_bytes` for text (UTF-8)."""
    write_out_bytes(path, text.encode("utf-8"), flag)
