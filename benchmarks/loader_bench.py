"""Training-loader throughput: our shard stream against what users would otherwise use, on the same data.

    python benchmarks/loader_bench.py [--images 2000] [--size 224] [--workers 2] [--batch 64] [--repeats 1]
    python benchmarks/loader_bench.py --shards DIR [--loaders ours] [--json FILE]   # shards you have

Generates `--images` JPEGs of `--width` x `--height` (default 500x375, ImageNet's typical size; smooth colour fields
plus noise, so they compress like photographs), stores them both as an ImageFolder tree and as webdataset shards
with a manifest, then times one epoch of each loader after a warm-up epoch (persistent workers, so start-up is not
counted):

* `imagefolder`: torchvision ImageFolder + DataLoader, on the JPEG files;
* `webdataset`: webdataset's own pipeline on the shards (`wds.WebDataset` with `split_by_node` / `split_by_worker`,
  a shuffle buffer, `decode("pil")`, batched in the workers, `wds.WebLoader`);
* `timm_wds`: timm's `wds/` reader on the shards (`timm.data.create_dataset("wds/...")`, which reads our
  `_info.json`) + DataLoader;
* `ours`: `vit_mpp.data.stream` (TrainStream) on the shards.

All apply the same transforms: RandomResizedCrop(size, scale=crop_scale) + horizontal flip + uint8 tensor (the three
others with torchvision's transforms on the PIL image, ours with its own decoder). With --repeats N the four are
timed N times, interleaved; the best and the median of each are compared. Prints images/s, images/s per worker
process, the ratios of ours to each, and each worker's peak RSS (VmHWM, which includes the pages shared with the
parent). With --shards the loaders read those shards' train split instead (benchmarks/gpu_suite.sh times ours
alone on what build-shards wrote).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2 as T

from data_tools.builder.writer import ShardWriter
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import load_split, write_manifest
from vit_mpp.data.stream import loader_layout, train_split_loader

LOADERS = ("imagefolder", "webdataset", "timm_wds", "ours")


def photo_like(rng: np.random.Generator, width: int, height: int, quality: int) -> bytes:
    """One JPEG that compresses like a photograph: a smooth colour field (bicubic from a 32x coarser grid) plus
    noise."""
    field = rng.integers(0, 256, (height // 32 + 2, width // 32 + 2, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(field).resize((width, height), Image.BICUBIC), dtype=np.int16)
    img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(img).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def make_images(root: Path, count: int, width: int, height: int, quality: int, shard_size: int, seed: int,
                folder: bool = True) -> None:
    """`count` JPEGs in `root/folder/<class>/` (unless not `folder`) and the same bytes in `root/shards/` (4
    classes)."""
    rng = np.random.default_rng(seed)
    (root / "shards").mkdir(parents=True)
    filenames, lengths, writer = [], [], None
    for i in range(count):
        data, label = photo_like(rng, width, height, quality), i % 4
        if folder:
            class_dir = root / "folder" / f"class{label}"
            class_dir.mkdir(parents=True, exist_ok=True)
            (class_dir / f"img{i:06d}.jpg").write_bytes(data)
        if i % shard_size == 0:
            if writer is not None:
                lengths.append(writer.close()[0])
            filenames.append(f"train-{len(filenames):06d}.tar")
            writer = ShardWriter(root / "shards" / filenames[-1])
        writer.write(f"img{i:06d}", {"jpg": data, "cls": str(label).encode()})
    lengths.append(writer.close()[0])
    write_manifest(root / "shards", {"name": "bench", "splits": {"train": {
        "name": "train", "num_samples": count, "filenames": filenames, "shard_lengths": lengths}}})


def worker_peak_rss_mib(before: set[int]) -> list[float]:
    """Peak RSS (VmHWM, MiB) of the child processes started since `before` was taken: the loader's workers."""
    peaks = []
    for child in psutil.Process().children():
        if child.pid in before:
            continue
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
        except OSError:  # not Linux, or the worker already exited
            continue
        peaks += [int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
    return peaks


def time_loader(loader, per_epoch: int, before: set[int]) -> tuple[float, int, list[float]]:
    """Run a warm-up epoch of `loader`, then time one (the loader is restarted when an epoch ends): (seconds,
    images, its workers' peak RSS). `before`: the child processes that existed before the loader's workers."""

    def endless():
        while True:
            yield from loader

    seconds, images = time_epochs(endless(), per_epoch)
    return seconds, images, worker_peak_rss_mib(before)


def time_epochs(batches, per_epoch: int) -> tuple[float, int]:
    """Run a warm-up epoch, then time one: (seconds, images)."""
    for _ in range(per_epoch):
        next(batches)
    start, images = time.perf_counter(), 0
    for _ in range(per_epoch):
        b = next(batches)
        images += len(b["image"] if isinstance(b, dict) else b[0])
    return time.perf_counter() - start, images


def bench_ours(shards: Path, args: argparse.Namespace) -> tuple[float, int, list[float]]:
    split, _ = load_split(shards, "train")
    data = DataConfig(num_workers=args.workers, shuffle_buffer=args.shuffle_buffer, crop_scale=list(args.crop_scale),
                      persistent_workers=True)
    before = {c.pid for c in psutil.Process().children()}
    stream, loader = train_split_loader(split, data, ImageDecoder.for_training(data, args.size),
                                        loader_layout(data, args.batch))
    return time_loader(loader, stream.batches_per_epoch, before)


def bench_imagefolder(folder: Path, args: argparse.Namespace) -> tuple[float, int, list[float]]:
    transform = T.Compose([T.RandomResizedCrop(args.size, scale=tuple(args.crop_scale), antialias=True),
                           T.RandomHorizontalFlip(), T.PILToTensor()])
    dataset = ImageFolder(str(folder), transform=transform)
    before = {c.pid for c in psutil.Process().children()}
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers, drop_last=True,
                        persistent_workers=True, prefetch_factor=2)
    return time_loader(loader, len(loader), before)


