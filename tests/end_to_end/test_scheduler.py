"""What a scheduler sees (vit-mpp-launch, vit_mpp/processes/job_launcher.py; docs/cluster.md): SIGTERM, SIGUSR1 or
SIGINT, sent to the launcher alone (Kubernetes) or to every process of the job once or twice (SLURM), during the
steps or the start-up, ends the job with status 75 from the process the scheduler started when a checkpoint of the
step named exists, with one line and no traceback or stack dump from any process; and the SLURM and Kubernetes
recipes of docs/cluster.md, run as written under a stand-in of each scheduler (tests/helpers/schedulers.py): the
status the scheduler gets, the requeue, and the requeued job resuming to the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.processes import JOB_LAUNCH, REPO, Background, subprocess_env, wait_all_gone
from tests.helpers.runs import assert_each_sample_once_per_epoch
from tests.helpers.schedulers import Slurm, job_spec, pod_command, pod_failure_action, recipe, with_site_values
from tests.helpers.shards import write_shard_set

TRAIN = {"train": [30, 18, 24, 24], "val": [8]}  # 96 training samples in uneven shards; an epoch is 12 steps of 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shard_set(tmp_path_factory.mktemp("shards"), TRAIN, size=16)


def pretrain_args(shards: Path, run_dir: Path, *overrides: str) -> list[str]:
    return ["-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
            f"train.run_dir={run_dir}", "train.record_samples=true", "train.log_every=1", "train.steps=400",
            "train.eval_every=3", "train.ckpt_every=1000", "data.num_workers=2", "knn.train_images=16", *overrides]


def clean(out: str) -> None:
    """No traceback, no C++ stack dump, no `error:` line, from any process of the job."""
    for text in ("Traceback", "frame #", "Exception", "error:", "Error:"):
        assert text not in out, f"{text!r} in:\n{out[-4000:]}"


def preempted_step(out: str, run_dir: Path) -> int:
    """The step of the job's one `preempted at step N` line, whose checkpoint exists."""
    steps = re.findall(r"preempted at step (\d+): checkpoint saved; run the same command to resume", out)
    assert len(steps) == 1 and out.count("preempted") == 1, out[-4000:]
    assert (run_dir / "checkpoints" / f"step_{int(steps[0]):06d}" / "trainer_state.json").is_file()
    return int(steps[0])


def deliver(job: Background, sig: int, how: str) -> None:
    if how == "launcher":  # Kubernetes: the container's first process
        os.kill(job.proc.pid, sig)
    else:  # SLURM: every process of the step, once or twice
        job.signal_all(sig)
        if how == "every process twice":
            time.sleep(0.3)
            job.signal_all(sig)


CASES = [(sig, how) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
         for how in ("launcher", "every process", "every process twice")]
IN_CI = [(signal.SIGTERM, "launcher"), (signal.SIGUSR1, "every process"), (signal.SIGINT, "every process twice")]


@pytest.mark.parametrize("sig, how", [pytest.param(*case, marks=pytest.mark.slow if case in IN_CI
                                                   else pytest.mark.exhaustive) for case in CASES])
def test_a_preemption_signal_ends_the_job_with_status_75(shards, tmp_path, sig, how):
    run_dir = tmp_path / "run"
    job = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir)], tmp_path / "log", f"sched{sig}{how}")
    job.wait_for("eval step 6 ")  # after an evaluation: the next steps, a checkpoint or the next evaluation
    deliver(job, sig, how)
    job.wait_gone(60)
    out = job.output()
    assert job.proc.returncode == 75, out[-4000:]
    preempted_step(out, run_dir)
    clean(out)


@pytest.mark.parametrize("moment", [pytest.param(0.3, marks=pytest.mark.slow), pytest.param(1.5, marks=pytest.mark
                                                                                            .exhaustive)])
