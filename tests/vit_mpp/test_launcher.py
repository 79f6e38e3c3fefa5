"""Processes die with their parent: loader workers with their rank, build workers with the build, ranks with the
launcher (vit_mpp/launcher.py). The launches themselves are tested in tests/end_to_end/test_cluster.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers.processes import REPO, alive, subprocess_env
from vit_mpp import launcher
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.stream import make_loader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def test_a_parent_gone_before_the_kernel_was_asked_ends_the_child_at_once():
    # A loader worker outlived its rank: the rank was killed while it started the evaluation's workers, and the
    # worker, reading its parent only once it ran, took the reaper (pid 1) for its parent. The parent is now what
    # the rank knew before the fork; a child whose parent is no longer that pid exits.
    code = "import os; from vit_mpp.launcher import die_with_parent; die_with_parent({pid}); print('alive')"
    gone = subprocess.run([sys.executable, "-c", code.format(pid=os.getpid() + 10**6)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "alive" not in gone.stdout, gone.stderr
    mine = subprocess.run([sys.executable, "-c", code.format(pid=os.getpid())], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert mine.returncode == 0 and mine.stdout.strip() == "alive", mine.stderr


def test_a_child_dies_with_its_parent_killed_after_asking():
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import os, time; from vit_mpp.launcher import "
              "die_with_parent; die_with_parent(%d); print(os.getpid(), flush=True); time.sleep(60)' % os.getpid()],"
              " stdout=subprocess.PIPE, text=True)\n"
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
from vit_mpp.launcher import die_with_launcher
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
from vit_mpp import launcher
launcher.STORE_WATCH_S = 1.5
launcher.die_with_launcher()
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


def test_loader_workers_know_their_rank_from_before_the_fork():
    loader = make_loader(range(4), DataConfig(num_workers=1))  # type: ignore[arg-type]
    assert loader.worker_init_fn.keywords == {"parent": os.getpid()}


RANK_SCRIPT = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from vit_mpp import cli, launcher
from vit_mpp.launcher import note_failure

def main(argv):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    if rank == 1:
        note_failure()
        print("error: [rank 1] a shard of mine is bad", file=sys.stderr, flush=True)
        os._exit(2)
    launcher.signalled = True  # the launcher's SIGTERM, handled before the broken collective raised
    dist.all_reduce(torch.zeros(1))

cli.run_main(main, [])
"""


