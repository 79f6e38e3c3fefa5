"""Shard ranges, the unit of parallel work: a worker turns a range of inputs into finished, named tars
(`write_range`). Ranges are cut by `--shard-size` before anything is read, so the cut never depends on the images,
the workers, the executor or the number of parts; image bytes never pass between processes.
See docs/build_shards.md#shards.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from data_tools.builder.shard_layout import sample_key, shard_name
from data_tools.builder.sources.base import Item
from data_tools.builder.writer import ShardWriter
from vit_mpp.data import deadlines
from vit_mpp.data.image_prep import BadImage, EncodeSettings, clean_detail, prepare_image
from vit_mpp.durable import write_failed
from vit_mpp.processes.rank_lifecycle import die_with_parent

# PIL frees every image's memory by default, and glibc may give it back to the kernel (munmap, or a trim of the heap)
# only for the next image to fault it in again: 148 page faults an image and 20-25% of a worker's CPU with the
# benchmark's 320x240 JPEGs, or nothing, depending on the allocator's state the process inherited. Kept in PIL's own
# cache, a few freed blocks (at most 16 MiB each: 64 MiB a worker at most) serve the next image's decode, conversion
# and resize without a fault. The pixels are the same.
PIL_BLOCKS = 4


@dataclass(frozen=True)
class RangeTask:
    """Range `index` of `split`: inputs `items`, which start at position `start` of the shuffled split."""

    split: str
    index: int
    start: int
    items: list[Item]
    shard_bytes: int  # 0: one tar per range
    group: int | None = None  # the plan part (--plan-parts), which names its shards and keys

    @property
    def end(self) -> int:
        return self.start + len(self.items)


@dataclass(frozen=True)
class WorkContext:
    """What every range task of a build needs (picklable: sent once to each worker process or Ray task)."""

    reader: Any  # the source's reader: read_many(refs) -> bytes or OSError per ref
    settings: EncodeSettings


def _prepare(data: bytes | OSError, settings: EncodeSettings) -> tuple:
    """Prepare one input's bytes: ("ok", bytes, ext, w, h) or ("fail", reason, detail)."""
    if isinstance(data, OSError):
        return ("fail", "unreadable", clean_detail(f"{type(data).__name__}: {data.strerror or data}"))
    try:
        return ("ok", *prepare_image(data, settings))
    except BadImage as e:
        return ("fail", e.reason, e.detail)


def sample_files(result: tuple, item: Item) -> dict[str, bytes]:
    """The files of one sample: the image, `.cls` when labelled, `.json` metadata."""
    _, data, ext, w, h = result
    files = {ext: data}
    if item.label >= 0:
        files["cls"] = str(item.label).encode()
    # json.dumps({"source", "label", "width", "height"}, sort_keys=True) written out: the same bytes (ints and one
    # string, encoded by json), without building and sorting a dict for every sample.
    files["json"] = f'{{"height": {h:d}, "label": {item.label:d}, "source": {json.dumps(item.source_id)}, ' \
                    f'"width": {w:d}}}'.encode()
    return files


class RangeAbandoned(Exception):
    """The main process asked the workers to stop while this one waited on a read (`deadlines.while_waiting`)."""


def _leave_if_stopped(stop: Any) -> None:
    if stop.value:
        raise RangeAbandoned


def _finish(writer: ShardWriter) -> dict:
    count, size, digest = writer.finish(sync=False)  # synced by whoever publishes it (store.publish), off the
    # worker's time: a worker never waits for the disk
    return {"filename": writer.path.name, "count": count, "bytes": size, "sha256": digest, "tmp": str(writer.tmp)}