def test_a_signal_during_start_up_says_what_a_rerun_resumes_from(shards, tmp_path, moment):
    run_dir = tmp_path / "run"
    fresh = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir)], tmp_path / "fresh", "fresh")
    time.sleep(moment)  # the launcher's imports (0.3 s) or the ranks' (1.5 s)
    fresh.signal_all(signal.SIGTERM)
    fresh.wait_gone(60)
    assert fresh.proc.returncode == 128 + signal.SIGTERM, fresh.output()[-3000:]
    assert "preempted (SIGTERM) during start-up: nothing was saved; run the same command to start" in fresh.output()
    clean(fresh.output())

    first = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir)], tmp_path / "first", "first")
    first.wait_for("step 3/")
    os.kill(first.proc.pid, signal.SIGTERM)
    first.wait_gone(60)
    step = preempted_step(first.output(), run_dir)
    again = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir)], tmp_path / "again", "again")
    time.sleep(moment)
    os.kill(again.proc.pid, signal.SIGTERM)
    again.wait_gone(60)
    assert again.proc.returncode == 75, again.output()[-3000:]
    assert (f"preempted (SIGTERM) during start-up: nothing new to save; the checkpoint of step {step} is kept; run "
            "the same command to resume") in again.output()
    clean(again.output())


ENDINGS = [("finished", "exported encoder to", "launcher", signal.SIGUSR1, 0),
           ("finished", "exported encoder to", "every process", signal.SIGINT, 0),
           ("preempted", "preempted at step", "launcher", signal.SIGUSR1, 75)]


@pytest.mark.slow
@pytest.mark.parametrize("ending, line, how, sig, status", ENDINGS, ids=[f"{e[0]}-{e[2]}" for e in ENDINGS])
def test_a_job_ends_with_its_status_whatever_signal_comes_as_it_ends(shards, tmp_path, ending, line, how, sig, status):
    # A SLURM job whose --signal=USR1@60 came as its run ended was recorded FAILED and requeued: SIGUSR1 to
    # vit-mpp-launch in its teardown, after the export, gave 138 (a rank, its outcome decided, died of it as Python
    # ended), SIGINT to every process just as the run finished 130 with the run complete, and the launcher itself
    # took a signal after its ranks' 75 as a finished run's and exited 0. A signal every 20 ms from the line on,
    # until the launcher is gone, lands in every moment of the ending.
    run_dir = tmp_path / "run"
    steps = "train.steps=6" if ending == "finished" else "train.steps=400"
    job = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir, steps)], tmp_path / "log", f"end{ending}{how}")
    if ending == "preempted":
        job.wait_for("step 3/")
        os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_for(line)
    while job.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.proc.pid, sig) if how == "launcher" else job.signal_all(sig)
        time.sleep(0.02)
    job.wait_gone(60)
    out = job.output()
    assert job.proc.returncode == status, out[-4000:]
    clean(out)
    if ending == "finished":
        assert "preempted" not in out and (run_dir / "summary.json").is_file(), out[-4000:]
        assert (run_dir / "export" / "model.safetensors").is_file()
    else:
        preempted_step(out, run_dir)


@pytest.mark.slow
def test_a_rank_killed_during_start_up_is_named_by_the_launcher_and_no_rank_says_preempted(shards, tmp_path):
    # The chaos soak: rank 1 killed while the ranks imported; torch elastic stopped rank 0 with SIGTERM, and rank 0
    # said "preempted (SIGTERM) during start-up" while the launcher named rank 0, not the rank that was killed.
    job = Background([*JOB_LAUNCH, *pretrain_args(shards, tmp_path / "run")], tmp_path / "log", "killed-start")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(AssertionError, OSError):
            victim = job.rank(1)
            break
        time.sleep(0.05)
    time.sleep(0.5)  # importing
    assert "step 1/" not in job.output()
    os.kill(victim, signal.SIGKILL)
    job.wait_gone(60)
    out = job.output()
    assert job.proc.returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(("error:", "preempted"))]
    assert lines == ["error: rank 1 was killed by SIGKILL, without a line of its own (its output is above); the newest "
                     "checkpoint of its run is kept: run the same command to resume"], out[-3000:]
    assert "Traceback" not in out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_config(tmp_path: Path, steps: int) -> Path:
    """configs/pretrain/tiny.yaml, `steps` long and recording its samples: the recipes' CONFIG."""
    tiny = (REPO / "configs" / "pretrain" / "tiny.yaml").read_text()
    text = tiny.replace("  steps: 6\n", f"  steps: {steps}\n  record_samples: true\n")
    assert text != tiny
    path = tmp_path / "config.yaml"
    path.write_text(text.replace("  log_every: 2\n", "  log_every: 1\n"))
    return path


