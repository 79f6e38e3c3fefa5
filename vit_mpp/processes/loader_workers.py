"""A rank's data-loader worker processes, from their fork to their end: `Loader` (a DataLoader whose workers start
with the stop signals blocked, are started again when one hangs in its fork, and are remembered), `end_workers`,
and the wait for a batch (`loader_timeout_s`). The streams they read are vit_mpp/data/stream.py's. See
docs/reliability.md."""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from vit_mpp.config.sections import DataConfig
from vit_mpp.processes.failures import FORK_HANGS
from vit_mpp.processes.rank_lifecycle import before_exit_now, die_with_parent

# The signals a rank's loader workers leave to the rank. A worker is forked with them blocked (`Loader`), so that one
# sent before its first line of Python (a launcher stops a rank's whole process group; a scheduler every process)
# can neither kill it (torch's own SIGTERM handler, installed first thing, ends a worker signalled by anyone but its
# parent) nor raise in it; `init_worker` then ignores them, and hands SIGTERM to a thread that ends the worker when
# its rank sends it.
WORKER_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP})

# A worker forked while another thread of its rank holds CPython's thread-state lock hangs in the fork itself, before
# any line of Python (CPython gh-112275, fixed in 3.10.15, 3.11.10 and 3.12): a C++ thread of torch's that enters
# Python takes that lock without the GIL. Such a worker never starts, its stop signals stay blocked and it never asks
# to die with its rank. So a rank checks that each worker it forks starts (runs a first line of Python) within
# START_WAIT_S, and forks the loader's workers again, up to START_TRIES times in all; after the last, its wait for a
# batch is bounded (`loader_timeout_s`: one line, not a hang). It kills what torch's end of a loader leaves alive:
# when a loader ends or is dropped half-read (the k-NN monitor's), as the process exits (before multiprocessing's
# own exit, which would wait for it forever), and when it ends at once (`exit_now`). The soak found each: a worker
# alive minutes after its rank was preempted, a rank that never exited; the cluster tests a rank that waited 300 s.
# A fork server or spawn would avoid the bug but not pay (benchmarks/loader_start_bench.py): their workers outlive a
# rank killed with -9, a killed worker is heard after the wait, not at once, and a rank holds 1.9-2.7x the memory;
# see docs/reliability.md.
START_WAIT_S = 20.0
START_TRIES = 3
END_WAIT_S = 1.0  # for a worker told to end (SIGTERM) before it is killed
_running: weakref.WeakSet = weakref.WeakSet()  # this process's loader iterators with worker processes
_forked: set = set()  # every worker process those loaders forked, until it is seen ended


def init_worker(worker_id: int, parent: int) -> None:
    """A data-loader worker lives and dies with its rank: the rank decides when to stop (a worker that died of a
    scheduler's signal would fail the run before the rank could save), and a rank killed outright takes its workers
    with it. `parent`: the rank's pid, bound when the loader was made (see `die_with_parent`)."""
    die_with_parent(parent)
    for sig in WORKER_SIGNALS - {signal.SIGTERM}:
        signal.signal(sig, signal.SIG_IGN)
    # SIGTERM stays blocked for the thread below, which sees the sender (multiprocessing stops its children with it)
    signal.pthread_sigmask(signal.SIG_SETMASK, {signal.SIGTERM})
    threading.Thread(target=_sigterm_from_parent_only, args=(parent,), daemon=True).start()
    sys.excepthook = _quiet_fd_server(sys.excepthook)


def _quiet_fd_server(excepthook: Callable[..., Any]) -> Callable[..., Any]:
    """`excepthook`, silent for the connection a worker's fd server (multiprocessing's resource_sharer, which hands
    the rank the shared memory of a batch) loses when the rank stops reading mid hand-over: the rank is ending
    (preempted, failed), and the traceback would bury its one line. Anything else goes to `excepthook`."""
    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and any(
                frame.f_code.co_filename.endswith("resource_sharer.py") for frame, _ in traceback.walk_tb(tb)):
            return
        excepthook(kind, error, tb)

    return hook


def _sigterm_from_parent_only(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)


def _kill(workers: Iterable[Any]) -> None:
    for worker in list(workers):
        if worker.exitcode is None:
            worker.kill()


def end_workers(batches: Any) -> None:
    """End a loader iterator's worker processes: out of torch's watch (a worker it sees killed is an error raised in
    the rank), SIGTERM, SIGKILL to any still alive after END_WAIT_S (one hung in its fork never sees SIGTERM), then
    torch's own end of the iterator."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is None:  # a loader without workers, or one closed already
        return
    _unwatch(batches)
    # They hold nothing to save: ended at once (a worker leaves when its rank sends SIGTERM, with status 0), not
    # asked and then waited for, 5 s each, as torch's own end does with a worker busy on a read.
    for worker in batches._workers:
        if worker.is_alive():
            worker.terminate()
    end = time.monotonic() + END_WAIT_S
    for worker in batches._workers:
        worker.join(max(0.0, end - time.monotonic()))
    _kill(batches._workers)
    shutdown()
    _running.discard(batches)


def _unwatch(batches: Any) -> None:
    """Take a loader iterator's workers out of torch's watch: torch's SIGCHLD handler raises its 'killed by signal'
    error, wherever this process is, for a worker of any iterator it watches that is killed."""
    if batches._worker_pids_set:
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False


@atexit.register
def _end_running() -> None:
    for running in list(_running):
        end_workers(running)
    _kill(_forked)  # those of the iterators already gone: torch forgot them as it ended them


def _end_now() -> None:
    """Kill every worker forked, out of torch's watch first: the process ends right after, and a SIGCHLD meanwhile
    would raise torch's error in its last lines (or, where a test stands in for the exit, in a later loader)."""
    for running in list(_running):
        _unwatch(running)
    _kill(_forked)


