"""docs/architecture.md's walk of one training step is the code's. A real pretraining (and a fine-tuning) started as
`python -m STAGE` runs under a profiler (tests/helpers/step_path.py), and:

- every function the walk names is entered, in the main process or in a loader worker as the walk says, from the
  file the walk names (a function moved out of its file fails here);
- when each of them is first entered, and at the optimizer's update, the project files on the call stack are the
  walk's, or the process lifecycle's (vit_mpp/processes/: its named calls, which lead back into the walk);
- the files the second step enters up to the update are the walk's (or the process lifecycle's);
- the pretraining walk is at most eight files, none of vit_mpp/processes/, from the entry point's `main`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests.helpers.processes import REPO, subprocess_env
from tests.helpers.step_path import FINE_TUNING, PRETRAINING, Stop, walk

WING = "vit_mpp/processes/"


def first_line(file: str, name: str) -> int:
    """The first line of `name` (`function` or `Class.method`) in `file`, as its code object counts it (its first
    decorator's)."""
    body = ast.parse((REPO / file).read_text()).body
    node = None
    for part in name.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        assert node is not None, f"{file} defines no `{name}`: docs/architecture.md's walk names it there"
        body = node.body
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def traced(stage: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "step_path.py"), stage, *args],
                            capture_output=True, text=True, cwd=REPO, env=subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_the_walk_is_taken(seen: dict, stops: list[Stop]) -> None:
    files = [stop.file for stop in stops]
    allowed = set(files)
    assert len(allowed) == len(files) and all(stop.functions or stop.in_worker for stop in stops), stops
    assert seen["steps"] >= 2 and seen["stack"], {k: seen[k] for k in ("steps", "files", "stack")}
    for stop in stops:
        for name in (*stop.functions, *stop.in_worker):
            worker = name in stop.in_worker
            entered = seen["workers"] if worker else seen["first"]
            key = f"{stop.file}:{first_line(stop.file, name)}"
            assert key in entered, f"{stop.file} `{name}` was never entered" + (" in a loader worker" * worker)
            off = [f for f in entered[key] if f not in allowed and not f.startswith(WING)]
            assert not off, f"{stop.file} `{name}` is reached through files outside the walk: {entered[key]}"
    assert set(seen["stack"]) <= allowed, seen["stack"]  # the update, called from the walk's files alone
    assert seen["stack"][-1] == files[0], seen["stack"]  # the outermost frame: the entry point `python -m` runs
    step = {f for f in seen["files"] if not f.startswith(WING)}
    assert step <= allowed, f"the second step enters files outside the walk: {sorted(step - allowed)}"


def test_the_documented_walk_of_a_pretraining_step_is_the_one_it_takes(demo_shards, tmp_path):
    stops = walk(PRETRAINING)
    assert 0 < len(stops) <= 8 and not [s.file for s in stops if s.file.startswith(WING)], stops
    assert [name for s in stops for name in s.in_worker], "the walk follows the batch into a loader worker"
    seen = traced("pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}",
                  f"train.run_dir={tmp_path / 'run'}")  # tiny.yaml: a loader worker, as a real run has
    assert seen["steps"] == 6, seen["steps"]
    assert_the_walk_is_taken(seen, stops)


def test_the_documented_walk_of_a_fine_tuning_step_is_the_one_it_takes(demo_shards, encoder_export, tmp_path):
    stops = walk(FINE_TUNING)
    seen = traced("finetune", "--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
                  f"train.run_dir={tmp_path / 'run'}", f"init.checkpoint={encoder_export}", "model.img_size=16")
    assert_the_walk_is_taken(seen, stops)


def test_a_function_moved_out_of_its_file_fails_the_walk():
    loop = "vit_mpp/run/loop.py"
    key = f"{loop}:{first_line(loop, 'fit')}"
    seen = {"steps": 2, "stack": [loop], "files": [loop], "workers": {}, "first": {key: [loop]}}
    assert_the_walk_is_taken(seen, [Stop(loop, ("fit",), ())])
    with pytest.raises(AssertionError, match="defines no `fit`"):  # the document names it where it is not
        assert_the_walk_is_taken(seen, [Stop("pretrain/train.py", ("fit",), ())])
    with pytest.raises(AssertionError, match="was never entered"):  # defined there, and the run goes elsewhere
        assert_the_walk_is_taken(seen, [Stop(loop, ("Loop.step",), ())])
    with pytest.raises(AssertionError, match="outside the walk"):  # reached through a file the walk leaves out
        assert_the_walk_is_taken({**seen, "first": {key: [loop, "vit_mpp/run/optimizer.py"]}},
                                 [Stop(loop, ("fit",), ())])
