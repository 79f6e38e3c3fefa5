"""Reading raw samples (member extension -> bytes, plus `__key__`) from webdataset shards by sample range, with
deadlines: `range_segments` turns a range of a split into pieces of shards, `read_segment` reads one, reopening a
stream that breaks or stalls and refusing a shard shorter than its manifest says. Only the image and `.cls` members
are held; nothing is decoded. See docs/data_stream.md."""

from __future__ import annotations

import http.client
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vit_mpp.data import tar_scan, urls
from vit_mpp.data.image_formats import IMAGE_EXTENSIONS
from vit_mpp.data.manifest import Split
from vit_mpp.errors import UserError


class DataError(UserError):
    """The data cannot feed training as configured (too few samples, too many bad ones); one-line message."""


class ShardError(DataError):
    """A shard in this rank's own range is unreadable, shorter than the manifest says, or too often undecodable."""

    rank_local = True


@dataclass(frozen=True)
class Segment:
    """Samples [start, stop) of one shard, which the manifest says holds `length` samples."""

    url: str
    start: int
    stop: int
    length: int


def range_segments(split: Split, order: list[int], start: int, stop: int) -> list[Segment]:
    """The pieces of shards that make up samples [start, stop) of the virtual sequence of shards in `order`."""
    segments, offset = [], 0
    for i in order:
        n = split.lengths[i]
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            segments.append(Segment(split.urls[i], lo - offset, hi - offset, n))
        offset += n
        if offset >= stop:
            break
    return segments


# A remote stream that breaks mid-shard (connection reset, truncated body, a stall past its deadline, a failed
# command), or a local file that stalls (a hung network mount), is reopened `urls.READ_RETRIES` times, after
# `urls.WAIT_S`, then twice that, and so on; the samples already yielded are skipped, not repeated.
STREAM_ERRORS = (OSError, tar_scan.TarDamaged, http.client.HTTPException)


def read_segment(seg: Segment, retries: int = urls.READ_RETRIES, wait_s: float = urls.WAIT_S,
                 timeout: float = urls.READ_TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """Raw samples (dicts of extension -> bytes for READ_MEMBERS, plus `__key__`) of one shard segment; nothing is
    decoded.

    A remote shard whose stream breaks or stalls (no byte for `timeout` seconds), or a local one that stalls, is
    reopened (`retries` times) and read on from the next sample. A shard that still ends before the segment does
    (truncated, manifest out of date) is a ShardError: yielding fewer samples would leave this rank with fewer steps
    than the others, and the run would hang in a collective. A shard with more samples than the manifest says is
    read up to the manifest's count, with a warning.
    """
    position, attempt = seg.start, 0  # position: the next sample to yield
    while True:
        error: Exception | None = None
        samples = _samples(seg.url, timeout)
        try:
            count = 0
            for sample in samples:
                if count >= seg.stop:
                    if seg.stop == seg.length:  # a sample past the manifest's count: say so, once per shard
                        _warn_once(seg.url, f"warning: shard {seg.url} holds more samples than the manifest's "
                                            f"{seg.length}; the extra ones are not read (rebuild the manifest with "
                                            "build-shards to use them)")
                    break
                if count >= position:
                    yield sample
                    position += 1
                count += 1
            samples.close()  # now, not when collected: closing the stream can fail too (a curl exit status)
        except STREAM_ERRORS as e:
            error = e
        finally:
            samples.close()
        if position >= seg.stop:
            return
        # A shard that ended early without an error is read again only from a remote server (a body cut short
        # without notice); a local one stays short.
        again = not urls.is_local(seg.url) if error is None else urls.worth_retrying(seg.url, error)
        if attempt >= retries or not again:
            tries = f" ({attempt + 1} attempts)" if attempt else ""
            if error is not None:
                what = "cannot be read" if urls.is_local(seg.url) else "the stream broke"
                # an error whose args carry more than its message (a url, a stream): the message is what a user needs
                text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
                reason = " ".join(f"{type(error).__name__}: {text}".split())  # one line
                raise ShardError(f"shard {seg.url}: {what} after sample {position} of {seg.stop}{tries}: {reason}")
            raise ShardError(f"shard {seg.url} holds only {position} samples but the manifest says at least "
                            f"{seg.stop}{tries}: the shard is truncated or the manifest is out of date")
        time.sleep(wait_s * 2**attempt)
        attempt += 1


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(message, file=sys.stderr, flush=True)


# The members a sample is read for: its image and its label. Shards others wrote often hold more (a caption, a
# metadata .json, an embedding, a video beside the frame); those are passed over in the stream, never held.
READ_MEMBERS: frozenset[str] = frozenset((*IMAGE_EXTENSIONS, "cls"))


def _samples(url: str, timeout: float = urls.READ_TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """Every raw sample of one shard, in order, as webdataset groups them: {__key__, __url__, and the bytes of its
    READ_MEMBERS}. Read with the reader `build-shards index` counts with (vit_mpp/data/tar_scan.py), so the stream meets
    the samples the manifest counted; other members cost no memory (a sample with no image keeps its key, and is
    counted and reported), and damage is TarDamaged, never a quietly short shard."""
    stream = urls.open_url(url, timeout)
    try:
        for sample in tar_scan.samples(tar_scan.TarReader(stream), READ_MEMBERS):
            yield {"__key__": sample.key, "__url__": url, **sample.data}
    finally:
        stream.close()


def shuffled(samples: Iterator[dict[str, Any]], size: int, rng: random.Random) -> Iterator[dict[str, Any]]:
    """A shuffle buffer of `size` encoded samples (bytes, so memory stays small)."""
    if size <= 1:
        yield from samples
        return
    buf: list[dict[str, Any]] = []
    for s in samples:
        if len(buf) < size:
            buf.append(s)
            continue
        j = rng.randrange(size)
        buf[j], s = s, buf[j]
        yield s
    rng.shuffle(buf)
    yield from buf
