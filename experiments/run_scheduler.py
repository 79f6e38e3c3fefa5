"""compare's child processes: the one registry of the stages' processes under way (`children`) and the stop signals
that reach them; the stages' own dry runs, which measure their lengths (kept in --out's DRY_RUNS); and the runs
themselves (`execute`): each stage after the one it starts from, --jobs at a time, with progress and an ETA, a
finished run reused and a stopped one resumed by the same command. See docs/experiments.md#python--m-experimentscompare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from experiments.compare_arms import SCORES, Lengths, Stage
from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import ARCH_KEYS
from vit_mpp.durable import write_atomic
from vit_mpp.errors import EXIT_PREEMPTED, Stopped, UserError
from vit_mpp.models.export_folder import is_export
from vit_mpp.processes.signal_handlers import handling
from vit_mpp.progress import format_duration
from vit_mpp.run.metering.metrics_log import read_metrics
from vit_mpp.tools.args import make_out_folder

SIDECAR = "compare_run.json"  # in each run directory: the command compare ran there, and its threads
DRY_RUNS = "dry_runs.json"  # in --out: what each stage command's dry run resolved (batch, steps, epochs)
DRY_RUN_HEAD = "dry run: nothing is written; the resolved config:"


# ---------------------------------------------------------------------------------------- the processes and stops


class Children:
    """The stages' processes under way. A stop signal to compare (a scheduler's SIGTERM, Ctrl-C, a hang-up) reaches
    each of them as SIGTERM, their preemption signal: they save a checkpoint and exit 75, and compare starts nothing
    new; without it a compare killed with `kill` left its runs training, holding their run directories."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.stopped_by: int | None = None

    def run(self, command: list[str], **popen: Any) -> int:
        """Run `command` to its end (not at all once a stop signal came: 128 + its number); its exit status."""
        return self.capture(command, **popen).returncode

    def capture(self, command: list[str], **popen: Any) -> subprocess.CompletedProcess:
        """`run`, with what it printed to the pipes `popen` asks for (a dry run's output)."""
        with self.lock:
            if self.stopped_by is not None:
                return subprocess.CompletedProcess(command, 128 + self.stopped_by, "", "")
            proc = subprocess.Popen(command, **popen)
            self.running.add(proc)
        try:
            out, err = proc.communicate()
            return subprocess.CompletedProcess(command, proc.returncode, out, err)
        finally:
            with self.lock:
                self.running.discard(proc)

    def stop(self, signum: int, frame: Any = None) -> None:
        """The signal handler: stop every stage under way (once each is enough: later signals change nothing)."""
        if self.stopped_by is None:
            self.stopped_by = signum
            with self.lock:
                for proc in self.running:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGTERM)

    def stop_signals(self) -> contextlib.AbstractContextManager[None]:
        """`stop` handles the stop signals while the stages run."""
        return handling_stop_signals(self.stop)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
children = Children()


def handling_stop_signals(handler: Callable[[int, Any], None]) -> contextlib.AbstractContextManager[None]:
    """`handler` handles the STOP_SIGNALS in the main thread (the previous handlers come back), but not one that
    compare's parent set to be ignored: `nohup` ignores SIGHUP so that a sweep outlives its terminal, and a background
    job of a non-interactive shell ignores SIGINT."""
    return handling(STOP_SIGNALS, handler, takes=lambda current: current is not signal.SIG_IGN)


@contextlib.contextmanager
def stopped_before_the_runs() -> Iterator[None]:
    """A stop signal while compare draws subsets or dry-runs the stages (a minute under load), before any run starts
    (a terminal's Ctrl-C, a scheduler's SIGTERM): the dry runs under way are stopped, and compare ends with one line
    and status 128 + the signal's number, not a traceback or the signal's own death (an interrupted draw is drawn
    again whole by the same command; a draw the signal did not reach ends first). The handler only stops: an
    exception raised from it into threading's own code (the dry runs' pool) breaks its locks. The error of a dry run
    or a draw the signal stopped (or of one never started after it) becomes the stop's line here."""
    with handling_stop_signals(children.stop):
        try:
            yield
        except UserError:
            if children.stopped_by is None:
                raise
        if children.stopped_by is not None:
            raise stopped_while_checking(children.stopped_by) from None


