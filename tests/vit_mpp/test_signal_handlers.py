"""vit_mpp/processes/signal_handlers.py `deferred`: a signal's Python handler runs where the block says, not inside a
lock's Python code (a KeyboardInterrupt there turned a Ctrl-C of build-shards index into `RuntimeError: release
unlocked lock` and a traceback)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest

from vit_mpp.processes.signal_handlers import deferred


@pytest.fixture
def ctrl_c_raises():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_during_a_futures_wait_raises_at_run_pending_not_inside_the_wait(ctrl_c_raises):
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(time.sleep, 0.6)
        reached = []
        with pytest.raises(KeyboardInterrupt):
            with deferred([signal.SIGINT]) as run_pending:
                threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
                done, _ = wait([slow], timeout=5, return_when=FIRST_COMPLETED)
                reached.append(done == {slow})  # the wait was not cut short by the signal
                run_pending()
                reached.append("after run_pending")
        assert reached == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_noted_after_the_last_check_runs_as_the_block_ends(ctrl_c_raises):
    with pytest.raises(KeyboardInterrupt):
        with deferred([signal.SIGINT]):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python runs the (noting) handler here
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_commands_own_handler_runs_at_run_pending_with_its_signal():
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda sig, frame: seen.append(sig))
    try:
        with deferred([signal.SIGUSR1]) as run_pending:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert seen == []
            run_pending()
            assert seen == [signal.SIGUSR1]
            run_pending()  # once only
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_an_ignored_signal_stays_ignored_and_an_exception_leaves_nothing_pending(ctrl_c_raises):
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with deferred([signal.SIGUSR2]) as run_pending:
            assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR2)
            run_pending()
        with pytest.raises(ValueError):  # the block's own error is the one raised, not a Ctrl-C noted beside it
            with deferred([signal.SIGINT]):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                raise ValueError("the block's own")
    finally:
        signal.signal(signal.SIGUSR2, before)
