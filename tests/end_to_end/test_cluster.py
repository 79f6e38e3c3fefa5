"""Runs that survive a cluster, with real processes under vit-mpp-launch (two CPU processes with gloo; the statuses
a scheduler reads: tests/end_to_end/test_scheduler.py): a preemption signal to every process saves the step reached
and the run resumes on another layout reading each sample once per epoch (the sample audit shows it); fine-tuning
preempted and resumed the same way; time-based checkpoints; a second signal during the save; automatic restarts
after a rank is killed; one line when a peer fails; no process outlives a killed launcher (torch elastic's own, and
vit-mpp-launch); two "machines" on one host, preempted, then resumed as one."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.processes import JOB_LAUNCH, LAUNCH, Background, run_module, wait_all_gone
from tests.helpers.runs import assert_each_sample_once_per_epoch
from tests.helpers.servers import FaultyHandler, serve_faulty
from tests.helpers.shards import write_shard_set
from vit_mpp.processes.rank_lifecycle import STORE_WATCH_S

TRAIN = {"train": [30, 18, 24, 24], "val": [8]}  # 96 training samples in uneven shards; an epoch is 12 steps of 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shard_set(tmp_path_factory.mktemp("shards"), TRAIN, size=16)


def pretrain_args(shards: Path | str, run_dir: Path, *overrides: str) -> list[str]:
    return ["-m", "pretrain", "--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
            f"train.run_dir={run_dir}", "data.val_split=", "train.record_samples=true", "train.log_every=5",
            "train.ckpt_every=1000", "train.steps=100000", *overrides]


def no_traceback(output: str) -> None:
    """No process of the job prints a traceback or a C++ stack dump."""
    for text in ("Traceback", "frame #", "ProcessGroupGloo"):
        assert text not in output, output[-4000:]


def test_sigterm_to_every_process_saves_the_step_and_one_process_reads_on_each_sample_once(shards, tmp_path):
    run_dir = tmp_path / "run"
    run = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir, "data.num_workers=2")], tmp_path / "log", "sigterm")
    run.wait_for("step 20/")
    run.signal_all(signal.SIGTERM)  # what SLURM does: the launcher, both ranks and their loader workers
    took = run.wait_gone(60)
    print(f"SIGTERM to every process -> all gone in {took:.1f} s")  # docs/benchmarks.md quotes it (pytest -s)
    out = run.output()
    step = int(re.search(r"preempted at step (\d+): checkpoint saved; run the same command to resume", out)[1])
    assert out.count("preempted at step") == 1 and step >= 20 and run.proc.returncode == 75
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").is_file()
    assert took < 30, f"{took:.1f} s from the signal to the last process gone"
    no_traceback(out)

    # The same command on ONE process (and micro-batch 8: the same global batch) continues the epoch.
    resumed = run_module(*pretrain_args(shards, run_dir, "data.num_workers=2", f"train.steps={step + 30}")[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming 2 processes x 2 workers x micro-batch 4 as 1 process x 2 workers x micro-batch 8" in \
        resumed.stdout
    assert assert_each_sample_once_per_epoch(run_dir, step + 30) >= 3


@pytest.mark.slow
def test_fine_tuning_is_preempted_and_resumed_on_one_process_like_pretraining(shards, tmp_path):
    run_dir = tmp_path / "run"
    args = ["-m", "finetune", "--config", "configs/finetune/tiny.yaml", "init.checkpoint=", "model.img_size=16",
            f"data.shards={shards}", f"train.run_dir={run_dir}", "train.record_samples=true", "train.log_every=5",
            "train.ckpt_every=1000", "train.eval_every_epochs=1000"]
    run = Background([*JOB_LAUNCH, *args, "train.epochs=1000"], tmp_path / "log", "finetune")
    run.wait_for("step 15/")
    run.signal_all(signal.SIGTERM)
    run.wait_gone(60)
    out = run.output()
    step = int(re.search(r"preempted at step (\d+): checkpoint saved; run the same command to resume", out)[1])
    assert out.count("preempted at step") == 1 and (run_dir / "checkpoints" / f"step_{step:06d}").is_dir()
    assert run.proc.returncode == 75
    no_traceback(out)
    epochs = step // 12 + 2
    resumed = run_module(*args[1:], f"train.epochs={epochs}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "as 1 process x 1 worker x micro-batch 8" in resumed.stdout
    assert assert_each_sample_once_per_epoch(run_dir, epochs * 12) == epochs - 1


@pytest.mark.slow
def test_one_to_two_processes_and_two_to_one_workers(shards, tmp_path):
    run_dir = tmp_path / "run"
    first = run_module(*pretrain_args(shards, run_dir, "data.num_workers=2", "train.steps=7")[1:])
    assert first.returncode == 0, first.stderr[-3000:]
    second = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir, "data.num_workers=1", "train.steps=40",
                                                 "train.extend=true")], tmp_path / "log", "grow")
    second.wait_gone(300)
    out = second.output()
    assert second.proc.returncode == 0, out[-3000:]
    assert "resuming 1 process x 2 workers x micro-batch 8 as 2 processes x 1 worker x micro-batch 4" in out
    assert assert_each_sample_once_per_epoch(run_dir, 40) >= 3


@pytest.mark.slow
def test_time_based_checkpoints_and_a_second_signal_during_the_save(shards, tmp_path):
    run_dir = tmp_path / "run"
    args = pretrain_args(shards, run_dir, "data.num_workers=1", "train.ckpt_every_minutes=0.01", "train.keep_last=50")
    run = Background([*JOB_LAUNCH, *args], tmp_path / "log", "timed")
    deadline = time.monotonic() + 240  # the clock (0.6 s) is read at checks at most ~2 s apart: wait for 2 saves
    while len(list((run_dir / "checkpoints").glob("step_*/trainer_state.json"))) < 2:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output()[-3000:]
        time.sleep(0.2)
    run.signal_all(signal.SIGUSR1)  # SLURM's scancel --signal=USR1 reaches every process
    time.sleep(0.2)
    run.signal_all(signal.SIGTERM)  # and a second signal, while the step is being saved
    run.wait_gone(60)
    out = run.output()
    step = int(re.search(r"preempted at step (\d+): checkpoint saved", out)[1])
    saved = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
                   if (p / "trainer_state.json").is_file())
    assert saved[-1] == step and len(saved) >= 3  # the clock saved earlier steps, on both ranks alike
    assert run.proc.returncode == 75
    no_traceback(out)
    resumed = run_module(*pretrain_args(shards, run_dir, "data.num_workers=1", f"train.steps={step + 5}")[1:])
    assert resumed.returncode == 0 and f"resuming from {run_dir}/checkpoints/step_{step:06d}" in resumed.stdout


@pytest.mark.slow
def test_a_killed_rank_is_restarted_with_its_group_and_the_run_finishes(shards, tmp_path):
    run_dir = tmp_path / "run"
    args = pretrain_args(shards, run_dir, "data.num_workers=1", "train.steps=60", "train.ckpt_every=10")
    run = Background([*JOB_LAUNCH[:3], "--max_restarts", "1", *JOB_LAUNCH[3:], *args], tmp_path / "log", "restart")
    run.wait_for("step 25/")
    import os

    os.kill(run.rank(1), signal.SIGKILL)
    run.wait_gone(300)
    out = run.output()
    assert run.proc.returncode == 0, out[-4000:]
    assert "resuming from" in out and (run_dir / "export" / "model.safetensors").is_file()
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == sorted(set(logged)) and logged[-1] == 60  # every step logged once
    assert_each_sample_once_per_epoch(run_dir, 60)


def locked(run_dir: Path, shards: Path, tmp_path: Path):
    """A run holding `run_dir` (started before the launch under test)."""
    holder = Background([*LAUNCH[:1], *pretrain_args(shards, run_dir, "data.num_workers=0")], tmp_path / "holder",
                        "holder")
    holder.wait_for("step 5/")
    return holder


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bad shard in rank 1's range", "run dir locked", "hub check on rank 0 only"])
def test_a_failing_rank_is_one_line_and_its_peer_says_so(shards, tmp_path, case):
    run_dir, extra, env, holder = tmp_path / "run", [], {}, None
    if case == "bad shard in rank 1's range":  # rank 1's block ends in a shard shorter than the manifest says
        bad = write_shard_set(tmp_path / "bad", {"train": [16, 16]}, size=16, claimed={"train": [16, 24]})
        extra = [f"data.shards={bad}"]
        failing, peer = 1, 0
    elif case == "run dir locked":
        holder = locked(run_dir, shards, tmp_path)
        failing, peer = 0, 1
    else:
        extra, env = ["export.push_to_hub=someone/model"], {"HF_HUB_OFFLINE": "1"}
        failing, peer = 0, 1
    try:
        run = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir, "data.num_workers=1", *extra)], tmp_path / "log",
                         "failing", env)
        run.wait_gone(180)
    finally:
        if holder is not None:
            holder.kill()
    out = run.output()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert f"error: [rank {peer}] stopped: rank {failing} failed (its error is above)" in errors, out[-3000:]
    assert len(errors) == 2, errors  # the failing rank's own line, then its peer's
    assert run.proc.returncode == 2
    no_traceback(out)


@pytest.mark.slow
def test_a_peer_that_hangs_is_given_up_after_the_collective_timeout(shards, tmp_path):
    run = Background([*JOB_LAUNCH, *pretrain_args(shards, tmp_path / "run", "data.num_workers=0",
                                              "train.collective_timeout_s=5")], tmp_path / "log", "hang")
    run.wait_for("step 10/")
    hung = run.rank(1)
    import os

    os.kill(hung, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
    try:
        deadline = time.monotonic() + 90
        while "error: [rank 0] stopped" not in run.output():
            assert time.monotonic() < deadline, run.output()[-3000:]
            time.sleep(0.5)
    finally:
        run.kill()
    assert "a peer process stopped without an error of its own" in run.output()


@pytest.mark.slow
@pytest.mark.parametrize("launcher, after", [*(("accelerate launch", a) for a in ("first rank", 0.5, 2.0, 4.0, 7.0)),
                                             *(("vit-mpp-launch", a) for a in ("first rank", 2.0, 4.0))])
def test_no_rank_outlives_a_launcher_killed_during_start_up(shards, tmp_path, launcher, after):
    # "first rank": the moment the launcher forks its first rank, the narrowest window (its ranks adopted by init
    # while its store is still served for some milliseconds; tests/vit_mpp/test_launcher.py has it deterministic)
    command = LAUNCH if launcher == "accelerate launch" else JOB_LAUNCH
    run = Background([*command, *pretrain_args(shards, tmp_path / "run", "data.num_workers=1")], tmp_path / "log",
                     f"startup{after}")
    if after == "first rank":
        deadline = time.monotonic() + 120
        while not [pid for pid in run.pids() if pid != run.proc.pid] and time.monotonic() < deadline:
            time.sleep(0.002)
    else:
        time.sleep(after)
    run.proc.kill()  # kill -9 of the launcher alone
    run.proc.wait()
    run.wait_gone(30)  # its ranks (and their workers) follow it


@pytest.mark.slow
def test_the_issues_repro_preempted_at_step_33_on_2x2_resumed_on_1x2_reads_both_epochs_whole(tmp_path):
    # 1,000 images in shards of 130, 2 processes x 2 workers x micro-batch 10 (50 steps an epoch), SIGTERM to the
    # launcher (Kubernetes' way) at step 33, resumed as 1 process x 2 workers x micro-batch 20: once epoch 0 had 990
    # distinct samples and epoch 1, wholly after the resume, 980.
    shards = write_shard_set(tmp_path / "shards", {"train": [130] * 7 + [90], "val": [8]}, size=16)
    run_dir = tmp_path / "run"
    args = pretrain_args(shards, run_dir, "data.num_workers=2", "train.batch_size=20", "train.log_every=1",
                         "train.steps=120")
    first = Background([*JOB_LAUNCH, *args], tmp_path / "first", "repro33")
    first.wait_for("step 33/")
    os.kill(first.proc.pid, signal.SIGTERM)
    first.wait_gone(60)
    assert first.proc.returncode == 75, first.output()[-3000:]
    step = int(re.search(r"preempted at step (\d+)", first.output())[1])
    assert 33 <= step < 50  # inside epoch 0
    resumed = run_module(*args[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming 2 processes x 2 workers x micro-batch 10 as 1 process x 2 workers x micro-batch 20" in \
        resumed.stdout
    assert assert_each_sample_once_per_epoch(run_dir, 120, size=1000) == 2  # epochs 0 and 1 whole


@pytest.mark.slow
def test_a_launcher_killed_mid_run_leaves_a_saved_step_and_no_stack_dump(shards, tmp_path):
    # The chaos soak: vit-mpp-launch killed with -9; its ranks, stopping on the SIGTERM the kernel sends them, asked
    # the store their launcher had served whether a peer had failed, and each printed a C++ stack dump.
    run_dir = tmp_path / "run"
    run = Background([*JOB_LAUNCH, *pretrain_args(shards, run_dir, "data.num_workers=1")], tmp_path / "log", "killed")
    run.wait_for("step 10/")
    time.sleep(STORE_WATCH_S)  # past the ranks' first seconds, when a launcher gone is one line and nothing saved
    run.proc.kill()
    run.proc.wait()
    run.wait_gone(30)
    out = run.output()
    no_traceback(out)
    saved = re.search(r"preempted at step (\d+): checkpoint saved; run the same command to resume", out)
    assert saved, out[-3000:]
    assert (run_dir / "checkpoints" / f"step_{int(saved[1]):06d}" / "trainer_state.json").is_file()


@pytest.mark.slow
def test_two_machines_on_one_host_preempted_then_resumed_as_one(shards, tmp_path):
    run_dir, port = tmp_path / "run", str(29300 + (int(time.time()) % 500))
    machines = [Background([*JOB_LAUNCH[:4], "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(m),
                            "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--mixed_precision", "no",
                            "--dynamo_backend", "no", *pretrain_args(shards, run_dir, "data.num_workers=1")],
                           tmp_path / f"machine{m}", "two-machines") for m in (0, 1)]
    machines[0].wait_for("step 20/")
    machines[0].signal_all(signal.SIGTERM)  # every process of both machines (they share the marker)
    wait_all_gone(machines, 60)
    step = int(re.search(r"preempted at step (\d+)", machines[0].output())[1])
    resumed = run_module(*pretrain_args(shards, run_dir, "data.num_workers=2", f"train.steps={step + 20}")[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming 2 processes x 1 worker x micro-batch 4 as 1 process x 2 workers x micro-batch 8" in \
        resumed.stdout
    assert_each_sample_once_per_epoch(run_dir, step + 20)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_preemption_during_a_stalled_read_saves_the_last_step_long_before_the_read_deadline(shards, tmp_path,
                                                                                              workers):
    # With the default 60 s deadline a rank waited for its stalled read, the launcher's SIGKILL came at 30 s, and
    # everything since the last checkpoint was lost, with no line from any rank. The wait is now cut short.
    with serve_faulty(shards) as base:
        run_dir = tmp_path / "run"
        run = Background([*JOB_LAUNCH, *pretrain_args(base, run_dir, f"data.num_workers={workers}")],
                         tmp_path / "log", f"stalled{workers}")
        run.wait_for("step 10/")
        for name in sorted(os.listdir(shards)):  # from now on, every shard opened sends half of itself, then nothing
            if name.endswith(".tar"):
                FaultyHandler.faults[f"/{name}"] = ("stall", 1000)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len([p for p in FaultyHandler.requests[-20:] if p.endswith(".tar")]) < 2:
            time.sleep(0.2)
        time.sleep(3)  # a rank now waits on a stalled read
        run.signal_all(signal.SIGTERM)
        took = run.wait_gone(60)
    out = run.output()
    print(f"stalled read, {workers} workers: SIGTERM to every process -> all gone in {took:.1f} s")
    step = int(re.search(r"preempted at step (\d+): checkpoint saved", out)[1])
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").is_file()
    assert took < 20, f"{took:.1f} s"  # well inside torch elastic's 30 s, and the read's 60 s deadline
    no_traceback(out)
