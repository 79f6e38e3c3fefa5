"""The training stream over webdataset shards, shared by both stages: `TrainStream`, endless full micro-batches per
rank from one set or a weighted mixture, each sample once per epoch on any layout and resumed exactly (the plan:
vit_mpp/data/stream_plan.py); `Batches`, a rank's training batches that close when told; and what every stream
shares (`make_loader`, `to_device`, `normalize`, the read settings). Batches leave the workers as uint8 images. The
evaluation's stream is eval_stream.py's. See docs/data_stream.md."""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import os
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vit_mpp.config.sections import DataConfig
from vit_mpp.data import urls
from vit_mpp.data.device_decode import collate_images, decode_on_device
from vit_mpp.data.image_decoder import ImageDecoder, image_bytes
from vit_mpp.data.labels import sample_label
from vit_mpp.data.manifest import Split
from vit_mpp.data.shard_reader import DataError, ShardError, range_segments, read_segment, shuffled
from vit_mpp.data.stream_plan import (
    Composition,
    Generation,
    Layout,
    Piece,
    batches_of_role,
    block_rng,
    epoch_order,
    first_generation,
    part_pieces,
    samples_per_epoch,
    share,
)
from vit_mpp.processes.loader_workers import Loader, end_workers, init_worker, loader_timeout_s


@dataclass(frozen=True)
class TrainSet:
    """One shard set of the training mixture (a mixture of one for plain training). A set not `labelled` (the pool of
    semi-supervised fine-tuning) has its labels ignored (-1 unless one of the classes: kept for a diagnostic only)
    and each of its samples leaves with a second, weak view (crop and flip, before `augment`)."""

    name: str
    split: Split
    weight: float
    labelled: bool = True


@dataclass(frozen=True)
class ReadSettings:
    """How raw samples are read and checked: what every worker needs besides the plan."""

    seed: int
    shuffle_buffer: int
    max_bad_fraction: float
    read_timeout_s: float = urls.READ_TIMEOUT_S
    read_retries: int = urls.READ_RETRIES
    num_classes: int | None = None  # a classifier's classes: every label read must be one of them


def block_samples(split: Split, set_index: int, piece: Piece, read: ReadSettings) -> Iterator[dict[str, Any]]:
    """The raw samples of emissions [piece.lo, piece.hi) of one block of one epoch (vit_mpp/data/stream_plan.py): the
    block's samples read in shard order through its shuffle buffer; those before `lo` are read, not decoded."""
    start, stop = share(split.num_samples, piece.parts, piece.block)
    order = epoch_order(len(split.urls), read.seed, set_index, piece.epoch)
    raw = (s for seg in range_segments(split, order, start, stop)
           for s in read_segment(seg, read.read_retries, timeout=read.read_timeout_s))
    emissions = shuffled(raw, read.shuffle_buffer, block_rng(read.seed, set_index, piece.epoch, piece.parts,
                                                             piece.block))
    try:
        for sample in itertools.islice(emissions, piece.lo, piece.hi):
            yield {**sample, "__epoch__": piece.epoch}
        if piece.hi == stop - start:
            next(emissions, None)  # past the block's end: a shard holding more than its manifest says is noticed
    finally:
        emissions.close()


def sample_seed(seed: int, set_index: int, epoch: int, key: str) -> int:
    """The seed of one sample's augmentation in one epoch: the same for it wherever, whenever it is read."""
    return int.from_bytes(hashlib.blake2b(f"{seed}-{set_index}-{epoch}-{key}".encode(), digest_size=8).digest(), "big")


