"""Executors: who runs the range tasks of a build; both yield each finished range's record as it completes.
`LocalExecutor` (`--executor local`): worker processes on this machine, one that dies stopping the build with
`WorkerDied` instead of a hang; `RayExecutor` (`--executor ray`, the `[ray]` extra): one Ray task per range, each
publishing its own shards. See docs/build_shards.md#ray-one-command-a-cluster.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from data_tools.builder.shard_ranges import RangeTask, WorkContext, init_worker, run_task, write_range
from data_tools.stops import BuildStopped, WorkerDied
from data_tools.store import LocalStore, RemoteStore
from vit_mpp.errors import UserError


def _describe(task: RangeTask) -> str:
    return f"{task.split} range {task.index} (inputs {task.start}-{task.end - 1})"


class LocalExecutor:
    """Range tasks in `workers` processes on this machine; temporary tars go to `staging`."""

    def __init__(self, ctx: WorkContext, staging: Any, workers: int) -> None:
        self.ctx, self.staging, self.workers = ctx, staging, workers
        self.mp = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.done = self.mp.Value("q", 0)  # inputs processed by the workers, for the progress bar
        self.stop = self.mp.Value("b", 0)  # set on an error or Ctrl-C: workers abandon their range

    def __enter__(self) -> LocalExecutor:
        self.pool = ProcessPoolExecutor(self.workers, mp_context=self.mp, initializer=init_worker,
                                        initargs=(self.ctx, self.staging, self.done, self.stop, os.getpid()))
        self.pool.submit(os.getpid).result()  # fork the workers now, before the progress bar starts its thread
        return self

    def processed(self) -> int:
        return self.done.value

    def results(self, tasks: Iterator[RangeTask], room: Callable[[], bool], idle: Callable[[], None],
                ) -> Iterator[dict]:
        """Records of finished ranges in completion order. At most 2 x workers ranges are in flight (their item
        lists are the only per-input data in memory), and none is started while `room()` is false."""
        pending: dict[Future, RangeTask] = {}
        exhausted = False
        while True:
            try:
                while not exhausted and len(pending) < 2 * self.workers and room():
                    task = next(tasks, None)
                    if task is None:
                        exhausted = True
                    else:
                        pending[self.pool.submit(run_task, task)] = task
                if not pending:
                    if exhausted:
                        return
                    idle()  # waiting for room (uploads to finish)
                    continue
                done, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                idle()
                records, failed = [], None
                for future in done:
                    task = pending.pop(future)
                    if future.exception() is None:
                        records.append(future.result())
                    elif failed is None:
                        failed = future
                if failed is not None:  # the ranges that finished beside it are committed first, then it stops
                    yield from (r for r in records if r is not None)
                    failed.result()
            except BrokenProcessPool:  # from submit() or result(): the pool lost a worker
                first = next(iter(pending.values()), None)
                example = f" (e.g. {_describe(first)})" if first is not None else ""
                raise WorkerDied(
                    f"a worker process died while writing one of {len(pending) + 1} ranges in flight{example}; "
                    "killed for memory, or a crash in an image decoder. Finished shards are kept: re-run the same "
                    "command to continue") from None
            yield from (r for r in records if r is not None)

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:
            self.stop.value = 1  # running ranges stop at their next image
        self.pool.shutdown(wait=True, cancel_futures=True)


def ray_range(task: RangeTask, ctx: WorkContext, store: LocalStore | RemoteStore) -> dict:
    """Ray task: write one range to the node's staging folder, publish its shards, return the record."""
    record = write_range(task, ctx, store.staging())
    for shard in record["shards"]:
        store.publish(shard.pop("tmp"), shard["filename"])
    return record


def require_ray() -> Any:
    """The ray module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError("--executor ray needs Ray: pip install 'vit-mpp[ray]'") from None
    return ray


class RayExecutor:
    """Range tasks as Ray tasks; OUT must be reachable from every node (an object store, or a shared folder)."""

    def __init__(self, ctx: WorkContext, store: LocalStore | RemoteStore) -> None:
        self.ctx, self.store = ctx, store
        self.finished_inputs = 0
        self.started_ray = False

    def __enter__(self) -> RayExecutor:
        self.ray = ray = require_ray()
        if not ray.is_initialized():
            try:
                ray.init(logging_level="WARNING", log_to_driver=False)  # RAY_ADDRESS, if set, names the cluster
            except Exception as e:  # ConnectionError and others: the cluster named cannot be reached
                raise UserError(f"--executor ray: cannot start or reach a Ray cluster: {type(e).__name__}: {e}"
                                ) from None
            self.started_ray = True
        self.remote = ray.remote(num_cpus=1, max_retries=3)(ray_range)
        self.ctx_ref = ray.put(self.ctx)
        self.capacity = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.pending: dict[Any, RangeTask] = {}
        return self

    def processed(self) -> int:
        return self.finished_inputs

    def results(self, tasks: Iterator[RangeTask], room: Callable[[], bool], idle: Callable[[], None],
                ) -> Iterator[dict]:
        ray = self.ray
        exhausted = False
        while True:
            while not exhausted and len(self.pending) < 2 * self.capacity and room():
                task = next(tasks, None)
                if task is None:
                    exhausted = True
                else:
                    self.pending[self.remote.remote(task, self.ctx_ref, self.store)] = task
            if not self.pending:
                if exhausted:
                    return
                idle()
                continue
            done, _ = ray.wait(list(self.pending), num_returns=1, timeout=0.25)
            idle()
            for ref in done:
                task = self.pending.pop(ref)
                try:
                    record = ray.get(ref)
                except ray.exceptions.RayError as e:
                    cause = " ".join(str(getattr(e, "cause", None) or e).split())[:300]
                    raise BuildStopped(f"the Ray task for {_describe(task)} failed: {type(e).__name__}: {cause}. "
                                       "Finished shards are kept: re-run the same command to continue") from None
                self.finished_inputs += task.end - task.start
                yield record

    def __exit__(self, *exc: Any) -> None:
        for ref in self.pending:
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # already finished or gone
                pass
        self.pending = {}
        if self.started_ray:
            self.ray.shutdown()
