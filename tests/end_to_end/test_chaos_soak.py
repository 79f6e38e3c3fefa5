"""A chaos soak: cycles of a pretraining or fine-tuning job under vit-mpp-launch (the launcher a scheduler starts),
each hit at a
random moment (uniform over a run's wall time: start-up, steps, evaluations starting their loader workers,
checkpoints, the export) by one fault: SIGTERM or SIGUSR1 to a random process (the launcher, a rank, a loader worker,
every process), kill -9 of a random process, or the run directory's disk filled; then the same command again on a
random layout (1 or 2 processes, 0 to 2 loader workers), with the disk freed, until the run finishes. Checked after
every attempt: its status is 0, 2 or 75 (137 when the launcher itself was killed: the kernel's), with one line from
the rank that met the fault (its peers name it in one line each) and no traceback or stack dump; and at the end:
every step logged once, the losses of a step computed twice on the same layout bit-identical, every epoch's samples
read once (the sample audit). A loader worker hung in its fork (CPython gh-112275, Pythons before 3.11.10) is forked
again after its rank's `warning:` line; the report counts them.

    pytest -m slow tests/end_to_end/test_chaos_soak.py         # 1 soak of up to 4 faults per stage (CI)
    pytest -m exhaustive tests/end_to_end/test_chaos_soak.py   # 10 soaks of up to 5 faults per stage

Seeded by the soak's number: a failure names the soak, the cycle, the fault and the output.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.disks import small_disk
from tests.helpers.processes import JOB_LAUNCHER, REPO, Background, describe
from tests.helpers.runs import epochs_in_audit
from tests.helpers.shards import write_shard_set
from tests.vit_mpp.test_full_disk_writers import fill

TRAIN = {"train": [30, 18, 24, 24], "val": [8]}  # 96 labelled training samples in uneven shards
SIZE = 96
TINY = ["model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2"]  # tiny.yaml's pretraining ViT
STAGES = {
    # 40 steps of 8 (12 an epoch), an evaluation every 5 with the k-NN monitor (three loaders start their workers)
    "pretrain": (40, ["-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", "train.steps=40",
                      "train.eval_every=5", "knn.train_images=16", "knn.val_images=8"]),
    # 8 epochs of 3 steps of 32, each followed by an evaluation (keep-best exports), from scratch
    "finetune": (24, ["-m", "finetune", "--config", "configs/finetune/tiny.yaml", "init.checkpoint=", *TINY,
                      "model.img_size=16", "train.batch_size=32", "train.epochs=8", "train.eval_every_epochs=1"]),
}
# Loader workers start slowly, as on a loaded machine (tests/helpers/slow_workers/sitecustomize.py): the window in
# which a signal once killed a starting worker, and the run with it, is then wide enough to be hit.
SLOW_WORKERS = {"PYTHONPATH": f"{REPO / 'tests' / 'helpers' / 'slow_workers'}:{REPO}",
                "VIT_MPP_TEST_WORKER_START_S": "0.2"}
FAULTS = ("SIGTERM", "SIGUSR1", "SIGKILL", "full disk")
TARGETS = ("launcher", "rank", "loader worker", "every process")
ONE_LINE = re.compile(r"(error: .+|preempted .+; run the same command to (resume|start))")
FORKED_AGAIN = re.compile(r"warning: data-loader worker\(s\) [\d, ]+ did not start within")
FORK_HANG = re.compile(r"error: \[rank \d\] a data-loader worker of this rank sent no batch for [\d.]+ s: stuck")
PEER = re.compile(r"error: \[rank \d\] stopped: (rank \d failed \(its error is above\)|a peer process .+)")


@dataclass(frozen=True)
class Layout:
    processes: int
    workers: int

    def launch(self) -> list[str]:
        common = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if self.processes == 1:
            return [*JOB_LAUNCHER, "--num_processes", "1", *common]
        return [*JOB_LAUNCHER, "--multi_gpu", "--num_processes", "2", "--main_process_port", "0", *common]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shard_set(tmp_path_factory.mktemp("shards"), TRAIN, size=16)


def command(stage: str, layout: Layout, shards: Path, run_dir: Path) -> list[str]:
    return [*layout.launch(), *STAGES[stage][1], f"data.shards={shards}", f"train.run_dir={run_dir}",
            "train.ckpt_every=4", "train.log_every=1", "train.record_samples=true",
            # a loader worker stuck (on a read, or hung in its fork in every try: CPython gh-112275 on Pythons before
            # 3.11.10) is one line after a wait derived from this (vit_mpp/processes/loader_workers.py loader_timeout_s:
            # 80 s), inside the soak's patience
            "data.read_timeout_s=5", f"data.num_workers={layout.workers}"]


def victim(job: Background, target: str, rng: random.Random) -> list[int]:
    """The processes of the job a fault goes to."""
    if target == "launcher":
        return [job.proc.pid]
    everyone = job.pids()
    if target == "every process":
        return everyone
    ranks = [pid for pid in everyone if pid != job.proc.pid and _parent(pid) == job.proc.pid]
    workers = [pid for pid in everyone if pid != job.proc.pid and pid not in ranks]
    pool = ranks if target == "rank" else workers
    return [rng.choice(pool)] if pool else []


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


START_SHARE = 0.4  # of a run's wall time on this machine: start-up, first evaluation's workers, export


def last_step(run_dir: Path) -> int:
    """The last step the run logged (0 for none)."""
    path = run_dir / "metrics.jsonl"
    steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines()] if path.is_file() else []
    return max(steps, default=0)


def check_output(out: str, status: int, fault: str, target: str) -> None:
    """What any attempt may print and end with."""
    for text in ("Traceback", "frame #", "Exception:"):
        assert text not in out, f"{text!r}:\n{out[-4000:]}"
    allowed = {0, 2, 75, 128 + signal.SIGTERM, 128 + signal.SIGUSR1}
    if fault == "SIGKILL" and target in ("launcher", "every process"):
        allowed.add(128 + signal.SIGKILL)
    assert status in allowed or status == -signal.SIGKILL and fault == "SIGKILL", (status, out[-4000:])
    lines = [line for line in out.splitlines() if ONE_LINE.fullmatch(line)]
    own = [line for line in lines if not PEER.fullmatch(line)]
    assert len(own) <= 1, lines  # the one line of the rank that met the fault (or of rank 0 for all)
    if status == 75:
        assert own and "preempted" in own[0], out[-4000:]
    if status == 2:
        assert lines, out[-4000:]  # its own line, or (a rank killed, or stopped alone) its peers' lines


def soak(stage: str, shards: Path, tmp_path: Path, number: int, cycles: int) -> dict[str, collections.Counter]:
    """One soak of `stage` with up to `cycles` faults; returns what it did (faults, statuses) for the report."""
    rng = random.Random(f"{stage}-{number}")
    done: dict[str, collections.Counter] = {"fault": collections.Counter(), "status": collections.Counter()}
    with small_disk(tmp_path / "disk", 32768) as disk:
        run_dir = disk / "run"
        layout = Layout(2, 2)
        started = time.monotonic()
        clean = Background(command(stage, layout, shards, tmp_path / "clean"), tmp_path / "clean.log", f"clean{number}")
        clean.wait_gone(600)
        assert clean.proc.returncode == 0, clean.output()[-4000:]
        done["fault"]["worker forked again"] += len(FORKED_AGAIN.findall(clean.output()))
        wall = time.monotonic() - started
        losses: list[tuple[Layout, dict[int, float]]] = []
        for cycle in range(cycles + 20):
            faulty = cycle < cycles
            fault, target = rng.choice(FAULTS), rng.choice(TARGETS)
            job = Background(command(stage, layout, shards, run_dir), tmp_path / f"attempt{cycle}.log",
                             f"{stage}{number}.{cycle}",
                             env=SLOW_WORKERS)
            hit = "none"
            if faulty:  # a moment of what is left of the run: its start-up, then its steps not yet done
                left = 1 - last_step(run_dir) / STAGES[stage][0]
                deadline = time.monotonic() + rng.uniform(0.2, wall * (START_SHARE + (1 - START_SHARE) * left))
                while time.monotonic() < deadline and job.proc.poll() is None:
                    time.sleep(0.02)
                if job.proc.poll() is None:
                    hit = fault if fault == "full disk" else f"{fault} to {target}"
                    if fault == "full disk":
                        fill(disk)
                    else:
                        for pid in victim(job, target, rng):
                            try:
                                os.kill(pid, getattr(signal, fault))
                            except ProcessLookupError:
                                pass
            try:
                job.wait_gone(180)
            except AssertionError:
                left = [describe(pid) for pid in job.pids()]
                job.kill()
                raise AssertionError(f"{stage} soak {number}, cycle {cycle}, fault {hit}: still running after 180 s: "
                                     f"{left}\n{job.output()[-3000:]}") from None
            status, out = job.proc.returncode, job.output()
            context = f"{stage} soak {number}, cycle {cycle}, {layout}, fault {hit}"
            try:
                check_output(out, status, fault, target)
            except AssertionError as e:
                raise AssertionError(f"{context}: {e}") from None
            print(f"  {context}: status {status}")
            done["fault"][hit.split(" to ")[0] if hit != "none" else "none"] += 1
            done["fault"]["worker forked again"] += len(FORKED_AGAIN.findall(out))
            if FORK_HANG.search(out):
                done["fault"]["worker hung in its fork in every try"] += 1
            done["status"][status] += 1
            if (disk / "filler").exists():
                (disk / "filler").unlink()  # space freed for the next attempt
            if (run_dir / "metrics.jsonl").is_file():
                losses.append((layout, {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl")
                                        .read_text().splitlines()) if "loss" in r}))
            if status == 0 and "run done at step" in out:
                break
            layout = Layout(rng.choice((1, 2)), rng.choice((0, 1, 2)))
        else:
            raise AssertionError(f"soak {number}: the run did not finish")
        check_run(run_dir, losses, STAGES[stage][0])
    return done


def check_run(run_dir: Path, losses: list[tuple[Layout, dict[int, float]]], steps: int) -> None:
    """Every step logged once; a step computed twice on the same layout, the same loss to the bit; every epoch's
    samples read once."""
    logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert logged == list(range(1, steps + 1)), logged
    for (before, old), (after, new) in zip(losses, losses[1:]):
        if before == after:
            again = set(old) & set(new)
            assert all(old[s] == new[s] for s in again), {s: (old[s], new[s]) for s in again if old[s] != new[s]}
    seen = epochs_in_audit(run_dir)
    for epoch, keys in seen.items():
        assert max(keys.values()) == 1, (epoch, [k for k, n in keys.items() if n > 1])
        if epoch < max(seen):
            assert len(keys) == SIZE, (epoch, len(keys))


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_short_chaos_soak(shards, tmp_path, stage):
    print(soak(stage, shards, tmp_path, 0, cycles=4))


@pytest.mark.exhaustive
@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("number", range(1, 11))
def test_a_long_chaos_soak(shards, tmp_path, stage, number):
    print(soak(stage, shards, tmp_path, number, cycles=5))
