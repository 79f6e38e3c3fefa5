"""The training and evaluation input streams over webdataset shards, shared by pretrain and finetune.

How the work is split (the part that keeps many processes in step):

* Each epoch, the split's shards are put in an order drawn from `seed + epoch` (the same on every rank) and
  seen as one virtual sequence of samples whose length the manifest gives, without scanning a tar.
* Every data-loader worker of every rank (G = processes x workers in all) gets one contiguous, equal-length
  range of that sequence. A range may start or end inside a shard: the worker skips the samples before its
  range without decoding them. So the shard count need not divide anything, and fewer shards than G works
  (each such shard is read by several workers, which costs I/O, not correctness; rank 0 prints a warning).
* Training: each range holds `floor(N / (G * B)) * B` samples, so every worker yields the same number of full
  batches and every rank runs the same number of steps; the tail (fewer than G * B samples, a different one each
  epoch since the shard order changes) is left for that epoch. No sample is seen twice in an epoch.
* Evaluation: ranges of `ceil(N / G)` samples, in manifest order; short ranges are padded with blank samples
  whose `valid` flag is False, so every rank runs the same number of batches and each sample counts once.
* A shard that holds fewer samples than the manifest says is a DataError, never a short range: one rank with
  fewer steps than the others would hang the run in a collective. Undecodable samples are replaced (training) or
  marked invalid (evaluation) in place, so they cannot desynchronise the ranks either; more than
  `max_bad_fraction` of them (checked from the 100th sample of a worker's range, and at its end) is a DataError.
* Remote reads have deadlines (vit_mpp/urls.py): a stalled stream is aborted and reopened, then a ShardError.

Batches leave the workers as uint8 images (B, 3, H, W); `to_device` moves them (non-blocking) and
`normalize` turns them into float on the device, so the MPP targets can be computed from the raw pixels.
The loader is deliberately *not* passed through `accelerator.prepare`: it already splits itself across ranks, and
accelerate would either re-split it or make rank 0 decode for everyone.
"""

from __future__ import annotations

import http.client
import io
import math
import random
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2 as T
from torchvision.transforms.v2.functional import pil_to_tensor

from vit_mpp import urls
from vit_mpp.config import DataConfig
from vit_mpp.errors import UserError
from vit_mpp.image_formats import IMAGE_EXTENSIONS, image_member
from vit_mpp.manifest import Split
from vit_mpp.models import img_hw


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


def epoch_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The shard order of an epoch: the same on every rank, different from epoch to epoch."""
    order = list(range(num_shards))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


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
# command) is reopened `urls.RETRIES` times, after `urls.WAIT_S`, then twice that, and so on; the samples already
# yielded are skipped, not repeated.
STREAM_ERRORS = (OSError, tarfile.TarError, http.client.HTTPException)


def read_segment(seg: Segment, retries: int = urls.RETRIES, wait_s: float = urls.WAIT_S,
                 timeout: float = urls.READ_TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """Raw samples (dicts of extension -> bytes, plus `__key__`) of one shard segment; nothing is decoded.

    A remote shard whose stream breaks or stalls (no byte for `timeout` seconds) is reopened (`retries` times) and
    read on from the next sample. A shard that still ends before the segment does (truncated, manifest out of date)
    is a ShardError: yielding fewer samples would leave this rank with fewer steps than the others, and the run would
    hang in a collective. A shard with more samples than the manifest says is read up to the manifest's count, with
    a warning.
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
        if attempt >= retries or urls.is_local(seg.url) or (error is not None and urls.is_permanent(error)):
            tries = f" ({attempt + 1} attempts)" if attempt else ""
            if error is not None:
                what = "cannot be read" if urls.is_local(seg.url) else "the stream broke"
                # webdataset's errors carry (message, stream, url): the message is what a user needs
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


