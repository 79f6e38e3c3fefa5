"""One shard of `build-shards index`, read in a worker (`index_shard`): its samples counted as webdataset groups them
(by vit_mpp/data/tar_scan.py, as training reads them), image extensions and labels tallied, and with `verify` every
image decoded; the result is a small `ShardIndex`, the counts or what makes the shard unusable.
See docs/build_shards.md#indexing-shards-you-already-have.
"""

from __future__ import annotations

import functools
import signal
import threading
import urllib.error
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from data_tools.decode_check import KeyTally
from data_tools.indexer.read_ahead import ReadAhead
from vit_mpp.data import deadlines, urls
from vit_mpp.data.image_formats import IMAGE_EXTENSIONS, image_member
from vit_mpp.data.labels import BadLabel, cls_label
from vit_mpp.data.tar_scan import TarDamaged, TarReader, describe, samples
from vit_mpp.data.urls import ReadPolicy

IMAGES = frozenset(IMAGE_EXTENSIONS)
DAMAGED, MISSING, UNREADABLE = "damaged", "missing", "unreadable"


@dataclass
class ShardIndex:
    """What one shard holds, or why it cannot be used (`problem` and `reason`)."""

    url: str
    bytes: int = 0
    samples: int = 0
    images: Counter = field(default_factory=Counter)  # image extension -> samples read through it
    labelled: int = 0
    label_min: int | None = None
    label_max: int | None = None
    no_image: KeyTally = field(default_factory=KeyTally)
    bad_label: KeyTally = field(default_factory=KeyTally)  # a .cls that is not an integer, or too large
    undecodable: KeyTally | None = None  # with verify only
    problem: str = ""
    reason: str = ""

    def add_label(self, raw: bytes, key: str) -> None:
        """Count a `.cls` as training reads it (vit_mpp/data/labels.py: negative is none, a bad one is recorded)."""
        try:
            label = cls_label(raw)
        except BadLabel as e:
            self.bad_label.add(key, str(e))
            return
        if label < 0:
            return
        self.labelled += 1
        self.label_min = label if self.label_min is None else min(self.label_min, label)
        self.label_max = label if self.label_max is None else max(self.label_max, label)


class Abandoned(Exception):
    """The main process asked the workers to stop (another shard failed, or Ctrl-C)."""


_shared = threading.local()  # this worker's progress counter and stop flag (`init_worker`); none outside a pool


def init_worker(counter: Any, stop: Any, process: bool) -> None:
    """Pool initializer, run in the thread that will run this worker's tasks: the shared byte counter and stop
    flag; a worker process leaves Ctrl-C to the main one, and SIGTERM ends it (not the handler it was forked with)."""
    _shared.counter, _shared.stop = counter, stop
    # a stalled read is left when the workers are asked to stop, not at its deadline (the check runs in the threads
    # that wait for this worker, so it holds the flag itself, not through this thread's `_shared`)
    deadlines.while_waiting(functools.partial(_abandon_if, stop))
    if process:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _count(n: int) -> None:
    counter = getattr(_shared, "counter", None)
    if counter is not None:
        with counter.get_lock():
            counter.value += n


def _abandon_if(stop: Any) -> None:
    """Abandoned when the main process asked the workers to stop (`stop` set)."""
    if stop is not None and stop.value:
        raise Abandoned


def _progress(n: int) -> None:
    """Count `n` bytes read; stop here when the main process asked the workers to stop."""
    _count(n)
    _abandon_if(getattr(_shared, "stop", None))


class _Attempt:
    """The bytes one attempt at a shard has read, counted into the shared counter as they come, and taken back out
    when the attempt fails (a retry reads them again)."""

    def __init__(self) -> None:
        self.read = 0

    def __call__(self, n: int) -> None:
        self.read += n
        _progress(n)

    def undo(self) -> None:
        _count(-self.read)


def _scan(stream: BinaryIO, url: str, verify: bool) -> ShardIndex:
    """Count one shard's samples from its stream with the Python reader (one attempt)."""
    result = ShardIndex(url, undecodable=KeyTally() if verify else None)
    attempt = _Attempt()
    ahead = ReadAhead(stream)
    reader = TarReader(ahead, attempt)
    wanted = IMAGES | {"cls"} if verify else frozenset({"cls"})
    try:
        for sample in samples(reader, wanted):
            result.samples += 1
            ext = image_member(sample)
            if ext is None:
                result.no_image.add(sample.key)
            else:
                result.images[ext] += 1
                if result.undecodable is not None:
                    result.undecodable.check(sample.key, sample.data[ext])
            if "cls" in sample.data:
                result.add_label(sample.data["cls"], sample.key)
        reader.drain()
    except BaseException:
        attempt.undo()
        raise
    finally:
        ahead.close()
    result.bytes = reader.bytes_read
    return result


def index_shard(url: str, verify: bool = False, read: ReadPolicy = ReadPolicy()) -> ShardIndex:
    """The `ShardIndex` of the shard at `url` (a path or URL); never raises for a bad shard, only when abandoned."""
    try:
        return urls.read_stream(url, lambda stream: _scan(stream, url, verify), read.timeout, read.retries,
                                read.wait_s)
    except TarDamaged as e:
        return ShardIndex(url, problem=DAMAGED, reason=describe(e))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return ShardIndex(url, problem=MISSING, reason="no such file")
    except urllib.error.HTTPError as e:
        kind = MISSING if e.code in (404, 410) else UNREADABLE
        return ShardIndex(url, problem=kind, reason=f"HTTP {e.code} {e.reason}")
    except OSError as e:
        tries = f" ({read.retries + 1} attempts)" if urls.worth_retrying(url, e) else ""  # as read_stream retried
        return ShardIndex(url, problem=UNREADABLE, reason=f"{describe(e)}{tries}")
