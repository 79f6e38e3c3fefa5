"""`vit-mpp-launch` (`python -m vit_mpp.processes.job_launcher`): `accelerate launch`, with the same flags, as the
process a scheduler starts. Accelerate's launcher (torch elastic's agent, for several processes) runs inside this
process; a preemption signal (SIGTERM, SIGUSR1 or SIGINT: Kubernetes signals the container's first process, SLURM
every process of a step) is passed on to the ranks, which agree, save and stop; this process then exits as they did:
75 when a checkpoint of the step their line names exists, with their one line and nothing of its own.
`--max_restarts N` restarts the ranks after a crash, never after a preemption. docs/cluster.md.

(vit_mpp/processes/rank_lifecycle.py is the other side: being one rank of a launched group.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vit_mpp.cli import UsageError
from vit_mpp.config.fsdp_settings import DEEPSPEED_REFUSED
from vit_mpp.errors import EXIT_PREEMPTED
from vit_mpp.processes.rank_lifecycle import START_UP_LINES, STOP_SIGNALS, UNDER_LAUNCH

POLL_S = 0.1
START_GRACE_S = 15.0  # after a signal, how long to wait for ranks that have not started yet, to pass it on
EXIT_FAILED = 2  # a rank failed, or was killed: one line says which (the ranks' own lines are above it)


@dataclass
class Attempt:
    """One run of Accelerate's launcher in a thread of this process: what it ended with."""

    statuses: dict[int, int] = field(default_factory=dict)  # rank -> exit status (negative: killed by that signal)
    error: BaseException | None = None  # anything else the launcher raised
    done: threading.Event = field(default_factory=threading.Event)
    start_up_lines: dict[int, str] = field(default_factory=dict)  # rank -> its line, stopped during start-up


def children() -> Iterator[int]:
    """The pids of this process's children (the ranks: torch elastic starts them from this process)."""
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1 and int(fields[1]) == me:
            yield int(entry.name)


def _launch(args: object, attempt: Attempt) -> None:
    """Accelerate's launcher, in this thread: the ranks it starts inherit the preemption signals blocked (a signal
    that comes while a rank imports waits until the rank catches it: vit_mpp/processes/stop_signals.py
    `stop_during_start_up`)."""
    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        launch_command(args)
    except ChildFailedError as e:
        attempt.statuses = {rank: failure.exitcode for rank, failure in e.failures.items()}
    except subprocess.CalledProcessError as e:  # one process, without torch elastic
        attempt.statuses = {0: e.returncode}
    except BaseException as e:  # noqa: BLE001 (a bug of the launcher's or a bad flag: reported by main)
        attempt.error = e
    finally:
        attempt.done.set()


