"""A finished run exits, with any number of loader workers: its streams are closed before the interpreter exits,
never left to the garbage collector during the exit, when no thread runs and a deadlined close waited forever (a
pretraining with `data.num_workers=0` exported its encoder and then never ended)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.processes import REPO, run_module, subprocess_env

LEFT_OPEN = """
import sys
from vit_mpp.data.manifest import load_split
from vit_mpp.data.shard_reader import range_segments, read_segment
split, _ = load_split(sys.argv[1], "train")
samples = read_segment(range_segments(split, list(range(len(split.urls))), 0, split.num_samples)[0])
next(samples)  # a shard open mid-read
cycle = [samples]
cycle.append(cycle)  # only the cyclic garbage collector of the interpreter's exit can close it
del samples, cycle
print("exiting", flush=True)
"""


def test_a_shard_read_left_open_does_not_hold_the_interpreters_exit(demo_shards):
    result = subprocess.run([sys.executable, "-c", LEFT_OPEN, str(demo_shards)], capture_output=True, text=True,
                            timeout=60, env=subprocess_env(), cwd=REPO)  # before the fix: killed at the timeout
    assert result.returncode == 0 and result.stdout == "exiting\n", result.stderr[-2000:]


@pytest.mark.parametrize("workers", [0, 1])
def test_each_stage_exits_when_done(demo_shards, tmp_path, workers):
    pre = run_module("pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}",
                     f"train.run_dir={tmp_path / 'pre'}", f"data.num_workers={workers}", "train.steps=8",
                     "knn.train_images=16", timeout=150)  # before the fix (0 workers): killed at the timeout
    assert pre.returncode == 0 and "exported encoder to" in pre.stdout, pre.stderr[-2000:]
    fine = run_module("finetune", "--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
                      f"train.run_dir={tmp_path / 'fine'}", f"init.checkpoint={tmp_path / 'pre' / 'export'}",
                      f"data.num_workers={workers}", "train.epochs=1", timeout=150)
    assert fine.returncode == 0 and "final validation top-1" in fine.stdout, fine.stderr[-2000:]
