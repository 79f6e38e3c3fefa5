"""Processes die with their parent: loader workers with their rank, build workers with the build, ranks with the
launcher (vit_mpp/launcher.py). The launches themselves are tested in tests/end_to_end/test_cluster.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import REPO, alive, subprocess_env
from vit_mpp.data_stream import make_loader

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


def test_loader_workers_know_their_rank_from_before_the_fork():
    loader = make_loader(range(4), num_workers=1)  # type: ignore[arg-type]
    assert loader.worker_init_fn.keywords == {"parent": os.getpid()}


RANK_SCRIPT = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from vit_mpp import cli, preemption
from vit_mpp.launcher import note_failure

def main(argv):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    if rank == 1:
        note_failure()
        print("error: [rank 1] a shard of mine is bad", file=sys.stderr, flush=True)
        os._exit(2)
    preemption.signalled = True  # the launcher's SIGTERM, handled before the broken collective raised
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