def stopped_while_checking(signum: int) -> Stopped:
    """The line of a compare stopped before any run started."""
    return Stopped(f"compare stopped by {signal.Signals(signum).name} while checking its runs: no run was started; "
                   "run the same command to start", 128 + signum)


# --------------------------------------------------------------------------------------------- dry runs (lengths)


def dry_run(cmd: list[str]) -> subprocess.CompletedProcess:
    """A stage's own `--dry-run`: every check a run makes at start, nothing written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return children.capture([*cmd, "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def parse_dry_run(text: str) -> tuple[Lengths, dict[str, Any]]:
    """(batch, steps and epochs; the model section) from a dry run's output (its resolved config, then `would ... N
    steps`)."""
    lines = text.splitlines()
    start = lines.index(DRY_RUN_HEAD) + 1
    end = next(i for i in range(start, len(lines)) if not re.match(r"^(\s|- |[\w]+:( |$))", lines[i]))
    cfg = yaml.safe_load("\n".join(lines[start:end]))
    steps = next(int(m.group(1)) for line in reversed(lines) if (m := re.match(r"^would start .*, (\d+) steps$", line)))
    return Lengths(int(cfg["train"]["batch_size"]), steps, cfg["train"].get("epochs")), dict(cfg.get("model") or {})


def error_of(text: str) -> str:
    """The `error: ...` line of a stage's output, else its last line."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    line = next((ln for ln in reversed(lines) if ln.startswith("error: ")), lines[-1] if lines else "no output")
    return line.removeprefix("error: ")


def read_cache(cache: Path | None) -> dict[str, Any]:
    """The dry runs' lengths kept in `cache`; one that cannot be read (written by an older compare killed while it
    wrote it) is only a cache: its dry runs are run again."""
    try:
        known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return known if isinstance(known, dict) else {}


def measure(stages: list[Stage], jobs: int, fingerprint: str, known: dict[str, Any],
            shards: dict[str, str] | None = None) -> dict[str, Lengths]:
    """Dry-run each distinct stage command of the first seed; a failing one is this command's one error line. A
    fine-tuning that starts from another stage's export is dry-run from scratch with the architecture that export
    will have (its stage's resolved `model.*` keys), since the export does not exist yet. A command already dry-run
    on the same configs and manifests (`fingerprint`) is not run again: `known`, the cache (dry_runs.json), holds its
    lengths, and gets the new ones. `shards` reads a data.shards elsewhere (the first seed's labelled subsets, drawn
    into a temporary folder). Returns 'ARM/STAGE' -> lengths."""
    first, nowhere = stages[0].name.split("/")[0], stages[0].run_dir.parents[2] / ".dry-run"  # never written
    moved = {f"data.shards={a}": f"data.shards={b}" for a, b in (shards or {}).items()}
    resolved: dict[int, list[Any]] = {}  # id(stage) -> [batch, steps, epochs, model]
    todo = [s for s in stages if s.name.startswith(first + "/")]
    pool = ThreadPoolExecutor(jobs)
    try:
        while todo:  # in waves: a stage once the stage whose export it starts from is resolved
            ready = [s for s in todo if s.needs is None or id(s.needs) in resolved]
            checks: dict[tuple[str, ...], list[Stage]] = {}
            for s in ready:
                checks.setdefault(dry_run_command(s, nowhere, moved, resolved), []).append(s)
            keys = {cmd: hashlib.sha256(json.dumps([cmd, fingerprint, 2]).encode()).hexdigest() for cmd in checks}
            results = {cmd: pool.submit(dry_run, [sys.executable, *cmd]) for cmd in checks if keys[cmd] not in known}
            for cmd, future in results.items():
                result = future.result()
                if result.returncode != 0:
                    which = checks[cmd][0].name.split("/", 1)[1]
                    raise ConfigError(f"{which}: {error_of(result.stderr + result.stdout)}")
                lengths, model = parse_dry_run(result.stdout)
                known[keys[cmd]] = [*dataclasses.astuple(lengths), model]
            resolved.update({id(s): known[keys[cmd]] for cmd, group in checks.items() for s in group})
            todo = [s for s in todo if id(s) not in resolved]
    finally:  # on an error or Ctrl-C the dry runs not started yet are not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    return {s.key: Lengths(*resolved[id(s)][:3]) for s in stages if id(s) in resolved}


def dry_run_command(stage: Stage, nowhere: Path, moved: dict[str, str], resolved: dict[int, list[Any]],
                    ) -> tuple[str, ...]:
    """The stage's command for its dry run (without the interpreter): its run directory nowhere, its data where
    `moved` says, from scratch, and for a stage that starts from another's export that stage's architecture."""
    cmd = [f"train.run_dir={nowhere}" if c.startswith("train.run_dir=") else "init.checkpoint="
           if c.startswith("init.checkpoint=") else moved.get(c, c)
           for c in stage.command[1:] if not c.startswith("init.keep_head=")]  # the export it starts from is to come
    if stage.needs is not None:
        model = resolved[id(stage.needs)][3]
        cmd += [f"model.{k}={model[k]}" for k in ARCH_KEYS if model.get(k) is not None]
    return tuple(cmd)


def write_cache(cache: Path, known: dict[str, Any]) -> None:
    """The dry runs' lengths kept in `cache`, atomically: a compare killed here leaves the old one whole; a cache
    that holds them already is not written again (a rerun of a finished compare writes only its report)."""
    text = json.dumps(known, indent=1) + "\n"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if cache.read_text() == text:
            return
    make_out_folder(cache.parent)
    write_atomic(cache, text)


# ------------------------------------------------------------------------------------------------------- the runs


def trained(stage: Stage) -> bool:
    """The stage's run reached its last step and wrote its export."""
    steps = [int(r["step"]) for r in read_metrics(stage.run_dir) if isinstance(r.get("step"), int)]
    return is_export(stage.run_dir / "export") and bool(steps) and max(steps) >= stage.steps > 0


def scored_top1(run_dir: Path) -> float | None:
    """The top-1 of a run's final export on --test, as `finetune.evaluate` wrote it (--val); None before (or torn)."""
    try:
        value = json.loads((run_dir / SCORES / "evaluation.json").read_text())["metrics"]["val_top1"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def finished(stage: Stage) -> bool:
    """The stage's run is trained and, with --val, its export scored on --test."""
    return trained(stage) and (stage.score is None or scored_top1(stage.run_dir) is not None)


def check_run_dirs(stages: list[Stage]) -> None:
    """A run directory that exists holds a run of this very command (a rerun resumes or reuses it), else one line
    before anything runs: settings changed under a run must not mix two recipes in one table."""
    for s in stages:
        if not s.run_dir.exists() or not any(s.run_dir.iterdir()):
            continue
        side = s.run_dir / SIDECAR
        if not side.is_file():
            raise ConfigError(f"{s.run_dir} holds something compare did not start: give another --out")
        before = json.loads(side.read_text())["command"]
        now = [s.module, s.config, *s.overrides]
        if before != now:
            changed = [o for o in now if o not in before] or [o for o in before if o not in now] or ["their order"]
            raise ConfigError(f"{s.run_dir} holds a run of other settings (now {changed[0]}): give another --out, or "
                              "remove that run directory to run it again")


def launch(stage: Stage, log: Path, threads: int) -> int:
    """Run one stage as a subprocess (a trained one is not run again), then with --val its export's scoring on
    --test, their output appended to `log`; the exit status of the first that failed, else 0."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    todo = [] if trained(stage) else [stage.command]
    todo += [stage.score_command] if stage.score_command and scored_top1(stage.run_dir) is None else []
    with log.open("a") as f:
        for command in todo:
            f.write(f"$ {shlex.join(command)}\n")
            f.flush()
            if status := children.run(command, stdout=f, stderr=subprocess.STDOUT, env=env):
                return status
    return 0


@dataclass
class Progress:
    """Progress over the runs of one invocation: which run of how many, elapsed, and an ETA from the runs finished
    so far: a run's time fitted as a start-up cost plus a cost per planned training image (steps x batch)."""

    total: int
    jobs: int
    start: float = field(default_factory=time.monotonic)
    started: dict[str, float] = field(default_factory=dict)
    history: list[tuple[int, float]] = field(default_factory=list)  # (images, seconds) of the runs finished
    count: int = 0

    def begin(self, stage: Stage) -> str:
        self.count += 1
        self.started[stage.name] = time.monotonic()
        return f"[{self.count}/{self.total}] {stage.name} started"

    def seconds(self, work: int) -> float:
        """A run's expected seconds: a least-squares line through the finished runs (one run: proportional)."""
        n = len(self.history)
        mean_w, mean_t = (sum(h[i] for h in self.history) / n for i in (0, 1))
        var = sum((w - mean_w) ** 2 for w, _ in self.history)
        slope = (sum((w - mean_w) * (t - mean_t) for w, t in self.history) / var if var else 0.0)
        if slope <= 0 or mean_t - slope * mean_w < 0:  # too few or too odd points for a line: proportional
            return work * sum(t for _, t in self.history) / max(1, sum(w for w, _ in self.history))
        return mean_t + slope * (work - mean_w)

    def end(self, stage: Stage, pending: list[Stage], running: list[Stage]) -> str:
        now = time.monotonic()
        took = now - self.started.pop(stage.name)
        self.history.append((stage.work, took))
        left = sum(self.seconds(s.work) for s in pending) + sum(
            max(0.0, self.seconds(s.work) - (now - self.started[s.name])) for s in running)
        eta = left / min(self.jobs, max(1, len(pending) + len(running)))
        return (f"{stage.name} finished in {format_duration(took)}; {self.total - len(pending) - len(running)}/"
                f"{self.total} done, {format_duration(now - self.start)} elapsed, eta {format_duration(eta)}")


def execute(stages: list[Stage], out: Path, jobs: int, threads: int) -> None:
    """Run the stages not finished yet, `jobs` at a time, each after the stage it starts from; stops starting new
    ones at the first failure and raises it as one line once the running ones end. A stop signal stops the running
    ones (each saves a checkpoint) and ends compare with status 75: the same command resumes."""
    todo = [s for s in stages if not finished(s)]
    reused = len(stages) - len(todo)
    if reused:
        print(f"{reused} of {len(stages)} runs finished earlier: reused", flush=True)
    if not todo:
        return
    logs = make_out_folder(out / "logs")
    users = {id(s.needs) for s in todo if s.needs}
    pending = sorted(todo, key=lambda s: (id(s) not in users, -s.work))  # what others start from first, then long
    progress, running, failed, stopped = Progress(len(todo), jobs), {}, None, []
    print(f"{len(todo)} runs, {jobs} at a time, {threads} thread(s) each; logs in {logs}", flush=True)
    children.stopped_by = None
    with children.stop_signals(), ThreadPoolExecutor(jobs) as pool:
        while pending or running:
            waiting = [*pending, *running.values()]  # a stage starts once the one it starts from is done
            go = failed is None and children.stopped_by is None
            for s in [s for s in pending if go and s.needs not in waiting][:jobs - len(running)]:
                pending.remove(s)
                make_out_folder(s.run_dir, "train.run_dir")
                write_atomic(s.run_dir / SIDECAR, json.dumps({"command": [s.module, s.config, *s.overrides],
                                                               "threads": threads}) + "\n")
                print(progress.begin(s), flush=True)
                log = logs / (s.name.replace("/", "_") + ".log")
                running[pool.submit(launch, s, log, threads)] = s
            if not running:
                break
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                s, status = running.pop(future), future.result()
                log = logs / (s.name.replace("/", "_") + ".log")
                if status == 0:
                    print(progress.end(s, pending, list(running.values())), flush=True)
                elif children.stopped_by is not None and (status == EXIT_PREEMPTED or status > 128 or status < 0):
                    stopped.append((s.name, status))  # saved (75), or stopped before anything was saved
                elif failed is None:
                    failed = (f"{s.name} failed with exit status {status}: "
                              f"{error_of(log.read_text())} (log: {log}); run the same command to resume")
                    print(f"{s.name} failed; waiting for the runs under way", flush=True)
    if failed:
        raise ConfigError(failed)
    if children.stopped_by is not None:
        saved = [name for name, status in stopped if status == EXIT_PREEMPTED]
        raise Stopped(f"compare stopped by {signal.Signals(children.stopped_by).name}: "
                      f"{len(stopped)} run(s) under way stopped, {len(saved)} of them with a checkpoint saved"
                      f"{' (' + ', '.join(saved) + ')' if saved else ''}; {len(pending) + len(stopped)} of "
                      f"{len(todo)} not finished; run the same command to resume")
