"""vit-mpp-launch (vit_mpp/processes/job_launcher.py) without ranks: its own bad inputs are one `error:` line and
status 2 before any rank starts, and it exits as its ranks did, whatever signal comes as it ends. Its launches, and
how it passes a scheduler's signals on: tests/end_to_end/test_scheduler.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.processes import JOB_LAUNCHER, REPO, subprocess_env
from tests.helpers.shards import write_shard_set
from vit_mpp.config.fsdp_settings import DEEPSPEED_REFUSED


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shard_set(tmp_path_factory.mktemp("shards"), {"train": [16, 16]}, size=16)


@pytest.mark.parametrize("flags, line", [
    (["--num_processes", "0", "-m", "pretrain"], "error: --num_processes 0: a launch needs at least one process"),
    (["--num_processes", "-1", "-m", "pretrain"], "error: --num_processes -1: a launch needs at least one process"),
    (["--config_file", "nowhere/accelerate.yaml", "-m", "pretrain"],
     "error: --config_file nowhere/accelerate.yaml: no such file"),
    (["-m", "nosuchmodule"], "error: -m nosuchmodule: no such module here"),
    (["-m", "pretrain.nosuchmodule"], "error: -m pretrain.nosuchmodule: no such module here"),
    (["nosuchscript.py"], "error: nosuchscript.py: no such script"),
    (["--use_deepspeed", "-m", "pretrain"], "error: the accelerate config asks for DeepSpeed, which this tool does "
                                            "not run"),
])
def test_a_bad_launch_is_one_line_and_status_2_before_any_rank_starts(shards, tmp_path, flags, line):
    # Tried as a hostile user would: --num_processes 0 (and -1) trained on one process with status 0; a missing
    # --config_file was one line and status 1; -m nosuchmodule was status 1 and no `error:` line
    run_dir = tmp_path / "run"
    result = subprocess.run([*JOB_LAUNCHER, *flags, "--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}",
                             f"train.run_dir={run_dir}", "train.steps=2"], capture_output=True, text=True, cwd=REPO,
                            env=subprocess_env(), timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), result.stderr[-3000:]
    assert not run_dir.exists()  # no rank started


def deepspeed_default_config(root):
    """`accelerate config`'s default file asking for DeepSpeed, where Accelerate looks with HF_HOME=root/hf."""
    config = root / "hf" / "accelerate" / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                      "deepspeed_config: {zero_stage: 2}\nnum_processes: 1\n")
    return config


@pytest.mark.parametrize("where", ["--config_file", "the default config"])
def test_a_deepspeed_accelerate_config_is_one_line_before_any_rank_starts(shards, tmp_path, where):
    # Accelerate 1.x's DeepSpeed integration needs transformers, which the tool does not install: each rank was a
    # traceback in Accelerator() (or, without deepspeed, the launcher's ImportError). A config Accelerate reads
    # without being named, `accelerate config`'s default file, counts too.
    config = deepspeed_default_config(tmp_path)
    flags = ["--config_file", str(config)] if where == "--config_file" else []
    run_dir = tmp_path / "run"
    result = subprocess.run([*JOB_LAUNCHER, *flags, "-m", "pretrain", "--config", "configs/pretrain/tiny.yaml",
                             f"data.shards={shards}", f"train.run_dir={run_dir}"], capture_output=True, text=True,
                            cwd=REPO, env={**subprocess_env(), "HF_HOME": str(tmp_path / "hf")}, timeout=300)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {DEEPSPEED_REFUSED}"], \
        result.stderr[-3000:]
    assert not run_dir.exists()


def test_a_deepspeed_default_config_is_not_what_a_launch_flag_overrides(tmp_path):
    # As Accelerate's launcher decides: a flag that chooses the kind of launch (--multi_gpu, --use_fsdp) wins over
    # the config file's distributed_type, and --cpu skips the default file; those launches are not refused.
    deepspeed_default_config(tmp_path)
    check = ("from accelerate.commands.launch import launch_command_parser\n"
             "from vit_mpp.processes.job_launcher import asks_for_deepspeed\n"
             "for flags in ([], ['--multi_gpu', '--num_processes', '2'], ['--use_fsdp'], ['--cpu'],\n"
             "              ['--config_file', 'configs/accelerate/fsdp_vit_large.yaml']):\n"
             "    print(asks_for_deepspeed(launch_command_parser().parse_args([*flags, '-m', 'pretrain'])))\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**subprocess_env(), "HF_HOME": str(tmp_path / "hf")})
    assert result.stdout.split() == ["True", "False", "False", "False", "False"], result.stderr[-3000:]


def test_a_launch_of_a_module_or_a_folder_that_is_there_is_not_refused():
    from vit_mpp.processes.job_launcher import module_found

    assert module_found("pretrain") and module_found("vit_mpp.processes.job_launcher") and module_found("json.tool")
    assert not module_found("pretrain.nosuch") and not module_found("nosuch.pretrain") and not module_found("")


ENDING = """
import os, signal, subprocess, sys, time
import accelerate.commands.launch

def ranks(args):  # the ranks ran, and ended with this status
    if {status}:
        raise subprocess.CalledProcessError({status}, ["python", "-m", "pretrain"])

accelerate.commands.launch.launch_command = ranks
from vit_mpp.processes.job_launcher import main

class AsPythonEnds:  # a signal after Python gave the signals their default action back, as its modules are cleared
    def __del__(self, kill=os.kill, pid=os.getpid(), sleep=time.sleep, sig=signal.SIGUSR1):
        kill(pid, sig)
        sleep(0.3)

at_the_end = AsPythonEnds()
status = main(["--num_processes", "1", "-m", "pretrain"])
os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler's, as the launcher ends
time.sleep(0.3)
sys.exit(status)
"""


@pytest.mark.parametrize("status", [0, 2, 75])
def test_the_launcher_exits_as_its_ranks_did_whatever_signal_comes_as_it_ends(status):
    # A SLURM job whose USR1 came as its run ended was recorded FAILED and requeued: the launcher, its ranks done,
    # took the signal as a rank's decided outcome (a rank's handler: exit 0, whatever its ranks' status), or died of
    # it once Python had given it its default action back (138)
    result = subprocess.run([sys.executable, "-c", ENDING.format(status=status)], capture_output=True, text=True,
                            cwd=REPO, env=subprocess_env(), timeout=120)
    assert result.returncode == status, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
