"""Child processes the tests start (`python -m`, `accelerate launch` with two CPU processes), the environment they
run in, and a stage run in-process the way `python -m` runs it (its exit status and output)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# `--multi_gpu` on a machine without GPUs starts N CPU processes with gloo; `--cpu --num_processes 2` starts one.
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


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
    from vit_mpp.cli import run_main

    capsys.readouterr()  # only this run's output
    try:
        run_main(main, argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
