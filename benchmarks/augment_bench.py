"""CPU cost of fine-tuning's worker-side RandAugment: the training stream with and without it, on the same JPEGs.

    python benchmarks/augment_bench.py [--images 600] [--size 224] [--repeats 5]

Generates JPEGs as benchmarks/loader_bench.py does (500x375, ImageNet's typical size, compressed like photographs),
then runs one epoch of the training stream in this process (data.num_workers=0, one thread: exactly the work one
data-loader worker does per image) for each variant, interleaved: crops + flips only; + timm's RandAugment through
our RandAugmentU8; + torchvision's v2.RandAugment on the uint8 tensor, for comparison. It measures the process's
CPU time, not wall time, so other work on the machine does not count. Prints CPU ms per image (median and best of
--repeats), the images/s one core delivers, and each augmentation's extra cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torchvision.transforms import v2 as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loader_bench import make_images  # noqa: E402
from finetune.augment import RandAugmentU8  # noqa: E402
from vit_mpp.config.sections import DataConfig  # noqa: E402
from vit_mpp.data.image_decoder import ImageDecoder  # noqa: E402
from vit_mpp.data.manifest import load_split  # noqa: E402
from vit_mpp.data.stream import loader_layout, train_split_loader  # noqa: E402


def cpu_ms_per_image(shards: Path, args: argparse.Namespace, augment) -> float:
    split, _ = load_split(shards, "train")
    data = DataConfig(num_workers=0, shuffle_buffer=200, crop_scale=[0.08, 1.0])
    stream, loader = train_split_loader(split, data, ImageDecoder.for_training(data, args.size, augment),
                                        loader_layout(data, args.batch))
    batches = iter(loader)
    start, images = time.process_time(), 0
    for _ in range(stream.batches_per_epoch):
        images += len(next(batches)["image"])
    return (time.process_time() - start) / images * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", default="rand-m9-mstd0.5-inc1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = {"crop+flip": None, f"+ timm {args.config} (ours)": RandAugmentU8(args.config, args.size, (0.5,) * 3),
                "+ torchvision v2.RandAugment(2, 9)": T.RandAugment(num_ops=2, magnitude=9)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_images(root, args.images, 500, 375, 90, 200, seed=0)
        print(f"{args.images} JPEGs 500x375, crop {args.size}, one process, one thread, CPU time")
        costs: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):  # interleaved, so cache and frequency effects hit every variant alike
            for name, augment in variants.items():
                costs[name].append(cpu_ms_per_image(root / "shards", args, augment))
        base = statistics.median(costs["crop+flip"])
        for name, values in costs.items():
            med = statistics.median(values)
            extra = f"  (+{med - base:.2f} ms)" if name != "crop+flip" else ""
            print(f"{name:40s} {med:5.2f} ms/img (best {min(values):5.2f}) = {1000 / med:5.0f} img/s per core{extra}")


if __name__ == "__main__":
    main()
