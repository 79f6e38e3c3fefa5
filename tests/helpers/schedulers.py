"""Stand-ins for the schedulers of docs/cluster.md, to run its recipes as written on one host (CPU processes, gloo):

- SLURM: `srun`, `scancel`, `scontrol` on PATH. `srun` starts one task per node of the job (SLURM_NODEID, ...), as
  the step's processes (they carry the step's tag in their environment, as a cgroup holds them), and returns the
  highest status of its tasks; `scancel --signal=SIG JOB` signals every process of the job's steps (not the batch
  script); `scontrol show hostnames` names the local host for every node; `scontrol requeue` notes the requeue.
  `Slurm.submit` runs the batch script, and the test plays the time limit (USR1 to the batch script), the grace
  period and the SIGKILL after it.
- Kubernetes: `pod_command` turns the Job's container into a command and environment the way the kubelet does
  (`$(VAR)` from the container's env), `pod_failure_action` applies the Job's podFailurePolicy to a pod's status.

The recipes' site values (paths, the config, ports, the number of nodes) are set through the names the recipes give
them; everything else runs as the page says.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.processes import REPO, Background

DOC = REPO / "docs" / "cluster.md"


def recipe(heading: str, language: str) -> str:
    """The first fenced block of `language` after `heading` in docs/cluster.md."""
    text = DOC.read_text()
    start = text.index(f"\n{heading}\n")
    match = re.search(rf"```{language}\n(.*?)```", text[start:], flags=re.S)
    assert match, f"no {language} block under {heading}"
    return match.group(1)


def with_site_values(script: str, values: dict[str, str]) -> str:
    """`script` with its site assignments (`NAME=...` or `export NAME=...` lines) set to `values`; each must exist."""
    for name, value in values.items():
        pattern = rf"^((?:export )?{name}=).*$"
        assert re.search(pattern, script, flags=re.M), f"the recipe sets no {name}"
        script = re.sub(pattern, lambda m, v=value: m.group(1) + v, script, count=1, flags=re.M)
    return script


SRUN = """
    import os, subprocess, sys
    args = sys.argv[1:]
    while args and args[0].startswith("-"):  # srun's own options
        args = args[1:]
    nodes = int(os.environ["SLURM_NNODES"])
    tasks = []
    for node in range(nodes):
        env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0",
               "SLURM_GPUS_ON_NODE": "1", "FAKE_SLURM_STEP": os.environ["SLURM_JOB_ID"]}
        tasks.append(subprocess.Popen(args, env=env, start_new_session=True))
    codes = [t.wait() for t in tasks]
    sys.exit(max(c if c >= 0 else 128 - c for c in codes))
"""

SCANCEL = """
    import os, re, signal, sys
    sig = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--signal=")), "KILL")
    job = [a for a in sys.argv[1:] if not a.startswith("-")][0]
    needle = f"FAKE_SLURM_STEP={job}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\\0"):
                        os.kill(int(entry), getattr(signal, "SIG" + sig.removeprefix("SIG")))
            except OSError:
                pass
"""

SCONTROL = """
    import os, signal, sys
    # A reader that stops early (`| head -n1`, as the recipe reads it) ends it quietly, as it does the real (C) one;
    # Python's own default turns the closed pipe into a BrokenPipeError traceback (once in CI)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if sys.argv[1:3] == ["show", "hostnames"]:
        print("\\n".join(["127.0.0.1"] * int(os.environ["SLURM_NNODES"])))
    elif sys.argv[1] == "requeue":
        with open(os.path.join(os.environ["FAKE_SLURM_DIR"], "requeued"), "a") as f:
            f.write(sys.argv[2] + "\\n")
"""


class Slurm:
    """A one-host SLURM for batch scripts: `submit` runs one, as its job would run on `nodes` nodes."""

    def __init__(self, root: Path, nodes: int = 2) -> None:
        self.root, self.nodes = root, nodes
        self.bin = root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for name, code in (("srun", SRUN), ("scancel", SCANCEL), ("scontrol", SCONTROL)):
            path = self.bin / name
            path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(code))
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
        self.submitted = 0

    @property
    def requeued(self) -> list[str]:
        path = self.root / "requeued"
        return path.read_text().split() if path.is_file() else []

    def submit(self, script: str, log: Path) -> Background:
        """Run `script` as the batch script of job 1000 (its output appended to `log`, like --open-mode=append)."""
        self.submitted += 1
        path = self.root / f"batch{self.submitted}.sh"
        path.write_text(script)
        env = {"SLURM_JOB_ID": "1000", "SLURM_JOB_NODELIST": f"node[0-{self.nodes - 1}]",
               "SLURM_NNODES": str(self.nodes), "FAKE_SLURM_DIR": str(self.root),
               "PATH": f"{self.bin}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
        return Background(["bash", str(path)], log, f"slurm{self.submitted}", env=env)

    def time_limit(self, batch: Background, grace_s: float) -> None:
        """What `--signal=B:USR1@GRACE` does: USR1 to the batch script, then, when the job is still running at the
        time limit, SIGKILL to every process of it."""
        os.kill(batch.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + grace_s
        while batch.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        batch.signal_all(signal.SIGKILL)
        batch.proc.wait(timeout=30)


def pod_command(job: dict[str, Any], index: int, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Pod `index`'s first process (command + args, `$(VAR)` expanded from its env as the kubelet does) and its
    environment: the container's env with `env`'s values set (each must be one the container declares)."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    declared = {item["name"]: str(item["value"]) for item in container.get("env", [])}
    unknown = set(env) - set(declared)
    assert not unknown, f"the Job's container declares no {sorted(unknown)}"
    values = {**declared, **env, "JOB_COMPLETION_INDEX": str(index)}

    def expand(word: Any) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), str(word))

    image_path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # the image's: vit-mpp-launch installed
    return [expand(w) for w in [*container["command"], *container.get("args", [])]], {**values, "PATH": image_path}


def pod_failure_action(job: dict[str, Any], status: int) -> str:
    """What the Job does with a pod that exited with `status` and no disruption condition: the action of the first
    rule of its podFailurePolicy that matches (`Count` when none does and the status is not 0; `Succeeded`)."""
    if status == 0:
        return "Succeeded"
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes and (status in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"]
    return "Count"


def job_spec() -> dict[str, Any]:
    """The Kubernetes Job of docs/cluster.md, parsed."""
    return yaml.safe_load(recipe("## Kubernetes", "yaml"))