def pil_transform(args: argparse.Namespace) -> T.Compose:
    """The training transforms the other loaders apply to a PIL image (the same as ImageFolder's)."""
    return T.Compose([T.RandomResizedCrop(args.size, scale=tuple(args.crop_scale), antialias=True),
                      T.RandomHorizontalFlip(), T.PILToTensor()])


def bench_webdataset(shards: Path, args: argparse.Namespace) -> tuple[float, int, list[float]]:
    """webdataset's own pipeline, as its documentation builds a training loader."""
    import webdataset as wds

    split, _ = load_split(shards, "train")
    transform = pil_transform(args)
    per_worker = split.num_samples // (args.workers * args.batch)  # full batches each worker yields per epoch
    dataset = (wds.WebDataset(split.urls, shardshuffle=len(split.urls), nodesplitter=wds.split_by_node,
                              workersplitter=wds.split_by_worker, seed=0, empty_check=False)
               .shuffle(args.shuffle_buffer).decode("pil").to_tuple("jpg", "cls")
               .map_tuple(transform, int).batched(args.batch, partial=False).repeat().with_epoch(per_worker))
    before = {c.pid for c in psutil.Process().children()}
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers, persistent_workers=True,
                           prefetch_factor=2)
    return time_loader(loader, per_worker * args.workers, before)


def bench_timm(shards: Path, args: argparse.Namespace) -> tuple[float, int, list[float]]:
    """timm's `wds/` reader (it reads our _info.json) + a DataLoader, as timm's train.py sets it up."""
    from timm.data import create_dataset

    dataset = create_dataset("wds/bench", root=str(shards), split="train", is_training=True, batch_size=args.batch,
                             seed=0)
    dataset.transform = pil_transform(args)
    before = {c.pid for c in psutil.Process().children()}
    loader = DataLoader(dataset, batch_size=args.batch, num_workers=args.workers, drop_last=True,
                        persistent_workers=True, prefetch_factor=2)
    return time_loader(loader, len(loader), before)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224, help="training crop size")
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--shuffle-buffer", type=int, default=1000)
    parser.add_argument("--crop-scale", type=float, nargs=2, default=[0.35, 1.0])
    parser.add_argument("--repeats", type=int, default=1, help="interleaved timings of each loader")
    parser.add_argument("--loaders", nargs="+", choices=LOADERS,
                        help="which loaders (default: all four; with --shards, ours)")
    parser.add_argument("--dir", help="where to generate the data (default: a temporary directory)")
    parser.add_argument("--shards", type=Path, help="time the loaders on these shards (their train split) instead "
                                                   "of generating images; imagefolder needs the generated folder")
    parser.add_argument("--json", type=Path, help="write the best and median images/s of each loader to this file")
    args = parser.parse_args(argv)
    args.loaders = args.loaders or (["ours"] if args.shards else list(LOADERS))
    if args.shards and "imagefolder" in args.loaders:
        parser.error("--shards has no image folder: leave imagefolder out of --loaders")
    return args


def time_loaders(runs: dict, args: argparse.Namespace) -> dict[str, list[float]]:
    """Images/s of each loader of `runs` (name -> a function timing it), --repeats times, interleaved."""
    rates: dict[str, list[float]] = {name: [] for name in args.loaders}
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits every loader alike
        for name in args.loaders:
            seconds, images, peaks = runs[name]()
            rates[name].append(images / seconds)
            rss = ", ".join(f"{p:.0f}" for p in peaks) or "n/a"
            print(f"{name:12s} {rates[name][-1]:8.1f} img/s  {rates[name][-1] / args.workers:7.1f} img/s per "
                  f"worker  ({images} images in {seconds:.2f} s)  worker peak RSS MiB: {rss}", flush=True)
    return rates


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        if args.shards:
            shards = args.shards
            split, _ = load_split(shards, "train")
            print(f"{split.num_samples} images of {shards}, crop {args.size}, {args.workers} workers, batch "
                  f"{args.batch}, {os.cpu_count()} CPU cores")
        else:
            shards = root / "shards"
            make_images(root, args.images, args.width, args.height, args.quality, args.shard_size, seed=0)
            mean_kb = sum(p.stat().st_size for p in (root / "folder").rglob("*.jpg")) / args.images / 1024
            print(f"{args.images} JPEGs {args.width}x{args.height} (mean {mean_kb:.0f} KiB), crop {args.size}, "
                  f"{args.workers} workers, batch {args.batch}, {os.cpu_count()} CPU cores")
        runs = {"imagefolder": lambda: bench_imagefolder(root / "folder", args),
                "webdataset": lambda: bench_webdataset(shards, args),
                "timm_wds": lambda: bench_timm(shards, args),
                "ours": lambda: bench_ours(shards, args)}
        rates = time_loaders(runs, args)
    # The fastest run is the least disturbed one (timeit's rule); the median shows how much the machine moved.
    summary = {}
    for label, pick in (("best", max), ("median", statistics.median)):
        rate = {name: pick(v) for name, v in rates.items()}
        summary[label] = rate
        print(f"{label} img/s: " + ", ".join(f"{k} {v:.1f}" for k, v in rate.items()))
        if "ours" in rate and len(rate) > 1:
            print(f"  {label} ratios: " + ", ".join(f"ours / {name} {rate['ours'] / rate[name]:.2f}"
                                                    for name in args.loaders if name != "ours"))
    if args.json:
        args.json.write_text(json.dumps({"workers": args.workers, "batch": args.batch, "size": args.size,
                                         "cpu_cores": os.cpu_count(), **summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
