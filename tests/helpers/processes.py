"""Child processes the tests start (`python -m`, `accelerate launch` with two CPU processes), the environment they
run in, and a stage run in-process the way `python -m` runs it (its exit status and output)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# `--multi_gpu` on a machine without GPUs starts N CPU processes with gloo; `--cpu --num_processes 2` starts one.
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
# vit-mpp-launch (vit_mpp/processes/job_launcher.py), the launcher a scheduler starts: accelerate launch's flags
JOB_LAUNCHER = [sys.executable, "-m", "vit_mpp.processes.job_launcher"]
JOB_LAUNCH = [*JOB_LAUNCHER, *LAUNCH[3:]]


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the repo importable, one thread each (the machine has 2 cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m module args...` in a child process."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(), cwd=REPO)


def launch(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`accelerate launch` of two CPU processes running `args` (e.g. "-m", "pretrain", ...), in a child process."""
    return subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=timeout, env=subprocess_env(),
                          cwd=REPO)


def in_process(main: Callable[[list[str] | None], object], argv: list[str], capsys) -> tuple[int, str, str]:
    """Run an entry point in this process as `python -m` runs it (a user error becomes one `error:` line and exit
    status 2): returns (exit status, stdout, stderr). Use it where the child process is not what is tested."""
    from vit_mpp.processes.exits import run_main

    capsys.readouterr()  # only this run's output
    try:
        run_main(main, argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


class Background:
    """A command started in the background with a marker in its environment, so that every process it makes (the
    launcher, its ranks, their data-loader workers) can be found and signalled; its output goes to a file."""

    MARK = "VIT_MPP_TEST_MARK"

    def __init__(self, args: list[str], log: Path, marker: str, env: dict[str, str] | None = None) -> None:
        # The log's path makes the marker this command's own: tests running side by side (pytest -n 2) may name
        # theirs alike, and a kill of one by its marker must not reach the other's processes
        self.log, self.marker = log, f"{marker}:{log}"
        self.file = log.open("w")
        full_env = {**subprocess_env(), **(env or {}), self.MARK: self.marker}
        self.proc = subprocess.Popen(args, stdout=self.file, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 240) -> None:
        """Until `text` appears in the output (an AssertionError with the output if the command ends first)."""
        import time

        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None, f"ended before {text!r}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def pids(self) -> list[int]:
        """Every live process carrying the marker."""
        needle = f"{self.MARK}={self.marker}".encode()
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if needle in environ.read_bytes().split(b"\0") and alive(int(environ.parent.name)):
                    found.append(int(environ.parent.name))
            except OSError:
                continue
        return found

    def rank(self, rank: int) -> int:
        """The pid of the training process of global rank `rank` (not its data-loader workers)."""
        for pid in self.pids():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if f"RANK={rank}".encode() in env and b"-m\0pretrain" in cmdline and _parent_is_launcher(pid):
                return pid
        raise AssertionError(f"no rank {rank} among {self.pids()}")

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait_gone(self, timeout: float = 120) -> float:
        """Seconds until no marked process is left (an AssertionError after `timeout`)."""
        import time

        start = time.monotonic()
        while self.pids():
            if time.monotonic() - start > timeout:
                left = "\n".join(describe(pid) for pid in self.pids())
                raise AssertionError(f"still running after {timeout} s:\n{left}\n{self.output()[-3000:]}")
            time.sleep(0.05)
        self.proc.wait(timeout=30)
        self.file.close()
        return time.monotonic() - start

    def kill(self) -> None:
        import signal

        self.signal_all(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.file.close()


def wait_all_gone(commands: list[Background], timeout: float) -> None:
    """Until no process of any of `commands` is left (machines of one job): on a timeout, the AssertionError
    describes every process left of every command, so a hang between machines shows both sides, and they are
    killed."""
    import time

    start = time.monotonic()
    while any(c.pids() for c in commands):
        if time.monotonic() - start > timeout:
            left = "\n".join(f"[{c.marker}] {describe(pid)}" for c in commands for pid in c.pids())
            tails = "\n".join(f"[{c.marker}] ...{c.output()[-1500:]}" for c in commands)
            for c in commands:  # described: now gone, so that a hung job does not outlive its test
                c.signal_all(9)
            raise AssertionError(f"still running after {timeout} s:\n{left}\n{tails}")
        time.sleep(0.05)
    for c in commands:
        c.wait_gone(30)


def describe(pid: int) -> str:
    """What a process left running is doing: its command, state, parent, blocked signals and kernel wait channel,
    and its Python stacks (py-spy, a dev dependency, where ptrace is allowed): a hang in CI says where it is."""
    import shutil

    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":\t" in line)
        text = (f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:100]!r} state {status['State']}, parent "
                f"{status['PPid']}, threads {status['Threads']}, blocked {status['SigBlk']}, waiting in "
                f"{Path(f'/proc/{pid}/wchan').read_text() or '-'}")
    except (OSError, KeyError):
        return f"{pid}: gone"
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if spy:
        try:
            text += "\n" + subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                                          text=True, timeout=60).stdout
        except subprocess.TimeoutExpired:
            text += "\n(py-spy: no answer in 60 s)"
    return text


def alive(pid: int) -> bool:
    """A process that exists and is no zombie. A process killed with many threads shows its main thread a zombie
    while the others are still being torn down, holding its files (a run dir's lock) a moment longer: it is alive
    until every thread is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(") ", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):
            continue
    return False


def _parent_is_launcher(pid: int) -> bool:
    """Whether the parent of `pid` is a launcher (accelerate's, torch's, vit-mpp-launch), whose child is a rank, not
    a rank (whose child is a data-loader worker)."""
    parent = Path(f"/proc/{parent_pid}/cmdline").read_bytes() if (parent_pid := _parent(pid)) else b""
    return b"accelerate" in parent or b"vit_mpp.processes.job_launcher" in parent or b"vit-mpp-launch" in parent


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1])


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(") ")[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def ctrl_c_enabled() -> None:
    """`preexec_fn` for a child that a test will Ctrl-C: a shell starts background jobs (`pytest ... &`, CI
    runners' scripts) with SIGINT ignored, the child inherits that, and its Ctrl-C would then do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_paused(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """Send `sig` to `proc` while it and its children are stopped, then let them go on: the signal is pending when
    the process continues, so a fast job cannot finish between the test's decision and the signal's delivery (a
    build of a few hundred small images takes 0.3 s)."""
    if proc.poll() is not None:
        return  # it ended first; the caller's assertions say so
    family = [proc.pid, *children(proc.pid)]
    for s, pids in ((signal.SIGSTOP, family), (sig, family[:1]), (signal.SIGCONT, family)):
        for pid in pids:  # SIGCONT to the main process first: its handler runs before its workers deliver more
            try:
                os.kill(pid, s)
            except ProcessLookupError:  # a worker that had just finished its work
                pass
