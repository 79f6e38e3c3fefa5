"""Pretraining on a mixture of shard sets: ours (build-shards) and theirs (img2dataset tars, indexed in place, no
labels); the sample audit shows each set in its weight's share, each set read once per epoch, with its name; the
realised proportions are logged; a mixture killed with -9 resumes into exactly the samples of an uninterrupted run."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_tools.cli import main as build_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.processes import REPO, subprocess_env
from tests.helpers.runs import read_metrics
from tests.helpers.shards import img2dataset_folder

THEIRS = [20, 12, 16]  # 48 img2dataset samples in uneven shards


@pytest.fixture(scope="module")
def theirs(tmp_path_factory) -> Path:
    folder = img2dataset_folder(tmp_path_factory.mktemp("theirs"), THEIRS)
    build_main(["index", str(folder)])
    return folder


def mixture(ours: Path, theirs: Path, run_dir: Path, *overrides: str) -> list[str]:
    return ["--config", "configs/pretrain/tiny.yaml", f"data.shards=[{ours},{theirs}]", "data.weights=[0.5,0.5]",
            f"train.run_dir={run_dir}", "train.record_samples=true", "data.num_workers=1", "train.log_every=5",
            "knn.train_images=0", *overrides]


def audit(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples" / "rank_0.jsonl").read_text().splitlines()]


def test_a_mixture_of_ours_and_theirs_draws_half_from_each(demo_shards, theirs, tmp_path):
    pretrain_main(mixture(demo_shards, theirs, tmp_path, "train.steps=30"))  # 240 samples
    records = audit(tmp_path)
    sets = collections.Counter(s for r in records for s in r["sets"])
    ours_info = json.loads((demo_shards / "_info.json").read_text())
    ours_name, ours_size = ours_info["name"], ours_info["splits"]["train"]["num_samples"]
    assert set(sets) == {ours_name, theirs.name}
    assert sets[ours_name] == pytest.approx(120, abs=3) and sets[theirs.name] == pytest.approx(120, abs=3)
    seen: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        for key, s, e in zip(r["keys"], r["sets"], r["epochs"]):
            seen[(s, e)][key] += 1
    assert max(max(c.values()) for c in seen.values()) == 1  # never twice in an epoch of its set
    assert len(seen[(theirs.name, 0)]) == sum(THEIRS) and len(seen[(ours_name, 0)]) == ours_size  # whole epochs
    logged = [r for r in read_metrics(tmp_path) if f"mix_{theirs.name}" in r]
    assert logged and all(abs(r[f"mix_{theirs.name}"] - 0.5) < 0.1 for r in logged)  # the realised proportions
    export = json.loads((tmp_path / "export" / "config.json").read_text())["vit_mpp"]["data"]
    assert [m["weight"] for m in export["mixture"]] == [0.5, 0.5]


def test_a_mixture_killed_with_minus_9_resumes_into_the_samples_of_an_uninterrupted_run(demo_shards, theirs,
                                                                                           tmp_path):
    whole = tmp_path / "whole"
    pretrain_main(mixture(demo_shards, theirs, whole, "train.steps=24"))
    killed = tmp_path / "killed"
    args = mixture(demo_shards, theirs, killed, "train.steps=24", "train.ckpt_every=5")
    child = subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=subprocess_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (killed / "checkpoints" / "step_000010" / "trainer_state.json").is_file():
        assert child.poll() is None and time.monotonic() < deadline, "the run ended or never saved step 10"
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait()
    pretrain_main(args)  # the same command resumes
    assert [(r["step"], r["keys"], r["sets"]) for r in audit(killed)] == \
        [(r["step"], r["keys"], r["sets"]) for r in audit(whole)]
    losses = {r["step"]: r["loss"] for r in read_metrics(killed) if "loss" in r}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in read_metrics(whole) if "loss" in r}, rel=1e-5)
