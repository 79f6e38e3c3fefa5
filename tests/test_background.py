"""The tests' `Background` helper finds every process of its command (children included) and only those: the kill
tests stand on it, and when it found none their kills did nothing and the runs went on until a timeout."""

from __future__ import annotations

import sys
import time

from tests.helpers.processes import Background, alive

# A parent that starts a child and both sleep: what a launcher and its rank look like to the helper
FAMILY = [sys.executable, "-c",
          "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
          "print('started', flush=True); time.sleep(60)"]


def test_a_command_s_processes_are_found_and_killed_and_another_of_the_same_name_is_left(tmp_path):
    first = Background(FAMILY, tmp_path / "first.log", "same")
    second = Background(FAMILY, tmp_path / "second.log", "same")
    try:
        first.wait_for("started", timeout=60)
        second.wait_for("started", timeout=60)
        deadline = time.monotonic() + 30  # the child may start just after the parent prints
        while (len(first.pids()) < 2 or len(second.pids()) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(first.pids()) == 2 and first.proc.pid in first.pids()
        assert len(second.pids()) == 2 and not set(first.pids()) & set(second.pids())

        survivors = second.pids()
        first.kill()
        first.wait_gone(timeout=30)
        assert first.proc.returncode is not None and not first.pids()
        assert all(alive(pid) for pid in survivors), "a kill by one command's marker reached another's processes"
    finally:
        second.kill()
    second.wait_gone(timeout=30)  # the grandchild too, once the kernel has torn it down