def test_a_peer_failure_outranks_the_launchers_sigterm_that_follows_it():
    # CI: rank 1 failed; torch elastic sent SIGTERM to rank 0 while its all-reduce was breaking; the handler ran
    # first, and rank 0 took the broken collective for a preemption: exit 75, no line. The peer's failure comes first.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], cwd=REPO, stderr=subprocess.PIPE, text=True,
                              env={**subprocess_env(), "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in (0, 1)]
    errors = [p.communicate(timeout=120)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], errors
    assert errors[0].strip().splitlines() == ["error: [rank 0] stopped: rank 1 failed (its error is above)"], errors


QUIET_SCRIPT = """
import sys, threading, time
from vit_mpp import launcher

def muted(entered, hold):
    with launcher._store_client_quiet():
        entered.set()
        time.sleep(hold)

first, second = threading.Event(), threading.Event()
a = threading.Thread(target=muted, args=(first, 0.3))
a.start()
first.wait()
b = threading.Thread(target=muted, args=(second, 0.6))  # the signal watcher reads the note while the main thread does
b.start()
a.join(); b.join()
launcher.say("error: [rank 0] stopped: rank 1 failed (its error is above)")
a = threading.Thread(target=muted, args=(first, 0.5))
first.clear(); a.start(); first.wait()
launcher.say("error: said while another thread had stderr muted")
a.join()
with launcher._store_client_quiet():  # a signal handler of this thread, run inside its own muted read
    launcher.say("error: said from inside this thread's muted read")
"""


def test_a_ranks_line_is_never_lost_to_two_threads_muting_stderr_at_once():
    # A cluster test under load: rank 0 ended with status 2 and no word. Its main thread (the broken collective) and
    # its signal watcher (the launcher's SIGTERM) both read the peer's note with stderr muted; the second saved the
    # first's /dev/null as the stderr to restore, and the line went there.
    proc = subprocess.run([sys.executable, "-c", QUIET_SCRIPT], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["error: [rank 0] stopped: rank 1 failed (its error is above)",
                                        "error: said while another thread had stderr muted",
                                        "error: said from inside this thread's muted read"], proc.stderr


class NotedStore:
    """A store holding the note of rank 1's failure."""

    def set_timeout(self, timeout) -> None:
        pass

    def check(self, keys) -> bool:
        return True

    def get(self, key) -> bytes:
        return b"1"


def test_a_signal_while_the_group_is_being_made_waits_for_it_to_read_the_peers_note(monkeypatch, capsys):
    # slow CI: rank 0 failed a check only it runs right after the group was made; torch elastic stopped rank 1 while
    # rank 1 was still finishing its part of making it, so rank 1 could not read the note and stopped without a word
    calls = []

    def store():
        calls.append(1)
        return None if len(calls) < 4 else NotedStore()  # the group is up on the 4th look

    monkeypatch.setattr(launcher, "_store", store)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(launcher.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(launcher, "_stopping", threading.Lock())  # the line's lock is never released: a fresh one
    launcher.stop_if_peer_failed(0.0)  # no wait: the note cannot be read, nothing is said
    assert capsys.readouterr().err == ""
    calls.clear()
    with pytest.raises(SystemExit) as e:
        launcher.stop_if_peer_failed(5.0)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: [rank 0] stopped: rank 1 failed (its error is above)"


def test_the_start_up_handler_back_after_the_run_names_the_failed_peer_first(monkeypatch, capsys):
    # slow CI: rank 1 failed; rank 0's broken collective ended its run, whose signal context gave the start-up
    # handler back; torch elastic's SIGTERM then met it, and rank 0 said "preempted during start-up" (exit 143)
    monkeypatch.setattr(launcher, "_store", NotedStore)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(launcher.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(launcher, "_stopping", threading.Lock())
    with pytest.raises(SystemExit) as e:
        launcher._stop_during_start_up(signal.SIGTERM, None)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: [rank 0] stopped: rank 1 failed (its error is above)"
    # the signal arriving while this thread prints that line: the handler leaves it to finish
    launcher._stop_during_start_up(signal.SIGTERM, None)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("text, broken", [
    ("Application timeout caused pair closure", True),  # slow CI: DDP's buffer broadcast met the hung peer
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", True),
    ("Timed out waiting 5000ms for recv operation to complete", True),
    ("CUDA out of memory", False), ("shape mismatch", False),
])
def test_the_errors_of_a_broken_collective_are_known_by_their_text(text, broken):
    assert launcher.names_broken_collective(text) is broken


class _Slow(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(3):
            time.sleep(0.05)
            yield torch.tensor([i])


def test_loader_workers_signalled_as_they_start_live_on():
    # SIGTERM at the start of an evaluation killed the run: its loader started new workers, and a worker signalled
    # before its init (a launcher stops a rank's whole process group) was ended by torch's own handler. Workers now
    # start with the stop signals blocked.
    loader = make_loader(_Slow(), DataConfig(num_workers=2, persistent_workers=False))  # type: ignore[arg-type]
    init = loader.worker_init_fn
    loader.worker_init_fn = lambda worker: (time.sleep(1.0), init(worker))  # a slow start: the signal comes in it
    it = iter(loader)
    time.sleep(0.3)
    workers = [w.pid for w in it._workers]
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        subprocess.run(["kill", f"-{sig.name[3:]}", *map(str, workers)], check=True)  # not from their parent
    assert sorted(int(b) for b in it) == [0, 0, 1, 1, 2, 2]  # both workers read on


@pytest.mark.parametrize("text, how", [
    ("DataLoader worker (pid 14856) is killed by signal: Killed. ", "(pid 14856) was killed by signal Killed,"),
    ("DataLoader worker (pid(s) 14539) exited unexpectedly", "(pid 14539) exited unexpectedly,"),
    ("DataLoader worker (pid 7) exited unexpectedly with exit code 1. Details are lost due to multiprocessing.",
     "(pid 7) exited unexpectedly with exit code 1,"),
])
def test_a_loader_worker_killed_from_outside_is_its_ranks_one_line(text, how):
    # A worker killed by the OOM killer (or kill -9) was torch's traceback, raised wherever the rank's main thread
    # was (its SIGCHLD handler: a collective, a step), and rank 0 said only that rank 1 failed.
    died = launcher.worker_died(RuntimeError(text))
    assert died is not None and died.rank_local and how in str(died) and "\n" not in str(died)
    assert "run the same command to resume" in str(died)
    assert launcher.worker_died(RuntimeError("CUDA out of memory")) is None
    assert launcher.worker_died(ValueError(text)) is None


def test_a_loader_worker_that_sends_nothing_for_the_loaders_wait_is_its_ranks_one_line():
    # A worker forked while another thread held CPython's thread-state lock hung in the fork for good (found by the
    # chaos soak on Python 3.11.7): the rank waited for its batch forever, and the worker outlived the run.
    died = launcher.worker_died(RuntimeError("DataLoader timed out after 960.0 seconds"))
    assert died is not None and died.rank_local and "sent no batch for 960 s: stuck" in str(died)
    assert "gh-112275" in str(died) and "\n" not in str(died)
