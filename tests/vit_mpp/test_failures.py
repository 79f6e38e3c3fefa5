"""What a rank says when another process failed under it (vit_mpp/processes/failures.py): a peer's note outranks the
launcher's SIGTERM that follows it, the note is read with stderr muted without losing a line
(vit_mpp/processes/stderr.py), a broken collective is known by its text, and a loader worker's death or silence is
the rank's one line."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import pytest

from tests.helpers.processes import REPO, subprocess_env
from vit_mpp.processes import failures, stop_signals
from vit_mpp.processes.failures import worker_died

RANK_SCRIPT = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from vit_mpp.processes import failures
from vit_mpp.processes.exits import run_main
from vit_mpp.processes.failures import note_failure

def main(argv):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    if rank == 1:
        note_failure()
        print("error: [rank 1] a shard of mine is bad", file=sys.stderr, flush=True)
        os._exit(2)
    failures.signalled = True  # the launcher's SIGTERM, handled before the broken collective raised
    dist.all_reduce(torch.zeros(1))

run_main(main, [])
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
from vit_mpp.processes.stderr import muted as quiet, say

def muted(entered, hold):
    with quiet():
        entered.set()
        time.sleep(hold)

first, second = threading.Event(), threading.Event()
a = threading.Thread(target=muted, args=(first, 0.3))
a.start()
first.wait()
b = threading.Thread(target=muted, args=(second, 0.6))  # the signal watcher reads the note while the main thread does
b.start()
a.join(); b.join()
say("error: [rank 0] stopped: rank 1 failed (its error is above)")
a = threading.Thread(target=muted, args=(first, 0.5))
first.clear(); a.start(); first.wait()
say("error: said while another thread had stderr muted")
a.join()
with quiet():  # a signal handler of this thread, run inside its own muted read
    say("error: said from inside this thread's muted read")
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

    monkeypatch.setattr(failures, "_store", store)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(failures.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(failures, "_stopping", threading.Lock())  # the line's lock is never released: a fresh one
    failures.stop_if_peer_failed(0.0)  # no wait: the note cannot be read, nothing is said
    assert capsys.readouterr().err == ""
    calls.clear()
    with pytest.raises(SystemExit) as e:
        failures.stop_if_peer_failed(5.0)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: [rank 0] stopped: rank 1 failed (its error is above)"


def test_the_start_up_handler_back_after_the_run_names_the_failed_peer_first(monkeypatch, capsys):
    # slow CI: rank 1 failed; rank 0's broken collective ended its run, whose signal context gave the start-up
    # handler back; torch elastic's SIGTERM then met it, and rank 0 said "preempted during start-up" (exit 143)
    monkeypatch.setattr(failures, "_store", NotedStore)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(failures.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(failures, "_stopping", threading.Lock())
    with pytest.raises(SystemExit) as e:
        stop_signals._stop_during_start_up(signal.SIGTERM, None)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: [rank 0] stopped: rank 1 failed (its error is above)"
    # the signal arriving while this thread prints that line: the handler leaves it to finish
    stop_signals._stop_during_start_up(signal.SIGTERM, None)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("text, broken", [
    ("Application timeout caused pair closure", True),  # slow CI: DDP's buffer broadcast met the hung peer
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", True),
    ("Timed out waiting 5000ms for recv operation to complete", True),
    ("CUDA out of memory", False), ("shape mismatch", False),
])
def test_the_errors_of_a_broken_collective_are_known_by_their_text(text, broken):
    assert failures.names_broken_collective(text) is broken


@pytest.mark.parametrize("text, how", [
    ("DataLoader worker (pid 14856) is killed by signal: Killed. ", "(pid 14856) was killed by signal Killed,"),
    ("DataLoader worker (pid(s) 14539) exited unexpectedly", "(pid 14539) exited unexpectedly,"),
    ("DataLoader worker (pid 7) exited unexpectedly with exit code 1. Details are lost due to multiprocessing.",
     "(pid 7) exited unexpectedly with exit code 1,"),
])
def test_a_loader_worker_killed_from_outside_is_its_ranks_one_line(text, how):
    # A worker killed by the OOM killer (or kill -9) was torch's traceback, raised wherever the rank's main thread
    # was (its SIGCHLD handler: a collective, a step), and rank 0 said only that rank 1 failed.
    died = worker_died(RuntimeError(text))
    assert died is not None and died.rank_local and how in str(died) and "\n" not in str(died)
    assert "run the same command to resume" in str(died)
    assert worker_died(RuntimeError("CUDA out of memory")) is None
    assert worker_died(ValueError(text)) is None


def test_a_loader_worker_that_sends_nothing_for_the_loaders_wait_is_its_ranks_one_line():
    # A worker forked while another thread held CPython's thread-state lock hung in the fork for good (found by the
    # chaos soak on Python 3.11.7): the rank waited for its batch forever, and the worker outlived the run.
    died = worker_died(RuntimeError("DataLoader timed out after 960.0 seconds"))
    assert died is not None and died.rank_local and "sent no batch for 960 s: stuck" in str(died)
    assert "gh-112275" in str(died) and "\n" not in str(died)


def test_a_signal_while_torch_distributed_is_half_imported_finds_no_group(monkeypatch):
    # The slow tests: the launcher's SIGTERM reached rank 0 as it imported torch.distributed, and the start-up's stop
    # asked the half-made module for its group: an AttributeError traceback and status 1 instead of the launcher's
    # line naming the rank that was killed.
    import types

    monkeypatch.setitem(sys.modules, "torch.distributed", types.ModuleType("torch.distributed"))  # no names yet
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert failures._store() is None and failures.failed_peer() is None
    failures.stop_if_peer_failed()  # nothing noted: it returns
