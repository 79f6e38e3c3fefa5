"""A preemption fuzzer: SIGTERM at a random moment of a 2-process run (`accelerate launch`, gloo on CPU), uniform over
its wall time so that start-up, steps, evaluations (their loader workers starting), checkpoints and the export are
all hit, then the same command again until the run finishes. After every attempt: no traceback, at most one line
from each rank, status 0 or 75 (or 128 + the signal's number, before anything was saved), a checkpoint of the step
named for every 75; at the end every step logged once and every epoch's samples read once (the sample audit).

    pytest -m slow tests/end_to_end/test_preemption_fuzz.py        # 1 trial per stage (CI)
    pytest -m exhaustive tests/end_to_end/test_preemption_fuzz.py  # 13 trials per stage (docs/reliability.md)

Seeded by the trial number: a failure names the trial, the signal's delay and the output.
"""

from __future__ import annotations

import collections
import glob
import json
import random
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.processes import LAUNCH, REPO, Background
from tests.helpers.shards import write_shard_set

TRAIN = {"train": [30, 18, 24, 24], "val": [8]}  # 96 labelled training samples in uneven shards
SIZE = 96
STAGES = {
    # 16 steps of 8, each followed by an evaluation (the k-NN monitor included: three loaders start their workers),
    # a checkpoint every 5 steps
    "pretrain": ["-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", "train.steps=16", "train.eval_every=1",
                 "train.ckpt_every=5", "knn.train_images=32", "knn.val_images=8"],
    # 8 epochs of 3 steps of 32, each followed by an evaluation, a checkpoint every 5 steps
    "finetune": ["-m", "finetune", "--config", "configs/finetune/tiny.yaml", "init.checkpoint=", "model.img_size=16",
                 "train.batch_size=32", "train.epochs=8", "train.eval_every_epochs=1", "train.ckpt_every=5"],
}
STEPS = {"pretrain": 16, "finetune": 24}
STATUS = re.compile(r"exitcode\s*:\s*(-?\d+)")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shard_set(tmp_path_factory.mktemp("shards"), TRAIN, size=16)


def command(stage: str, shards: Path, run_dir: Path) -> list[str]:
    return [*LAUNCH, *STAGES[stage], f"data.shards={shards}", f"train.run_dir={run_dir}", "data.num_workers=2",
            "train.record_samples=true", "train.log_every=1"]


# Loader workers start slowly, as on a loaded machine (tests/helpers/slow_workers/sitecustomize.py): the window in
# which a signal once killed a starting worker, and the run with it, is then wide enough for a few trials to hit.
SLOW_WORKERS = {"PYTHONPATH": f"{REPO / 'tests' / 'helpers' / 'slow_workers'}:{REPO}",
                "VIT_MPP_TEST_WORKER_START_S": "0.3"}


def attempt(cmd: list[str], log: Path, delay: float | None) -> tuple[int, str]:
    """One launch, signalled after `delay` seconds (None: let it finish); (launcher status, output)."""
    run = Background(cmd, log, log.stem, env=SLOW_WORKERS)
    moment = "not signalled"
    if delay is not None:
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.02)
        moment = what_it_was_doing(run.output())
        run.signal_all(signal.SIGTERM)  # what SLURM does: the launcher, both ranks and their loader workers
    took = run.wait_gone(120)
    print(f"  signalled during {moment}: all gone {took:.1f} s later" if delay is not None else "", end="")
    assert took < 60 or delay is None, f"{took:.1f} s from the signal to the last process gone"
    return run.proc.returncode, run.output()


def what_it_was_doing(out: str) -> str:
    """The run's moment, from its last line: start-up, after a step (its evaluation, a checkpoint or the next
    step), after an evaluation, or the end (the export written)."""
    lines = [line for line in out.splitlines() if line.startswith(("step ", "eval ", "exported", "final "))]
    if not lines:
        return "start-up"
    last = lines[-1]
    if last.startswith(("exported", "final ")):
        return "the end"
    return f"after {' '.join(last.split()[:2])}" if last.startswith("step ") else "after an evaluation"


def check_attempt(out: str, status: int, run_dir: Path) -> int | None:
    """The rules of one attempt; the step a status 75 names (None otherwise)."""
    # the launcher prints its own traceback when it is signalled (torch elastic's SignalException): not ours
    ours = [f'File "{REPO}/{package}/' for package in ("vit_mpp", "pretrain", "finetune", "data_tools")]
    assert not any(frame in out for frame in ours) and "ProcessGroupGloo" not in out, out[-4000:]
    assert "error:" not in out, out[-4000:]
    ranks = [int(s) for s in STATUS.findall(out)]  # the launcher's report of failed ranks (none when all exited 0)
    assert all(s in (75, 128 + signal.SIGTERM, -signal.SIGTERM) for s in ranks), (ranks, out[-4000:])
    preempted = re.findall(r"preempted at step (\d+): ", out)
    assert len(preempted) <= 1 and out.count("preempted") <= 1, out[-4000:]  # one line, from rank 0
    if preempted:
        step = int(preempted[0])
        assert (run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").is_file(), out[-4000:]
        return step
    if status == 0:
        assert "exported" in out, out[-4000:]
    return None


def check_run(run_dir: Path, steps: int) -> None:
    """Every step logged once and trained once per rank; every epoch's samples read once."""
    logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert logged == list(range(1, steps + 1)), logged
    records = [json.loads(line) for f in sorted(glob.glob(str(run_dir / "samples" / "rank_*.jsonl")))
               for line in Path(f).read_text().splitlines()]
    per_step = collections.Counter(r["step"] for r in records)
    assert set(per_step) == set(range(1, steps + 1)) and set(per_step.values()) == {2}, per_step
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        for key, epoch in zip(r["keys"], r["epochs"]):
            seen[epoch][key] += 1
    for epoch, keys in seen.items():
        assert max(keys.values()) == 1, (epoch, [k for k, n in keys.items() if n > 1])
        if epoch < max(seen):
            assert len(keys) == SIZE, (epoch, len(keys))


def fuzz(stage: str, shards: Path, tmp_path: Path, trial: int) -> None:
    rng = random.Random(trial)
    clean = tmp_path / "clean"
    started = time.monotonic()
    status, out = attempt(command(stage, shards, clean), tmp_path / "clean.log", None)
    wall = time.monotonic() - started
    assert status == 0, out[-4000:]
    run_dir = tmp_path / "run"
    for n in range(4):  # signal, then the same command until the run finishes
        delay = rng.uniform(0, wall) if n == 0 else (rng.uniform(0, wall) if rng.random() < 0.5 else None)
        status, out = attempt(command(stage, shards, run_dir), tmp_path / f"attempt{n}.log", delay)
        print(f" | trial {trial} attempt {n}: signal after {delay} s of a {wall:.0f} s run -> status {status}: "
              f"{re.findall(r'preempted[^;]*', out)}")
        try:
            check_attempt(out, status, run_dir)
        except AssertionError as e:
            raise AssertionError(f"trial {trial}, attempt {n}, signal after {delay} s: {e}") from None
        if status == 0 and delay is None:
            break
    else:
        status, out = attempt(command(stage, shards, run_dir), tmp_path / "last.log", None)
        assert status == 0, out[-4000:]
    check_run(run_dir, STEPS[stage])


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("trial", range(1))
def test_preemption_at_a_random_moment(shards, tmp_path, stage, trial):
    fuzz(stage, shards, tmp_path, trial)


@pytest.mark.exhaustive
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("trial", range(1, 14))
def test_preemption_at_a_random_moment_many_times(shards, tmp_path, stage, trial):
    fuzz(stage, shards, tmp_path, trial)