def _samples(url: str, timeout: float = urls.READ_TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """Every raw sample of one shard, in order."""
    stream = urls.open_url(url, timeout)
    try:
        files = wds.tariterators.tar_file_expander([{"url": url, "stream": stream}])
        yield from wds.tariterators.group_by_keys(files)
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


def image_bytes(sample: dict[str, Any]) -> bytes:
    """The bytes of a raw sample's image member (vit_mpp/image_formats.py); a KeyError when it has none."""
    ext = image_member(sample)
    if ext is None:
        raise KeyError(f"sample {sample.get('__key__')} has no image ({', '.join(IMAGE_EXTENSIONS)})")
    return sample[ext]


def sample_label(sample: dict[str, Any]) -> int:
    """The integer label of a sample's `.cls` file, -1 without one (a `.cls` that is not an integer raises)."""
    raw = sample.get("cls")
    return int(raw) if raw is not None else -1


class ImageDecoder:
    """Bytes -> augmented uint8 tensor (3, H, W). Train: RandomResizedCrop + flip (+ `augment`); eval: resize + center
    crop.

    Decoding and resizing are most of a loader's cost, so: a JPEG large enough is decoded at 1/2, 1/4 or 1/8 scale
    (PIL's draft mode, DCT scaling) when that still leaves enough pixels for the smallest crop; any other JPEG is
    decoded by torchvision (libjpeg-turbo, straight into a tensor); other formats by PIL. The crop and resize then
    run on the uint8 tensor in channels-last layout, where torch's antialiased resize is several times faster than
    PIL's. `augment` (training only, e.g. fine-tuning's RandAugment) takes the uint8 crop (3, H, W), in any memory
    layout, and returns a uint8 tensor of the same shape; it runs here, in the data-loader workers.
    """

    def __init__(self, img_size: int | tuple[int, int], train: bool, crop_scale: tuple[float, float] = (0.35, 1.0),
                 hflip: bool = True, eval_crop_pct: float = 0.875,
                 augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        h, w = img_hw(img_size)
        self.size = (h, w)
        self.augment = augment if train else None  # evaluation stays deterministic
        if train:
            ops = [T.RandomResizedCrop((h, w), scale=tuple(crop_scale), antialias=True)]
            if hflip:
                ops.append(T.RandomHorizontalFlip())
            # Keep enough pixels for the smallest crop when decoding at a reduced scale.
            self.draft = (int(w / math.sqrt(crop_scale[0])), int(h / math.sqrt(crop_scale[0])))
        else:
            resize = (int(round(h / eval_crop_pct)), int(round(w / eval_crop_pct)))
            ops = [T.Resize(resize, antialias=True), T.CenterCrop((h, w))]
            self.draft = (resize[1], resize[0])
        self.transform = T.Compose(ops)

    def decode(self, data: bytes) -> torch.Tensor:
        """Bytes -> uint8 RGB tensor (3, H, W), at a reduced scale where the crop allows it (see the class doc)."""
        img = Image.open(io.BytesIO(data))  # reads the header only
        if img.format == "JPEG" and min(img.size[0] // self.draft[0], img.size[1] // self.draft[1]) < 2:
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        img.draft("RGB", self.draft)  # a no-op except for JPEGs
        return pil_to_tensor(img.convert("RGB"))

    def __call__(self, data: bytes) -> torch.Tensor:
        x = self.decode(data).unsqueeze(0).contiguous(memory_format=torch.channels_last)  # (1, 3, h, w)
        x = self.transform(x)[0]  # (3, H, W) uint8, channels-last in memory
        if self.augment is not None:
            x = self.augment(x)
        return x.contiguous()


class ShardStream(IterableDataset):
    """Batches of decoded samples from one split, split across ranks and data-loader workers (see module doc).

    Each item is a dict: `image` uint8 (B, 3, H, W), `label` int64 (B,), `valid` bool (B,), `key` list[str],
    `bad` int (undecodable samples replaced since the previous batch of this worker), `epoch` int.
    """

    def __init__(self, split: Split, decoder: ImageDecoder, batch_size: int, *, rank: int, world_size: int,
                 num_workers: int, train: bool, seed: int = 0, shuffle_buffer: int = 1000, endless: bool = False,
                 start_batch: int = 0, max_bad_fraction: float = 0.01, num_classes: int | None = None,
                 read_timeout_s: float = urls.READ_TIMEOUT_S, read_retries: int = urls.RETRIES,
                 limit: int | None = None) -> None:
        super().__init__()
        self.split, self.decoder, self.batch_size = split, decoder, batch_size
        self.rank, self.world_size, self.num_workers = rank, world_size, max(1, num_workers)
        self.train, self.seed, self.shuffle_buffer, self.endless = train, seed, shuffle_buffer, endless
        self.start_batch, self.max_bad_fraction, self.num_classes = start_batch, max_bad_fraction, num_classes
        self.read_timeout_s, self.read_retries = read_timeout_s, read_retries
        parts = world_size * self.num_workers
        if limit is not None and train:
            raise ValueError("limit applies to evaluation streams only")
        # limit: evaluation reads only the split's first `limit` samples (in manifest order), e.g. for a monitor
        n = self.num_samples = split.num_samples if limit is None else min(limit, split.num_samples)
        if train:
            self.per_worker = (n // (parts * batch_size)) * batch_size
            if self.per_worker == 0:
                raise DataError(
                    f"split '{split.name}' has {n} samples, fewer than processes x workers x per-device batch = "
                    f"{world_size} x {self.num_workers} x {batch_size}: use fewer workers or a smaller batch"
                )
        else:
            self.per_worker = math.ceil(n / parts)
        if rank == 0 and len(split.urls) < parts:
            # Correct by design (ranges span shards), but each shard is then read, in part, by several workers.
            print(f"warning: split '{split.name}' has {len(split.urls)} shard(s) for {world_size} process(es) x "
                  f"{self.num_workers} worker(s): shards are read by several workers (extra I/O); more, smaller "
                  "shards avoid it", file=sys.stderr, flush=True)
        self.batches_per_worker = math.ceil(self.per_worker / batch_size)

    @property
    def batches_per_epoch(self) -> int:
        """Batches one rank receives per epoch (the same on every rank)."""
        return self.batches_per_worker * self.num_workers

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _resume_role(self, worker: int) -> tuple[int, int, int]:
        """(first epoch, role, batches to skip) for a worker when resuming after `start_batch` batches of this rank.

        The DataLoader takes batches from its workers in strict round-robin order starting at worker 0, so batch i
        came from worker i % W. After `rem` batches of an epoch the next batch belongs to worker rem % W; real worker
        w therefore plays the role (data part and position) of worker (w + rem) % W, and the sequence continues
        exactly where it stopped, in this and every later epoch (an epoch is a multiple of W batches).
        """
        epoch, rem = divmod(self.start_batch, self.batches_per_epoch)
        role = (worker + rem) % self.num_workers
        return epoch, role, max(0, -(-(rem - role) // self.num_workers))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and info.num_workers != self.num_workers:
            raise DataError(f"stream built for {self.num_workers} workers but the DataLoader has {info.num_workers}")
        epoch, role, skip_batches = self._resume_role(worker) if self.train else (0, worker, 0)
        part = self.rank * self.num_workers + role
        while True:
            yield from self._epoch(epoch, part, skip_batches * self.batch_size)
            skip_batches = 0
            epoch += 1
            if not self.endless:
                return

    def _epoch(self, epoch: int, part: int, skip: int) -> Iterator[dict[str, Any]]:
        order = epoch_order(len(self.split.urls), self.seed, epoch) if self.train else list(range(len(self.split.urls)))
        start = part * self.per_worker
        stop = min(start + self.per_worker, self.num_samples)
        raw: Iterator[dict[str, Any]] = (
            s for seg in range_segments(self.split, order, start, stop)
            for s in read_segment(seg, self.read_retries, timeout=self.read_timeout_s))
        if self.train:
            raw = shuffled(raw, self.shuffle_buffer, random.Random(f"{self.seed}-{epoch}-{part}"))
        batcher = _Batcher(self.batch_size, epoch)
        blank = torch.zeros(3, *self.decoder.size, dtype=torch.uint8)
        seen = bad = waiting = 0  # waiting: bad train samples seen before any good one, to be replaced by it
        last_good: tuple[torch.Tensor, int, str] | None = None
        for i, sample in enumerate(raw):
            if i < skip:  # resuming: consumed before the checkpoint; skipped without decoding
                batcher.emitted += 1
                continue
            seen += 1
            try:
                item = (self.decoder(image_bytes(sample)), sample_label(sample), sample["__key__"])
            except Exception:  # a bad sample must neither stop nor desynchronise the run: count and replace it
                item = None
                bad += 1
                batcher.bad += 1
            # The rate is checked from the 100th sample on, and on the range's last sample whatever its size (before
            # that sample's batch leaves: small data must not train on mostly broken images in silence).
            if bad > self.max_bad_fraction * seen and (seen >= 100 or i + 1 == stop - start):
                raise ShardError(f"{bad} of {seen} samples undecodable in split '{self.split.name}' (worker "
                                 f"{part}), above data.max_bad_fraction={self.max_bad_fraction}")
            if item is None:
                if not self.train:  # eval: the sample still occupies its place, but does not count
                    yield from batcher.add(blank, 0, False, sample["__key__"])
                elif last_good is not None:  # train: repeat the previous good sample so batches stay full
                    yield from batcher.add(*last_good[:2], True, last_good[2])
                else:
                    waiting += 1
                continue
            self._check_label(item[1], item[2])
            for _ in range(1 + waiting):
                yield from batcher.add(item[0], item[1], True, item[2])
            waiting, last_good = 0, item
        if waiting:
            raise ShardError(f"every sample of worker {part}'s range in split '{self.split.name}' is undecodable")
        while batcher.emitted < self.per_worker:  # eval ranges are padded to equal length with blanks
            yield from batcher.add(blank, 0, False, "")
        yield from batcher.flush()


    def _check_label(self, label: int, key: str) -> None:
        """With `num_classes` (a classifier's), every label must be one of its classes."""
        if self.num_classes is None or 0 <= label < self.num_classes:
            return
        if label < 0:
            raise ShardError(f"sample {key} of split '{self.split.name}' has no label (no .cls, or a negative one): "
                             "a classifier needs labelled shards")
        raise ShardError(f"sample {key} of split '{self.split.name}' has label {label}, outside the "
                         f"{self.num_classes} classes (0..{self.num_classes - 1}): num_classes is smaller than the "
                         "shards' labels")


class _Batcher:
    """Collects samples into batches of a fixed size; counts what it emitted and the bad samples replaced."""

    def __init__(self, batch_size: int, epoch: int) -> None:
        self.batch_size, self.epoch = batch_size, epoch
        self.emitted = self.bad = 0
        self.items: list[tuple[torch.Tensor, int, bool, str]] = []

    def add(self, image: torch.Tensor, label: int, valid: bool, key: str) -> Iterator[dict[str, Any]]:
        self.items.append((image, label, valid, key))
        self.emitted += 1
        if len(self.items) == self.batch_size:
            yield from self.flush()

    def flush(self) -> Iterator[dict[str, Any]]:
        if not self.items:
            return
        images, labels, valid, keys = zip(*self.items)
        yield {
            "image": torch.stack(images),
            "label": torch.tensor(labels, dtype=torch.int64),
            "valid": torch.tensor(valid, dtype=torch.bool),
            "key": list(keys),
            "bad": self.bad,
            "epoch": self.epoch,
        }
        self.items, self.bad = [], 0


def make_loader(stream: ShardStream, num_workers: int, prefetch_factor: int = 2, pin_memory: bool = True,
                persistent_workers: bool = True) -> DataLoader:
    """A DataLoader over a ShardStream; batching happens inside the workers (batch_size=None)."""
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs.update(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    return DataLoader(stream, batch_size=None, num_workers=num_workers,
                      pin_memory=pin_memory and torch.cuda.is_available(), **kwargs)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move the tensors of a batch to `device` without blocking; images stay uint8 until `normalize`."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 (B, 3, H, W), scaled to [0, 1] then standardised with mean/std."""
    mean_t = torch.tensor(mean, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean_t) / std_t


def build_loader(split: Split, data: DataConfig, img_size: int | list[int], micro_batch: int, *, rank: int,
                 world_size: int, train: bool, seed: int = 0, start_batch: int = 0, num_classes: int | None = None,
                 limit: int | None = None, augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 ) -> tuple[ShardStream, DataLoader]:
    """The stream and its DataLoader for one rank: endless and shuffled for training, one ordered pass for eval.
    With `num_classes` every label must be one of the classes; `augment` runs in the workers after the training
    crop (see ImageDecoder)."""
    decoder = ImageDecoder(img_size, train=train, crop_scale=tuple(data.crop_scale), hflip=data.hflip,
                           eval_crop_pct=data.eval_crop_pct, augment=augment)
    stream = ShardStream(split, decoder, micro_batch, rank=rank, world_size=world_size, num_workers=data.num_workers,
                         train=train, seed=seed, shuffle_buffer=data.shuffle_buffer, endless=train,
                         start_batch=start_batch, max_bad_fraction=data.max_bad_fraction, num_classes=num_classes,
                         read_timeout_s=data.read_timeout_s, read_retries=data.read_retries, limit=limit)
    loader = make_loader(stream, data.num_workers, data.prefetch_factor, data.pin_memory,
                         data.persistent_workers and train)
    return stream, loader


def build_loaders(train_split: Split, val_split: Split | None, data: DataConfig, img_size: int | list[int],
                  micro_batch: int, *, rank: int, world_size: int, seed: int, start_batch: int,
                  num_classes: int | None = None, augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  ) -> tuple[ShardStream, DataLoader, DataLoader | None]:
    """The training stream and loader (resuming after `start_batch` batches; `augment` in its workers) and the
    evaluation loader, if any."""
    stream, loader = build_loader(train_split, data, img_size, micro_batch, rank=rank, world_size=world_size,
                                  train=True, seed=seed, start_batch=start_batch, num_classes=num_classes,
                                  augment=augment)
    val_loader = None
    if val_split is not None:
        val_loader = build_loader(val_split, data, img_size, micro_batch, rank=rank, world_size=world_size,
                                  train=False, num_classes=num_classes)[1]
    return stream, loader, val_loader
