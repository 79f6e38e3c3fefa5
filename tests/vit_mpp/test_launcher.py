"""Processes die with their parent: loader workers with their rank, build workers with the build, ranks with the
launcher (vit_mpp/launcher.py). The launches themselves are tested in tests/end_to_end/test_cluster.py."""

from __future__ import annotations

import os
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
