"""The evaluation stream over webdataset shards, shared by both stages: `EvalStream`, one ordered pass over a split,
each sample once over all ranks and workers, padded so that every rank runs the same batches (the padding and the
undecodable samples marked not valid, so they do not count). Batches leave the workers as uint8 images. The
training stream and what every stream shares are stream.py's. See docs/data_stream.md."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vit_mpp.config.sections import DataConfig
from vit_mpp.data.image_decoder import ImageDecoder, image_bytes
from vit_mpp.data.labels import sample_label
from vit_mpp.data.manifest import Split
from vit_mpp.data.shard_reader import ShardError, range_segments, read_segment
from vit_mpp.data.stream import ReadSettings, check_label, make_loader, read_settings, warn_few_shards
from vit_mpp.data.stream_plan import Layout


class EvalStream(IterableDataset):
    """One ordered pass over a split, each sample once over all ranks and workers.

    Each item is a dict: `image` uint8 (B, 3, H, W), `label` int64 (B,), `valid` bool (B,) (False: padding or an
    undecodable sample, which do not count) and `key` list[str].
    """

    def __init__(self, split: Split, decoder: ImageDecoder, layout: Layout, *, rank: int, read: ReadSettings,
                 limit: int | None = None) -> None:
        super().__init__()
        self.split, self.decoder, self.batch_size, self.rank, self.read = split, decoder, layout.micro, rank, read
        self.num_workers = layout.workers
        # limit: only the split's first `limit` samples (in manifest order), e.g. for a monitor
        self.num_samples = split.num_samples if limit is None else min(limit, split.num_samples)
        self.per_worker = math.ceil(self.num_samples / layout.parts)
        self.batches_per_worker = math.ceil(self.per_worker / self.batch_size)
        if rank == 0 and limit is None:
            warn_few_shards(f"evaluation split '{split.name}'", split, layout.world, self.num_workers)

    def __len__(self) -> int:
        return self.batches_per_worker * self.num_workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        part = self.rank * self.num_workers + (info.id if info is not None else 0)
        start = part * self.per_worker
        stop = min(start + self.per_worker, self.num_samples)
        samples = (s for seg in range_segments(self.split, list(range(len(self.split.urls))), start, stop)
                   for s in read_segment(seg, self.read.read_retries, timeout=self.read.read_timeout_s))
        blank = torch.zeros(3, *self.decoder.size, dtype=torch.uint8)
        items: list[tuple[torch.Tensor, int, bool, str]] = []
        seen = bad = 0
        for sample in samples:
            seen += 1
            try:
                items.append((self.decoder(image_bytes(sample)), sample_label(sample), True, sample["__key__"]))
                check_label(items[-1][1], items[-1][3], self.read.num_classes)
            except ShardError:
                raise
            except Exception:  # an undecodable sample keeps its place but does not count
                bad += 1
                items.append((blank, 0, False, sample["__key__"]))
            if bad > self.read.max_bad_fraction * seen and (seen >= 100 or seen == stop - start):
                raise ShardError(f"{bad} of {seen} samples undecodable in split '{self.split.name}' (worker {part}), "
                                 f"above data.max_bad_fraction={self.read.max_bad_fraction}")
            if len(items) == self.batch_size:
                yield _eval_batch(items)
                items = []
        for _ in range(seen, self.per_worker):  # ranges are padded to equal length with blanks
            items.append((blank, 0, False, ""))
            if len(items) == self.batch_size:
                yield _eval_batch(items)
                items = []
        if items:
            yield _eval_batch(items)



def _eval_batch(items: list[tuple[torch.Tensor, int, bool, str]]) -> dict[str, Any]:
    images, labels, valid, keys = zip(*items)
    return {"image": torch.stack(images), "label": torch.tensor(labels, dtype=torch.int64),
            "valid": torch.tensor(valid, dtype=torch.bool), "key": list(keys)}


def eval_split_loader(split: Split, data: DataConfig, decoder: ImageDecoder, layout: Layout, *, rank: int = 0,
                      num_classes: int | None = None) -> DataLoader:
    """One ordered pass over `split` for this rank (see EvalStream); with `num_classes` every label must be one of
    the classes."""
    return make_loader(EvalStream(split, decoder, layout, rank=rank, read=read_settings(data, num_classes=num_classes)),
                       data)