class SetReader:
    """The decoded samples one part reads from one set: (image, label, key, epoch, bad keys replaced before it).

    An undecodable sample (or one without an image) is replaced by the previous good one, so micro-batches stay
    full; one met before any good sample waits for the next good one.
    """

    def __init__(self, train_set: TrainSet, set_index: int, pieces: Iterator[Piece], decoder: ImageDecoder,
                 read: ReadSettings, part: int) -> None:
        self.set, self.index, self.pieces, self.decoder = train_set, set_index, pieces, decoder
        self.read, self.part = read, part
        self.seen = self.bad = 0
        self.last_good: tuple[torch.Tensor, int, str, int] | None = None
        self.items = self._items()

    def _items(self) -> Iterator[tuple[torch.Tensor, int, str, int, list[str]]]:
        waiting: list[str] = []  # bad samples met before any good one: replaced by the next good one
        for piece in self.pieces:
            last = piece.hi - piece.lo - 1
            for i, sample in enumerate(block_samples(self.set.split, self.index, piece, self.read)):
                key = sample["__key__"]
                self.seen += 1
                try:
                    image = self.decoder(image_bytes(sample), seed=sample_seed(self.read.seed, self.index,
                                                                               sample["__epoch__"], key),
                                         weak=not self.set.labelled)
                    good = (image, self._label(sample), key, sample["__epoch__"])
                except Exception:  # a bad sample must neither stop nor desynchronise the run: count and replace it
                    self.bad += 1
                    self._check_rate(force=i == last)
                    if self.last_good is None:
                        waiting.append(key)
                    else:
                        yield (*self.last_good, [key])
                    continue
                # The rate is checked at a block's last sample whatever its size, before that sample leaves: small
                # data must not train on mostly broken images in silence.
                self._check_rate(force=i == last)
                if self.set.labelled:
                    check_label(good[1], key, self.read.num_classes)
                for j in range(len(waiting) + 1):
                    yield (*good, waiting[j:j + 1])
                waiting, self.last_good = [], good
            if waiting:
                raise ShardError(f"every sample worker {self.part} read from set '{self.set.name}' (split "
                                 f"'{self.set.split.name}') is undecodable")

    def _label(self, sample: dict[str, Any]) -> int:
        label = sample_label(sample)
        if self.set.labelled:
            return label
        classes = self.read.num_classes
        return label if classes is not None and 0 <= label < classes else -1

    def _check_rate(self, force: bool) -> None:
        if self.bad > self.read.max_bad_fraction * self.seen and (force or self.seen >= 100):
            raise ShardError(f"{self.bad} of {self.seen} samples undecodable in set '{self.set.name}' (split "
                             f"'{self.set.split.name}', worker {self.part}), above data.max_bad_fraction="
                             f"{self.read.max_bad_fraction}")

    def __next__(self) -> tuple[torch.Tensor, int, str, int, list[str]]:
        return next(self.items)