before_exit_now(_end_now)


def loader_timeout_s(data: DataConfig) -> float:
    """How long a rank waits for one batch from a loader worker before it takes the worker for stuck: well beyond
    what a worker's reads may take, each under its deadline, retried (data.read_timeout_s, data.read_retries)."""
    return max(60.0, 4 * (data.read_retries + 1) * data.read_timeout_s)


def _started(flags: Any, init: Callable[[int], None] | None, worker_id: int) -> None:
    """A worker's first line of Python: it says it got through its fork, then runs the loader's own init."""
    flags[worker_id] = 1
    if init is not None:
        init(worker_id)


def _not_started(batches: Any, flags: Any, wait_s: float) -> list[int]:
    """The pids of the workers of `batches` still alive that have not started after `wait_s` seconds."""
    end = time.monotonic() + wait_s
    while True:
        late = [w.pid for i, w in enumerate(batches._workers) if not flags[i] and w.exitcode is None]
        if not late or time.monotonic() >= end:
            return late
        time.sleep(0.005)


class Loader(DataLoader):
    """A DataLoader whose worker processes are forked with WORKER_SIGNALS blocked (the mask is inherited; the rank's
    own mask is restored at once: a signal that comes meanwhile waits, and is not lost), checked to have started
    (forked again if one hung in its fork, with the same seed), and remembered (`end_workers`)."""

    def __iter__(self) -> Any:
        forks = self.num_workers > 0 and not (self.persistent_workers and self._iterator is not None)
        if not forks:  # in this process, or the persistent workers' next epoch
            return super().__iter__()
        seed = self.generator.get_state() if self.generator is not None else None
        for attempt in range(1, START_TRIES):
            batches, flags = self._fork()
            hung = _not_started(batches, flags, START_WAIT_S)
            if not hung:
                return batches
            print(f"warning: data-loader worker(s) {', '.join(map(str, hung))} did not start within "
                  f"{START_WAIT_S:g} s: hung in the fork ({FORK_HANGS}); the loader's workers are started again "
                  f"(try {attempt + 1} of {START_TRIES})", file=sys.stderr, flush=True)
            end_workers(batches)
            self._iterator = None  # a persistent loader's next iterator is a new one
            if seed is not None:
                self.generator.set_state(seed)
        return self._fork()[0]  # the last try: its wait for a batch is bounded (loader_timeout_s)

    def _fork(self) -> tuple[Any, Any]:
        flags = multiprocessing.RawArray("b", self.num_workers)
        init = self.worker_init_fn
        self.worker_init_fn = functools.partial(_started, flags, init)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_SIGNALS)
        try:
            batches = super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            self.worker_init_fn = init
        _forked.difference_update([w for w in _forked if w.exitcode is not None])
        _forked.update(batches._workers)
        _running.add(batches)
        return batches, flags

    def _get_iterator(self) -> Any:
        return _WorkerBatches(self) if self.num_workers > 0 else super()._get_iterator()


class _WorkerBatches(_MultiProcessingDataLoaderIter):
    """torch's iterator over worker processes, which kills what its own end leaves alive (a worker hung in its fork
    never sees SIGTERM) once torch has forgotten their pids: also when it is dropped half-read (the k-NN monitor's)
    and ended by its __del__. A finalizer of its own would run before that __del__ when the iterator is collected in
    a reference cycle (an exception's frames), and torch, still watching, raised its 'killed by signal' there."""

    def __del__(self, end: Callable[[Any], None] = end_workers, exit_status: Any = torch.utils.data._utils) -> None:
        # Dropped half-read: its workers ended at once, as `end_workers` does. torch's own end waited 5 s for each
        # worker of an iterator collected in a reference cycle (its word to end never reached them), 20 s for two.
        # `end` and torch's `_utils` bound here for the same reason as `kill` below; nothing while Python exits.
        if not getattr(self, "_shutdown", True) and exit_status.python_exit_status is False:
            end(self)
        super().__del__()

    def _shutdown_workers(self, kill: Callable[[Iterable[Any]], None] = _kill) -> None:
        # `kill` bound here: an iterator that lives to the interpreter's end is ended after this module's names are
        # gone (its workers were killed by then: `_end_running`)
        try:
            super()._shutdown_workers()
        finally:
            kill(self._workers)
