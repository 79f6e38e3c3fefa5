"""Processes die with their parent: loader workers with their rank, build workers with the build, ranks with the
launcher (vit_mpp/processes/rank_lifecycle.py). The launches themselves are tested in
tests/end_to_end/test_cluster.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import REPO, alive, subprocess_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def test_a_parent_gone_before_the_kernel_was_asked_ends_the_child_at_once():
    # A loader worker outlived its rank: the rank was killed while it started the evaluation's workers, and the
    # worker, reading its parent only once it ran, took the reaper (pid 1) for its parent. The parent is now what
    # the rank knew before the fork; a child whose parent is no longer that pid exits.
    code = ("import os; from vit_mpp.processes.rank_lifecycle import die_with_parent; die_with_parent({pid}); "
            "print('alive')")
    gone = subprocess.run([sys.executable, "-c", code.format(pid=os.getpid() + 10**6)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "alive" not in gone.stdout, gone.stderr
    mine = subprocess.run([sys.executable, "-c", code.format(pid=os.getpid())], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert mine.returncode == 0 and mine.stdout.strip() == "alive", mine.stderr


def test_a_child_dies_with_its_parent_killed_after_asking():
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import os, time; from vit_mpp.processes.rank_lifecycle "
              "import die_with_parent; die_with_parent(%d); print(os.getpid(), flush=True); time.sleep(60)' % "
              "os.getpid()], stdout=subprocess.PIPE, text=True)\n"
              "print(child.stdout.readline().strip(), flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    parent = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True,
                            text=True, timeout=60)
    child = int(parent.stdout.strip())
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, f"pid {child} outlived its parent"
        time.sleep(0.05)


ADOPTED = """
import os, sys, time
if os.fork():
    os._exit(0)  # the launcher dies before its rank watches it: init adopts the rank
deadline = time.monotonic() + 10
while os.getppid() != 1 and time.monotonic() < deadline:
    time.sleep(0.01)
if os.getppid() != 1:
    print("not adopted by init", flush=True)
    os._exit(0)
from vit_mpp.processes.rank_lifecycle import die_with_launcher
die_with_launcher()
print("alive", flush=True)
"""


@pytest.mark.parametrize("serving", [False, True])
def test_a_rank_adopted_by_init_before_it_watched_its_launcher_ends_unless_the_launcher_serves(serving):
    # CI: the launcher, killed 2 s into a run, died between its ranks' start and their first line; init adopted
    # them, the kernel was asked to signal them at the death of init, and they waited forever for the launcher's
    # store. Init as the launcher (a container's first process) is told apart by the store it serves.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if not serving:
        listener.close()
    env = {**subprocess_env(), "TORCHELASTIC_RUN_ID": "t", "GROUP_RANK": "0", "RANK": "3",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        out = subprocess.run([sys.executable, "-c", ADOPTED], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=60)
    finally:
        listener.close()
    if "not adopted by init" in out.stdout:
        pytest.skip("orphans go to a subreaper here, not to init")
    if serving:
        assert out.stdout.strip() == "alive" and not out.stderr, out.stderr
    else:
        assert "alive" not in out.stdout, out.stdout
        assert out.stderr.strip() == (f"error: [rank 3] the launcher is gone (nothing serves its store at "
                                      f"127.0.0.1:{port}); this rank stops"), out.stderr


WATCHING = """
import sys, time
from vit_mpp.processes import rank_lifecycle
rank_lifecycle.STORE_WATCH_S = 1.5
rank_lifecycle.die_with_launcher()
print("watching", flush=True)
time.sleep(float(sys.argv[1]))
print("alive", flush=True)
"""


@pytest.mark.parametrize("store_closes", [True, False])
def test_a_rank_on_node_0_ends_when_its_launchers_store_goes_away_during_its_start(store_closes):
    # CI: the launcher was killed as its ranks started; its first thread's exit gave them to init while its other
    # threads still held its store open, so both ranks found the store served, and then waited for it until the
    # collective timeout. The store is now watched for the first seconds of a rank, whoever its parent is.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    env = {**subprocess_env(), "TORCHELASTIC_RUN_ID": "t", "GROUP_RANK": "0", "RANK": "1",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    rank = subprocess.Popen([sys.executable, "-c", WATCHING, "3"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "watching"
        if store_closes:
            listener.close()
        out, err = rank.communicate(timeout=60)
    finally:
        listener.close()
        rank.kill()
    if store_closes:
        assert rank.returncode == 1 and "alive" not in out, (out, err)
        assert err.strip() == (f"error: [rank 1] the launcher is gone (nothing serves its store at "
                               f"127.0.0.1:{port}); this rank stops"), err
    else:  # a launcher that serves is never taken for gone, and the watch ends
        assert rank.returncode == 0 and out.strip() == "alive" and not err, (out, err)


RANK_ENDING = """
import os, signal, sys, threading, time
from vit_mpp.processes.rank_lifecycle import quiet_after_the_outcome

class AsPythonEnds:  # a signal after Python gave the signals their default action back, as its modules are cleared
    def __del__(self, kill=os.kill, pid=os.getpid(), sleep=time.sleep, sig=signal.{sig}):
        kill(pid, sig)
        sleep(0.3)

at_the_end = AsPythonEnds()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # one of torch's threads, say
quiet_after_the_outcome({status})
sys.exit({status})
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGINT"])
@pytest.mark.parametrize("status", [0, 75])
def test_a_rank_ends_with_its_decided_outcome_whatever_signal_comes_as_python_ends(sig, status):
    # SIGINT to every process just as a run finished gave 130 with the run complete, and SIGUSR1 to the launcher in
    # its teardown 138: a rank kept the signals blocked in its main thread only as Python ended, and a thread of
    # torch's took one once Python had given it its default action back
    result = subprocess.run([sys.executable, "-c", RANK_ENDING.format(sig=sig, status=status)], cwd=REPO,
                            env={**subprocess_env(), "VIT_MPP_LAUNCH": "1"}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == status and not result.stderr, result.stderr[-3000:]


DONE = """
import os, signal, time
from vit_mpp.processes.stop_signals import StopSignals, start_up_resumes_from, stop_during_start_up

stop_during_start_up()
start_up_resumes_from(lambda: 6)  # the run directory holds the checkpoint of step 6
with StopSignals(["SIGTERM", "SIGUSR1", "SIGINT"]):
    pass  # the run, to its end
os.kill(os.getpid(), signal.SIGUSR1)  # before its entry point has said it is done
time.sleep(0.3)
print("the signal was not acted on", flush=True)
"""


def test_a_run_done_is_status_0_to_a_signal_that_comes_before_its_process_ends():
    # The run's own handlers gave the start-up's back as the run ended: a signal then said "preempted during
    # start-up: the checkpoint of step 6 is kept" and exited 75, the run complete
    result = subprocess.run([sys.executable, "-c", DONE], cwd=REPO, env={**subprocess_env(), "VIT_MPP_LAUNCH": "1"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout and not result.stderr, result.stdout + result.stderr