def assert_resumed_whole(run_dir: Path, out: str, steps: int) -> None:
    """The requeued job resumed (not started over) and ran to `steps`, every step logged once, every whole epoch's
    samples read once."""
    assert "resuming from" in out, out[-3000:]
    logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(x)]
    assert logged == list(range(1, steps + 1)), logged
    assert_each_sample_once_per_epoch(run_dir, steps)


@pytest.mark.slow
def test_the_slurm_recipe_as_written_requeues_at_the_time_limit_and_the_requeued_job_resumes(shards, tmp_path):
    run_dir, steps = tmp_path / "run", 40
    site = {"RUN": str(run_dir), "SHARDS": str(shards), "CONFIG": str(recipe_config(tmp_path, steps))}
    slurm = Slurm(tmp_path / "slurm", nodes=2)
    batch = slurm.submit(with_site_values(recipe("## SLURM", "bash"), {**site, "MASTER_PORT": str(free_port())}),
                         tmp_path / "job.log")
    batch.wait_for("step 8/")
    slurm.time_limit(batch, grace_s=60)  # USR1 to the batch script, then SIGKILL at the limit
    out = batch.output()
    assert batch.proc.returncode == 75, out[-4000:]  # srun's status: every task (vit-mpp-launch) exited 75
    assert slurm.requeued == ["1000"], out[-3000:]
    preempted_step(out, run_dir)
    clean(out)

    requeued = slurm.submit(with_site_values(recipe("## SLURM", "bash"), {**site, "MASTER_PORT": str(free_port())}),
                            tmp_path / "job.log")
    requeued.wait_gone(300)
    out = requeued.output()
    assert requeued.proc.returncode == 0 and slurm.requeued == ["1000"], out[-4000:]
    assert_resumed_whole(run_dir, out, steps)


@pytest.mark.slow
def test_the_kubernetes_job_as_written_recreates_preempted_pods_and_they_resume(shards, tmp_path):
    run_dir, steps = tmp_path / "run", 40
    config = recipe_config(tmp_path, steps)
    job = job_spec()
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]

    def start_pods(attempt: str) -> list[Background]:
        site = {"NUM_MACHINES": "2", "NUM_PROCESSES": "2", "MASTER_ADDR": "127.0.0.1", "RUN": str(run_dir),
                "SHARDS": str(shards), "CONFIG": str(config), "MASTER_PORT": str(free_port())}
        pods = []
        for index in range(2):
            cmd, env = pod_command(job, index, site)
            site["MASTER_PORT"] = env["MASTER_PORT"]  # one port for both pods
            pods.append(Background(cmd, tmp_path / f"pod{index}-{attempt}.log", f"pod{index}{attempt}", env=env))
        return pods

    pods = start_pods("a")
    pods[0].wait_for("step 8/")
    os.kill(pods[0].proc.pid, signal.SIGTERM)  # node 0 drained: its pod's first process, alone
    deadline = time.monotonic() + grace
    while any(p.pids() for p in pods) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pod in pods:
        pod.kill()  # the grace period is over (they are gone long before)
        assert pod.proc.returncode == 75, pod.output()[-3000:]
        assert pod_failure_action(job, pod.proc.returncode) == "Ignore"  # recreated, not counted
        clean(pod.output())
    preempted_step(pods[0].output(), run_dir)

    pods = start_pods("b")
    wait_all_gone(pods, 300)
    for pod in pods:
        assert pod.proc.returncode == 0 and pod_failure_action(job, 0) == "Succeeded", pod.output()[-3000:]
    assert_resumed_whole(run_dir, pods[0].output(), steps)


