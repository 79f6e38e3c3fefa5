"""Shard ranges, the unit of parallel work: each worker process turns a range of inputs into finished tars.

A split's inputs (in their shuffled order) are cut into ranges by `--shard-size` before anything is read, so the
cut never depends on the images or on `--workers`. A worker reads, checks and encodes the images of one range and
writes them to a temporary tar in OUT_DIR; `--shard-bytes` may split a range into several tars. The main process
only renames the finished tars, in range order, to their final names and journals them. Image bytes never pass
between processes, so the main process stays idle and the speed-up follows the number of cores.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from data_tools.images import BadImage, EncodeSettings, prepare_image
from data_tools.sources import Item
from data_tools.writer import ShardWriter

# Inputs per range when --shard-size is 0 (shards limited by --shard-bytes only): ranges are what workers share.
BYTES_ONLY_RANGE = 10_000


@dataclass(frozen=True)
class RangeTask:
    """Inputs `items` of `split`, which start at position `start` of the shuffled split."""

    split: str
    start: int
    items: list[Item]
    shard_bytes: int  # 0: one tar per range

    @property
    def end(self) -> int:
        return self.start + len(self.items)


def plan_ranges(total: int, shard_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering `total` inputs, as few as `shard_size` allows and balanced by count:
    2500 inputs by 1000 -> 834, 833, 833, so ranges of a split differ by at most one input."""
    size = shard_size or BYTES_ONLY_RANGE
    if total <= 0:
        return []
    n = math.ceil(total / size)
    base, extra = divmod(total, n)
    bounds, start = [], 0
    for k in range(n):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def whole_ranges(records: list[dict], ranges: list[tuple[int, int]]) -> list[dict]:
    """The leading `records` of one split that cover whole ranges. A range split by --shard-bytes is journaled as
    several records; if a kill left only some of them, the range is dropped and written again."""
    ends = {end for _, end in ranges}
    kept, covered = [], 0
    for i, rec in enumerate(records):
        if rec["start"] != covered:
            break
        covered = rec["end"]
        if covered in ends:
            kept = records[: i + 1]
    return kept


# ---------------------------------------------------------------- worker processes

_reader = None
_settings: EncodeSettings | None = None
_out_dir: Path | None = None
_done = None  # shared count of inputs processed, for the progress bar


def _exit_with_parent(parent: int) -> None:
    """Pool workers wait on a pipe forever if the main process is killed (kill -9); leave when it is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def init_worker(reader, settings: EncodeSettings, out_dir: Path, done, parent: int) -> None:
    """Pool initializer: what every range task of this build needs."""
    global _reader, _settings, _out_dir, _done
    _reader, _settings, _out_dir, _done = reader, settings, Path(out_dir), done
    Image.MAX_IMAGE_PIXELS = settings.max_pixels  # PIL's own bomb check (at twice this) must not be stricter than ours
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()


def _prepare(ref: str | int) -> tuple:
    """Read and prepare one input: ("ok", bytes, ext, w, h) or ("fail", reason, detail)."""
    try:
        data = _reader.read(ref)
    except OSError as e:
        return ("fail", "unreadable", f"{type(e).__name__}: {e}")
    try:
        return ("ok", *prepare_image(data, _settings))
    except BadImage as e:
        return ("fail", e.reason, e.detail)


def sample_files(result: tuple, item: Item) -> dict[str, bytes]:
    """The files of one sample: the image, `.cls` when labelled, `.json` metadata."""
    _, data, ext, w, h = result
    files = {ext: data}
    if item.label >= 0:
        files["cls"] = str(item.label).encode()
    meta = {"source": item.source_id, "label": item.label, "width": w, "height": h}
    files["json"] = json.dumps(meta, sort_keys=True).encode()
    return files


def _part(split: str, start: int, end: int, writer: ShardWriter | None, failures: list[dict]) -> dict:
    """The record of one finished tar of a range (`tmp`: its temporary file; None when every input failed)."""
    if writer is None:
        return {"split": split, "start": start, "end": end, "count": 0, "bytes": 0, "sha256": "",
                "failures": failures, "tmp": None}
    count, size, digest = writer.finish()
    return {"split": split, "start": start, "end": end, "count": count, "bytes": size, "sha256": digest,
            "failures": failures, "tmp": writer.tmp.name}


def write_range(task: RangeTask) -> list[dict]:
    """Worker: write the inputs of `task` to temporary tars in OUT_DIR; returns one record per tar, in order."""
    parts: list[dict] = []
    part_start, writer, failures = task.start, None, []
    for i, item in enumerate(task.items, start=task.start):
        result = _prepare(item.ref)
        with _done.get_lock():
            _done.value += 1
        if result[0] == "fail":
            failures.append({"source": item.source_id, "split": task.split, "reason": result[1], "detail": result[2]})
            continue
        if writer is None:
            writer = ShardWriter(_out_dir / f"{task.split}-part{task.start:09d}-{len(parts)}.tar")
        writer.write(f"{task.split}_{i:09d}", sample_files(result, item))
        if task.shard_bytes and writer.bytes_written >= task.shard_bytes and i + 1 < task.end:
            parts.append(_part(task.split, part_start, i + 1, writer, failures))
            part_start, writer, failures = i + 1, None, []
    parts.append(_part(task.split, part_start, task.end, writer, failures))
    return parts
