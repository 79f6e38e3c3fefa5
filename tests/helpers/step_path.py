"""docs/architecture.md's walk of one training step, as the document lists it (`walk`), and as a run takes it: run as
a script, this runs a stage as `python -m STAGE ARGS...` does, under a profiler, and prints (last line, JSON) for
every function of the repository's packages where it was first entered (`file:first line`) with the project files
on the call stack then, in the main process and in its loader workers (forked, they inherit the profiler); the
files the TRACE_STEP-th step (default 2) enters from its start (`Loop.step`) to the optimizer's update; and the files
on the call stack at that update. tests/test_step_path.py holds the document to it.

    python tests/helpers/step_path.py pretrain --config configs/pretrain/tiny.yaml ...
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
PRETRAINING = "**One pretraining step, in"
FINE_TUNING = "**One fine-tuning step, in"
OWN = tuple(f"{REPO / p}/" for p in ("vit_mpp", "data_tools", "pretrain", "finetune", "analysis", "experiments"))
LOOP = str(REPO / "vit_mpp" / "run" / "loop.py")


@dataclass(frozen=True)
class Stop:
    """One file of the walk: the functions a reader follows in it, in the main process and in a loader worker."""

    file: str
    functions: tuple[str, ...]
    in_worker: tuple[str, ...]


def walk(heading: str = PRETRAINING) -> list[Stop]:
    """The numbered list after `heading` in docs/architecture.md, each item "N. `FILE` (`f`, `C.m`; in a loader
    worker `g`): ..." (its lines after the first indented)."""
    text = DOC.read_text()
    items: list[str] = []
    for line in text[text.index(heading):].splitlines()[1:]:
        if re.match(r"\d+\. ", line):
            items.append(line)
        elif items and line.startswith("   "):
            items[-1] += " " + line.strip()
        elif items and not line.strip():  # the list ends at the first blank line after it
            break
    stops = []
    for item in items:
        match = re.match(r"\d+\. `([\w/.]+)`(?: \(([^)]*)\))?", item)
        main, _, worker = (match.group(2) or "").partition("in a loader worker")
        stops.append(Stop(match.group(1), tuple(re.findall(r"`([\w.]+)`", main)),
                          tuple(re.findall(r"`([\w.]+)`", worker))))
    return stops


def walk_files(heading: str = PRETRAINING) -> list[str]:
    return [stop.file for stop in walk(heading)]


def main() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    which = int(os.environ.get("TRACE_STEP", "2"))
    seen = {"steps": 0, "on": False, "files": set(), "stack": []}
    first: dict[str, list[str]] = {}  # "file:line" of a function -> project files on the stack at its first call
    parent, workers = os.getpid(), tempfile.mkdtemp(prefix="step-path-")

    def relative(filename: str) -> str:
        return str(Path(filename).resolve().relative_to(REPO))

    def stack(frame) -> list[str]:  # noqa: ANN001
        files = []
        while frame is not None:
            if frame.f_code.co_filename.startswith(OWN):
                files.append(relative(frame.f_code.co_filename))
            frame = frame.f_back
        return files

    def profile(frame, event, arg) -> None:  # noqa: ANN001 (sys.setprofile's signature)
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(OWN):
            return
        key = f"{relative(code.co_filename)}:{code.co_firstlineno}"
        if key not in first:
            first[key] = stack(frame)
            if os.getpid() != parent:  # a loader worker: its first calls go to a file the main process reads
                line = json.dumps({key: first[key]}) + "\n"
                fd = os.open(f"{workers}/{os.getpid()}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                os.write(fd, line.encode())
                os.close(fd)
        if os.getpid() != parent:
            return
        if code.co_filename == LOOP and code.co_name == "step":
            seen["steps"] += 1
            seen["on"] = seen["steps"] == which
        if seen["on"]:
            seen["files"].add(relative(code.co_filename))

    def at_update(optimizer, args, kwargs) -> None:  # noqa: ANN001
        if seen["on"] and os.getpid() == parent:
            seen["stack"] = stack(sys._getframe())
            seen["on"] = False

    register_optimizer_step_pre_hook(at_update)
    os.register_at_fork(after_in_child=first.clear)  # a loader worker's own first calls
    stage, sys.argv = sys.argv[1], sys.argv[1:]
    sys.setprofile(profile)
    try:
        runpy.run_module(stage, run_name="__main__", alter_sys=True)
    finally:
        sys.setprofile(None)
        in_workers: dict[str, list[str]] = {}
        for path in sorted(Path(workers).glob("*.jsonl")):
            for line in path.read_text().splitlines():
                for key, files in json.loads(line).items():
                    in_workers.setdefault(key, files)
        print(json.dumps({"steps": seen["steps"], "files": sorted(seen["files"]), "stack": seen["stack"],
                          "first": first, "workers": in_workers}))


if __name__ == "__main__":
    main()
