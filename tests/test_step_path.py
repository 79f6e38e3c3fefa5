"""docs/architecture.md's path of one training step is the code's: a real pretraining (and a fine-tuning) started
as `python -m STAGE` runs under a profiler (tests/helpers/step_path.py), and the project files its second step
passes through, from the start of the step to the optimizer's update, with those on the call stack at the update,
are exactly the files the document lists, at most six."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.helpers.processes import REPO, subprocess_env

DOC = REPO / "docs" / "architecture.md"


def listed(heading: str) -> list[str]:
    """The files of the numbered list after `heading` in docs/architecture.md."""
    text = DOC.read_text()
    start = text.index(heading)
    files = []
    for line in text[start:].splitlines()[1:]:
        if match := re.match(r"\d+\. `([\w/.]+)`", line):
            files.append(match.group(1))
        elif files and not line.strip():  # the list ends at the first blank line after it
            break
    return files


def traced(stage: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "step_path.py"), stage, *args],
                            capture_output=True, text=True, cwd=REPO, env=subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_documented_path_of_a_pretraining_step_is_the_one_it_takes(demo_shards, tmp_path):
    documented = listed("**One pretraining step, in six files**")
    assert len(documented) == 6 == len(set(documented)), documented
    seen = traced("pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}",
                  f"train.run_dir={tmp_path / 'run'}")  # tiny.yaml: a loader worker, as a real run has
    assert seen["steps"] == 6 and seen["stack"], seen
    assert set(seen["files"]) | set(seen["stack"]) == set(documented), seen
    assert seen["stack"][-1] == documented[0]  # the outermost frame: the entry point `python -m pretrain` runs


def test_the_documented_path_of_a_fine_tuning_step_is_the_one_it_takes(demo_shards, encoder_export, tmp_path):
    documented = listed("**One fine-tuning step, in five files**")
    assert len(documented) == 5, documented
    seen = traced("finetune", "--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
                  f"train.run_dir={tmp_path / 'run'}", f"init.checkpoint={encoder_export}", "model.img_size=16")
    assert set(seen["files"]) | set(seen["stack"]) == set(documented), seen