class TrainStream(IterableDataset):
    """Endless micro-batches for one rank (see the module doc).

    Each item is a dict: `image` uint8 (B, 3, H, W), `label` int64 (B,), `valid` bool (B,), `key` list[str], `set`
    list[int] (index of each sample's set), `epoch` list[int] (each sample's epoch of its set), `bad` int and
    `bad_keys` list[str] (undecodable samples replaced in this batch); with a set not labelled (a pool) also `pool`
    bool (B,) (the sample is the pool's) and `weak` uint8 (B, 3, H, W) (a pool sample's weak view; a labelled
    sample's image).
    """

    def __init__(self, sets: list[TrainSet], decoder: ImageDecoder, generation: Generation, *, rank: int,
                 resume_step: int, read: ReadSettings) -> None:
        super().__init__()
        self.sets, self.decoder, self.gen, self.rank, self.read = sets, decoder, generation, rank, read
        self._open: weakref.WeakSet = weakref.WeakSet()  # this process's iterations, which `close` ends
        layout = generation.layout
        self.batches_done = (resume_step - generation.start_step) * layout.accum  # this rank's, in the generation
        for s in sets:
            if s.split.num_samples < layout.parts:
                raise DataError(f"set '{s.name}' (split '{s.split.name}') has {s.split.num_samples} samples, fewer "
                                f"than processes x workers = {layout.world} x {layout.workers}: use fewer "
                                "data.num_workers or processes")
            if rank == 0:
                warn_few_shards(f"set '{s.name}' (split '{s.split.name}')", s.split, layout.world, layout.workers)

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches one rank takes in one epoch (of a mixture: a pass over the set that runs out first)."""
        layout = self.gen.layout
        epoch = samples_per_epoch([s.split.num_samples for s in self.sets], [s.weight for s in self.sets])
        return max(1, epoch // (layout.world * layout.micro))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_open"}  # a worker's copy starts with none open

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _open=weakref.WeakSet())

    def close(self) -> None:
        """End every iteration of this stream in this process now: their open shard reads are closed."""
        for batches in list(self._open):
            batches.close()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = self._batches()
        self._open.add(batches)
        return batches

    def _batches(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        layout = self.gen.layout
        if (info.num_workers if info is not None else 1) != layout.workers:
            raise DataError(f"stream built for {layout.workers} workers but the DataLoader has "
                            f"{info.num_workers if info is not None else 0}")
        # The DataLoader takes batches from its workers round-robin from worker 0. After `batches_done` batches
        # the next one belongs to role batches_done % W: real worker w plays role (w + that) % W.
        role = (worker + self.batches_done) % layout.workers
        part = self.rank * layout.workers + role
        rounds = batches_of_role(self.batches_done, layout.workers, role)
        composition = Composition([s.weight for s in self.sets], self.gen.seed, self.gen.index)
        skips = composition.counts(rounds * layout.micro)
        pools = any(not s.labelled for s in self.sets)
        readers = [SetReader(s, i, part_pieces(self.gen.sets[i], layout.parts, part, s.split.num_samples, skips[i]),
                             self.decoder, self.read, part) for i, s in enumerate(self.sets)]
        try:
            for rnd in itertools.count(rounds):
                slots = composition.slots(rnd * layout.micro, layout.micro).tolist()
                pool = [not self.sets[i].labelled for i in slots] if pools else None
                yield _batch([(*next(readers[i]), i) for i in slots], self.decoder.size, pool)
        finally:
            for reader in readers:
                reader.items.close()

def check_label(label: int, key: str, num_classes: int | None) -> None:
    """With `num_classes` (a classifier's), every label must be one of its classes."""
    if num_classes is None or 0 <= label < num_classes:
        return
    if label < 0:
        raise ShardError(f"sample {key} has no usable label (no .cls, or one that is not a class index): a "
                         "classifier needs labelled shards")
    raise ShardError(f"sample {key} has label {label}, outside the {num_classes} classes "
                     f"(0..{num_classes - 1}): num_classes is smaller than the shards' labels")


def _batch(items: list[tuple], size: tuple[int, int], pool: list[bool] | None = None) -> dict[str, Any]:
    """One training micro-batch from (image, label, key, epoch, bad keys, set) items; images of `size`, or JPEGs
    still encoded with data.decode=gpu (vit_mpp/data/device_decode.py). With `pool` (which items are a pool's, whose
    image is an (image, weak view) pair) also the `weak` views and the `pool` mask."""
    images, labels, keys, epochs, bad_keys, sets = zip(*items)
    replaced = [k for ks in bad_keys for k in ks]
    views: dict[str, Any] = {}
    if pool is not None:
        views = {"weak": torch.stack([x[1] if p else x for x, p in zip(images, pool)]),
                 "pool": torch.tensor(pool, dtype=torch.bool)}
        images = tuple(x[0] if p else x for x, p in zip(images, pool))
    return {**collate_images(list(images), size), "label": torch.tensor(labels, dtype=torch.int64),
            "valid": torch.ones(len(items), dtype=torch.bool), "key": list(keys), "set": list(sets),
            "epoch": list(epochs), "bad": len(replaced), "bad_keys": replaced, **views}


def warn_few_shards(what: str, split: Split, world: int, workers: int) -> None:
    """Fewer shards than processes x workers is correct by design (ranges span shards), but each shard is then read,
    in part, by several workers: say so (rank 0), once per stream."""
    if len(split.urls) < world * workers:
        print(f"warning: {what} has {len(split.urls)} shard(s) for {world} process(es) x {workers} worker(s): shards "
              "are read by several workers (extra I/O); more, smaller shards avoid it", file=sys.stderr, flush=True)


class Batches:
    """A rank's endless training batches (`next(batches)`) that end when told: `close()` closes the stream's open
    shard reads (a loader without workers reads in this process) and stops the loader's workers. Whatever is still
    open when the interpreter exits is closed first (`atexit`), never by the garbage collector during the exit,
    when no thread runs and a deadlined close would wait forever."""

    def __init__(self, stream: TrainStream, loader: DataLoader) -> None:
        self.stream, self._batches = stream, iter(loader)
        _live.add(self)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._batches)

    def __del__(self) -> None:  # a run that ends with an exception (a preemption) drops its batches: end them here
        self.close()

    def close(self) -> None:
        batches, self._batches = self._batches, iter(())
        end_workers(batches)
        self.stream.close()
        _live.discard(self)