class Job:
    """The launcher's runs (one, and one per restart), and the signals this process receives meanwhile (from its
    first line: `catch_signals`)."""

    def __init__(self) -> None:
        self.args: object = None
        self.received: int | None = None
        self.signalled: set[int] = set()  # ranks already sent the signal
        self.lines = Path(tempfile.mkdtemp(prefix="vit-mpp-launch-"))  # the ranks' start-up lines (stop_signals.py)
        os.environ[START_UP_LINES] = str(self.lines)

    def catch_signals(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_signal)

    def run(self) -> Attempt:
        """One run of the launcher, to its end; a signal meanwhile is passed on to its ranks, to those that start
        later too (for START_GRACE_S after it, at most, when none has started)."""
        attempt = Attempt()
        self.signalled.clear()
        for old in self.lines.iterdir():
            old.unlink()
        threading.Thread(target=_launch, args=(self.args, attempt), name="launcher", daemon=True).start()
        since = None
        while not attempt.done.wait(POLL_S):
            if self.received is None:
                continue
            since = since or time.monotonic()
            self._pass_on(self.received)
            if not self.signalled and time.monotonic() - since > START_GRACE_S:
                name = signal.Signals(self.received).name
                print(f"preempted ({name}) before the ranks started: nothing was saved by this launch; run the same "
                      "command to resume", file=sys.stderr, flush=True)
                self.clean_up()
                os._exit(128 + self.received)
        for line in self.lines.iterdir():
            attempt.start_up_lines[int(line.name.removeprefix("rank_"))] = line.read_text()
        return attempt

    def run_all(self) -> int:
        """The launcher's runs: one, and one per restart after a crash (`--max_restarts`), never after a preemption;
        returns the exit status, with the line of this process's own (`outcome`) printed."""
        restarts, self.args.max_restarts = self.args.max_restarts, 0  # this process restarts, never after a signal
        os.environ[UNDER_LAUNCH] = "1"
        for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # its reports repeat the ranks' lines, as tracebacks
        for number in range(restarts + 1):
            status, line = outcome(self.run())
            if self.received is not None or status in (0, EXIT_PREEMPTED) or number == restarts:
                break
            print(f"note: the ranks stopped with status {status}; restart {number + 1} of {restarts}, from the newest "
                  "checkpoint", file=sys.stderr, flush=True)
        if line:
            print(line, file=sys.stderr, flush=True)
        return status

    def clean_up(self) -> None:
        shutil.rmtree(self.lines, ignore_errors=True)

    def on_signal(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        self.signalled.clear()  # a second signal goes to every rank again, as the scheduler sent it
        self._pass_on(signum)

    def _pass_on(self, signum: int) -> None:
        for pid in children():
            if pid in self.signalled:
                continue
            try:
                os.kill(pid, signum)
                self.signalled.add(pid)
            except ProcessLookupError:
                pass


STOPPED = {128 + s for s in STOP_SIGNALS} | {-s for s in STOP_SIGNALS}  # ended by a stop signal, its own or ours


def outcome(attempt: Attempt) -> tuple[int, str | None]:
    """(exit status, a line of this process's own or None) of a finished attempt. The ranks' lines are theirs: this
    process adds one only where no rank could say it (a rank killed, the launcher's own failure)."""
    if attempt.error is not None:
        if isinstance(attempt.error, SystemExit):
            code = attempt.error.code
            return (code if isinstance(code, int) else 1), None
        if isinstance(attempt.error, ValueError):  # Accelerate's check of the flags
            return EXIT_FAILED, f"error: {' '.join(str(attempt.error).split())}"
        return 1, f"error: the launcher failed: {type(attempt.error).__name__}: {attempt.error}"
    failed = {rank: status for rank, status in attempt.statuses.items() if status}
    values = set(failed.values())
    if not values:
        return 0, None
    if EXIT_FAILED in values or 1 in values:  # a rank's own `error:` line (or a bug's traceback), its peers' lines
        return (EXIT_FAILED if EXIT_FAILED in values else 1), None
    killed = {rank: status for rank, status in failed.items() if status not in STOPPED | {EXIT_PREEMPTED}}
    if killed:  # a rank ended without a word (SIGKILL, the OOM killer): the others were stopped for it
        rank, status = min(killed.items())
        how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
        return EXIT_FAILED, (f"error: rank {rank} {how}, without a line of its own (its output is above); the "
                             "newest checkpoint of its run is kept: run the same command to resume")
    if attempt.start_up_lines:  # stopped during start-up: the ranks left their line to this process, said once
        stopped = EXIT_PREEMPTED if EXIT_PREEMPTED in values else max(v if v > 0 else 128 - v for v in values)
        return stopped, attempt.start_up_lines[min(attempt.start_up_lines)]
    if EXIT_PREEMPTED in values:
        # A rank exits 75 only once every rank's part of the checkpoint is written and marked: it exists, whatever
        # ended the others after that (torch elastic stops the rest with SIGTERM once one has exited). Rank 0 said
        # so: `preempted at step N: checkpoint saved; ...`.
        return EXIT_PREEMPTED, None
    return max(v if v > 0 else 128 - v for v in values), None  # stopped by signals before they could say a word


def main(argv: list[str] | None = None) -> int:
    """The command: Accelerate's launcher, run again after a crash (`--max_restarts`); returns the exit status, the
    ranks' (a bad command line: one `error:` line and 2, before any rank starts)."""
    job = Job()
    job.catch_signals()  # first: a signal during the seconds of imports must not end this process unheard
    try:
        job.args = parse_args(argv)
        status = job.run_all()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        status = EXIT_FAILED
    finally:
        job.clean_up()
    for sig in STOP_SIGNALS:  # decided: a later signal (a scheduler's as the job ends) changes nothing, also once
        signal.signal(sig, signal.SIG_IGN)  # Python has given a handled signal its default action back as it ends
    return status


def parse_args(argv: list[str] | None) -> object:
    """Accelerate's launch flags, checked for what its launcher would take without a word (`--num_processes 0` ran
    one process) or report once its ranks ran (a missing `--config_file`, a module that is not there)."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog, parser.description = "vit-mpp-launch", __doc__.split("\n\n")[0]

    def error(message: str) -> None:
        raise UsageError(f"{message} (see vit-mpp-launch --help: the flags are accelerate launch's)")

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    if args.num_processes is not None and args.num_processes < 1:
        error(f"--num_processes {args.num_processes}: a launch needs at least one process")
    if args.config_file is not None and not os.path.isfile(args.config_file):
        error(f"--config_file {args.config_file}: no such file")
    if asks_for_deepspeed(args):
        raise UsageError(DEEPSPEED_REFUSED)  # each rank would say it (fsdp_settings.py); here before any starts
    if args.module and not module_found(args.training_script):
        error(f"-m {args.training_script}: no such module here (no rank could run it)")
    if not (args.module or args.no_python or os.path.exists(args.training_script)):  # a folder runs its __main__
        error(f"{args.training_script}: no such script")
    return args


# Launch flags that choose the kind of launch themselves: with one, Accelerate's launcher does not take the kind from
# the config file's distributed_type (`_validate_launch_command`).
KIND_FLAGS = ("multi_gpu", "tpu", "tpu_use_cluster", "use_fsdp", "use_megatron_lm")


def asks_for_deepspeed(args: object) -> bool:
    """Whether Accelerate's launcher would launch with DeepSpeed: `--use_deepspeed`, or, with no flag that chooses
    the kind of launch, `distributed_type: DEEPSPEED` in the config it reads (`--config_file`, or Accelerate's
    default file unless `--cpu`). A config that cannot be read is left to Accelerate's launcher to report."""
    from accelerate.commands.config.config_args import default_config_file

    if getattr(args, "use_deepspeed", False):
        return True
    if any(getattr(args, flag, False) for flag in KIND_FLAGS):
        return False
    default = default_config_file if os.path.isfile(default_config_file) and not getattr(args, "cpu", False) else None
    path = getattr(args, "config_file", None) or default
    if path is None:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and str(config.get("distributed_type", "")).upper() == "DEEPSPEED"


def module_found(name: str) -> bool:
    """Whether `python -m name` finds the module from this directory, as the ranks will (an installed package too),
    importing nothing: a package's submodules are looked for in its folders."""
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    top, *rest = name.split(".")
    sys.path.insert(0, os.getcwd())
    try:
        spec = find_spec(top) if top.isidentifier() else None
    finally:
        sys.path.pop(0)
    for part in rest:
        spec = spec and spec.submodule_search_locations and PathFinder.find_spec(part, spec.submodule_search_locations)
    return bool(spec)


if __name__ == "__main__":
    sys.exit(main())