def write_range(task: RangeTask, ctx: WorkContext, staging: Path, tick: Callable[[], None] = lambda: None,
                stopped: Callable[[], bool] = lambda: False) -> dict | None:
    """Write the inputs of `task` to temporary tars in `staging`; returns the range's record (its shards, each with
    its temporary file in `tmp`, and its failures), or None when `stopped()` turned true (the tars are removed). A
    write that fails (a full disk) removes the range's temporary tars and is the one-line WriteFailed: the ranges
    finished before are kept, and the same command resumes once there is space."""
    try:
        return _write_range(task, ctx, staging, tick, stopped)
    except OSError as e:
        stem = shard_name(task.split, task.index, None, task.group).removesuffix(".tar")
        for tmp in Path(staging).glob(f"{stem}*.tar.tmp"):
            tmp.unlink(missing_ok=True)
        raise write_failed(Path(staging) / f"{stem}.tar", e, getattr(e, "needed", None)) from None


def _write_range(task: RangeTask, ctx: WorkContext, staging: Path, tick: Callable[[], None],
                 stopped: Callable[[], bool]) -> dict | None:
    Image.MAX_IMAGE_PIXELS = ctx.settings.max_pixels  # PIL's own bomb check (at twice this) must not be stricter
    if Image.core.get_blocks_max() < PIL_BLOCKS:
        Image.core.set_blocks_max(PIL_BLOCKS)
    shards: list[dict] = []
    failures: list[dict] = []
    writer: ShardWriter | None = None
    unlabelled = 0  # samples written without a label (--unlabelled-rows keep), for the split's count
    refs = [item.ref for item in task.items]
    inputs = zip(range(task.start, task.end), task.items, ctx.reader.read_many(refs))
    while True:
        try:
            position, item, data = next(inputs, (None, None, None))
        except RangeAbandoned:  # asked to stop while a read waited (a stalled remote image, say)
            position = None
        if position is None or stopped():
            break
        result = _prepare(data, ctx.settings)
        tick()
        if result[0] == "fail":
            failures.append({"source": item.source_id, "split": task.split, "reason": result[1],
                             "detail": result[2]})
            continue
        if writer is None:
            piece = len(shards) if task.shard_bytes else None
            writer = ShardWriter(Path(staging) / shard_name(task.split, task.index, piece, task.group))
        writer.write(sample_key(task.split, position, task.group), sample_files(result, item))
        unlabelled += item.label < 0
        if task.shard_bytes and writer.bytes_written >= task.shard_bytes and position + 1 < task.end:
            shards.append(_finish(writer))
            writer = None
    if writer is not None:
        shards.append(_finish(writer))
    if stopped():
        for shard in shards:
            Path(shard["tmp"]).unlink(missing_ok=True)
        return None
    group = {} if task.group is None else {"group": task.group}
    return {"type": "range", **group, "split": task.split, "range": task.index, "start": task.start,
            "end": task.end, "shards": shards, "unlabelled": unlabelled, "failures": failures}


# ---------------------------------------------------------------- local worker processes

_state: dict[str, Any] = {}


def _exit_with_parent(parent: int) -> None:
    """Where the kernel cannot be asked (not Linux): leave within a second of the main process."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def init_worker(ctx: WorkContext, staging: Path, done: Any, stop: Any, parent: int) -> None:
    """Pool initializer: what every range task of this build needs. Ctrl-C reaches the whole process group; the
    main process alone handles it (it tells the workers to stop through `stop`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _state.update(ctx=ctx, staging=Path(staging), done=done, stop=stop)
    deadlines.while_waiting(functools.partial(_leave_if_stopped, stop))  # a waiting read is left when asked to stop
    # Pool workers wait on a pipe forever if the main process is killed (kill -9), and keep its scratch folder
    # locked (data_tools/scratch.py): they die with it.
    if not die_with_parent(parent):
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _tick() -> None:
    with _state["done"].get_lock():
        _state["done"].value += 1


def run_task(task: RangeTask) -> dict | None:
    """Worker process: one range (see `write_range`)."""
    return write_range(task, _state["ctx"], _state["staging"], _tick, lambda: bool(_state["stop"].value))
