"""Run a stage as `python -m STAGE ARGS...` does, and print (last line, JSON) the project files one training step
passes through: every file of the repository's packages entered from the start of the step (`Loop.step`, its
`TRACE_STEP`-th call, default 2) to the optimizer's update, and the files on the call stack at the update. Used by
tests/test_step_path.py to hold docs/architecture.md's path of one step to the code.

    python tests/helpers/step_path.py pretrain --config configs/pretrain/tiny.yaml ...
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWN = tuple(f"{REPO / p}/" for p in ("vit_mpp", "data_tools", "pretrain", "finetune", "analysis", "experiments"))
LOOP = str(REPO / "vit_mpp" / "run" / "loop.py")


def main() -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    which = int(os.environ.get("TRACE_STEP", "2"))
    seen = {"steps": 0, "on": False, "files": set(), "stack": []}

    def relative(filename: str) -> str:
        return str(Path(filename).resolve().relative_to(REPO))

    def profile(frame, event, arg) -> None:  # noqa: ANN001 (sys.setprofile's signature)
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename == LOOP and code.co_name == "step":
            seen["steps"] += 1
            seen["on"] = seen["steps"] == which
        if seen["on"] and code.co_filename.startswith(OWN):
            seen["files"].add(relative(code.co_filename))

    def at_update(optimizer, args, kwargs) -> None:  # noqa: ANN001
        if not seen["on"]:
            return
        frame = sys._getframe()
        while frame is not None:
            if frame.f_code.co_filename.startswith(OWN):
                seen["stack"].append(relative(frame.f_code.co_filename))
            frame = frame.f_back
        seen["on"] = False

    register_optimizer_step_pre_hook(at_update)
    stage, sys.argv = sys.argv[1], sys.argv[1:]
    sys.setprofile(profile)
    try:
        runpy.run_module(stage, run_name="__main__", alter_sys=True)
    finally:
        sys.setprofile(None)
        print(json.dumps({"steps": seen["steps"], "files": sorted(seen["files"]), "stack": seen["stack"]}))


if __name__ == "__main__":
    main()