def test_the_stand_ins_play_the_schedulers_rules(tmp_path):
    """srun's status is its tasks' highest; scancel signals the step's processes, not the batch script; the
    podFailurePolicy recreates a pod that exited 75 without counting it and counts a failure."""
    slurm = Slurm(tmp_path, nodes=2)
    script = ("srun bash -c 'exit $((SLURM_NODEID + 3))'; echo \"srun said $?\"\n"
              "trap 'echo batch got USR1' USR1\n"
              "srun bash -c 'trap \"echo node $SLURM_NODEID got USR1; exit 0\" USR1; sleep 20 & wait' &\n"
              "sleep 1; scancel --signal=USR1 \"$SLURM_JOB_ID\"; wait; echo \"step said $?\"\n")
    batch = slurm.submit(script, tmp_path / "log")
    batch.wait_gone(30)
    out = batch.output()
    assert "srun said 4" in out and "node 0 got USR1" in out and "node 1 got USR1" in out, out
    assert "batch got USR1" not in out and "step said 0" in out, out
    # `scontrol show hostnames | head -n 1`, as the recipe reads it: a reader that stops early ends it quietly (the
    # stand-in once printed a BrokenPipeError traceback into the job's log)
    read = subprocess.run(f"{slurm.bin / 'scontrol'} show hostnames x | head -n 1", shell=True, capture_output=True,
                          text=True, env={**subprocess_env(), "SLURM_NNODES": "100000"})
    assert read.stdout == "127.0.0.1\n" and read.stderr == "", read.stderr[-500:]
    job = job_spec()
    assert [pod_failure_action(job, s) for s in (0, 75, 2, 137)] == ["Succeeded", "Ignore", "Count", "Count"]
    cmd, env = pod_command(job, 1, {"NUM_MACHINES": "2"})
    assert cmd[:3] == ["vit-mpp-launch", "--multi_gpu", "--num_machines"] and cmd[3] == "2"
    assert cmd[cmd.index("--machine_rank") + 1] == "1" and env["JOB_COMPLETION_INDEX"] == "1"
    env_check = subprocess.run(["bash", "-c", "command -v vit-mpp-launch"], capture_output=True, text=True,
                               env={**subprocess_env(), "PATH": f"{Path(os.sys.executable).parent}:/usr/bin:/bin"})
    assert env_check.returncode == 0  # the command the recipes run is installed


@pytest.mark.slow
def test_a_full_disk_under_the_launcher_is_one_line_and_status_2_and_the_job_goes_on_once_there_is_room(shards,
                                                                                                        tmp_path):
    # safetensors' own full-disk error (`SafetensorError: Error while serializing: I/O error: No space left on
    # device (os error 28)`), from Accelerate's save_state, was a traceback and status 1 on a 6 MiB tmpfs.
    from tests.helpers.disks import small_disk
    from tests.vit_mpp.test_full_disk_writers import fill

    with small_disk(tmp_path / "disk", 8192) as disk:
        run_dir = disk / "run"
        job = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir, "train.ckpt_every=4")], tmp_path / "log",
                         "fulldisk")
        job.wait_for("step 9/")  # the checkpoints of steps 4 and 8 are written
        fill(disk)  # the disk is full from now on: the next write that needs space meets it, in whichever writer
        job.wait_gone(120)
        out = job.output()
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        full = [line for line in errors if "cannot be written: no space left on device; 0.0 MB free there" in line]
        peer = r"error: \[rank \d\] stopped: rank \d failed \(its error is above\)"
        peers = [line for line in errors if re.fullmatch(peer, line)]
        # one line naming the path and the space; a rank that did not meet it itself (a file only rank 0 writes) says
        # which rank did, in one line of its own
        assert job.proc.returncode == 2 and len(full) == 1 and len(full) + len(peers) == len(errors), out[-4000:]
        assert "Traceback" not in out and "frame #" not in out and "SafetensorError" not in out, out[-4000:]
        saved = sorted((run_dir / "checkpoints").glob("step_*"))
        assert saved and all((p / "trainer_state.json").is_file() for p in saved), saved
        (disk / "filler").unlink()
        again = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir, "train.ckpt_every=4", "train.steps=20")],
                           tmp_path / "again", "fulldisk2")
        again.wait_gone(300)
        assert again.proc.returncode == 0 and "resuming from" in again.output(), again.output()[-3000:]