_live: weakref.WeakSet = weakref.WeakSet()  # Batches not closed yet


@atexit.register  # registered after loader_workers' own: runs before it ends what is left of the loaders
def _end_live() -> None:
    for batches in list(_live):
        batches.close()


def make_loader(stream: IterableDataset, data: DataConfig) -> DataLoader:
    """A DataLoader over a stream (batching happens inside the workers: batch_size=None), its workers set by
    `data`; an evaluation's workers end with each pass."""
    kwargs: dict[str, Any] = {}
    if data.num_workers > 0:
        kwargs.update(prefetch_factor=data.prefetch_factor,
                      persistent_workers=data.persistent_workers and isinstance(stream, TrainStream),
                      worker_init_fn=functools.partial(init_worker, parent=os.getpid()),
                      timeout=loader_timeout_s(data))
    # A generator of its own: torch draws a seed for the workers from the loader's generator each time an iterator
    # starts, and from the global one that would shift every later draw of the device's augmentations (a resumed run
    # starts its iterator after the checkpoint's generators are restored; the stream seeds each sample itself)
    return Loader(stream, batch_size=None, num_workers=data.num_workers, generator=torch.Generator(),
                  pin_memory=data.pin_memory and torch.cuda.is_available(), **kwargs)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move the tensors of a batch to `device` without blocking; images stay uint8 until `normalize`. JPEGs still
    encoded (data.decode=gpu) are decoded, cropped and flipped there (vit_mpp/data/device_decode.py)."""
    moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return decode_on_device(moved, device) if "jpeg" in moved else moved


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 (B, 3, H, W), scaled to [0, 1] then standardised with mean/std."""
    mean_t = torch.tensor(mean, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=images.device, dtype=torch.float32).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean_t) / std_t


def read_settings(data: DataConfig, seed: int = 0, num_classes: int | None = None) -> ReadSettings:
    return ReadSettings(seed, data.shuffle_buffer, data.max_bad_fraction, data.read_timeout_s, data.read_retries,
                        num_classes)


def loader_layout(data: DataConfig, batch_size: int, world_size: int = 1) -> Layout:
    """The layout of `world_size` processes reading with `data`'s loader workers in batches of `batch_size` (no
    accumulation)."""
    return Layout(world_size, max(1, data.num_workers), batch_size, 1)


def train_split_loader(split: Split, data: DataConfig, decoder: ImageDecoder, layout: Layout, *, rank: int = 0,
                 seed: int = 0) -> tuple[TrainStream, DataLoader]:
    """The training stream of one split on its own, from its first step: what benchmarks and tools that read a
    single shard set need, without a run's checkpointed generation."""
    generation = first_generation(layout, [split.num_samples], seed)
    stream = TrainStream([TrainSet(split.name, split, 1.0)], decoder, generation, rank=rank, resume_step=0,
                         read=read_settings(data, seed))
    return stream, make_loader(stream, data)
