"""The MAE/DeiT-style fine-tuning recipe: RandAugment in the loader workers, random erasing."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.config import DataConfig, ModelConfig
from common.data_stream import ImageDecoder, build_loader
from common.manifest import load_split
from common.models import create_encoder
from finetune.augment import RandAugmentU8, build_random_erasing
from finetune.config import AugmentConfig
from finetune.train import main
from tests.conftest import png_bytes, write_encoder_export, write_shard_set

SMALL = dict(patch_size=4, embed_dim=32, depth=1, num_heads=2)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """3 classes; 40 training images, 13 validation images."""
    return write_shard_set(tmp_path_factory.mktemp("shards"), {"train": [24, 16], "val": [7, 6]})


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("pretrain_export")
    cfg = ModelConfig(img_size=16, **SMALL)
    return write_encoder_export(out, create_encoder(cfg), cfg)


def finetune(shards: Path, run_dir: Path, init: Path, *overrides: str) -> None:
    main(["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}",
          f"init.checkpoint={init}", "data.num_workers=0", *overrides])


def smooth_images(n: int, size: int = 24, seed: int = 0) -> list[torch.Tensor]:
    """Smooth colour fields, uint8 (3, size, size): geometric ops move content, colour ops change it."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
        out.append(torch.from_numpy(np.array(small.resize((size, size), Image.BICUBIC))).permute(2, 0, 1))
    return out


# --- RandAugment, in the workers ----------------------------------------------------------------------------------

def test_rand_augment_changes_uint8_images_and_keeps_their_shape_and_dtype():
    ra = RandAugmentU8("rand-m9-mstd0.5-inc1", 24, (0.5, 0.5, 0.5))
    images = smooth_images(200)
    random.seed(0)
    np.random.seed(0)
    out = [ra(x) for x in images]
    assert all(y.dtype == torch.uint8 and y.shape == (3, 24, 24) and y.is_contiguous() for y in out)
    changed = np.mean([not torch.equal(x, y) for x, y in zip(images, out)])
    # each of the 2 ops is applied with probability 0.5, so about 1/4 of the images keep both skipped
    assert 0.65 < changed < 0.85
    random.seed(0)
    np.random.seed(0)
    assert all(torch.equal(ra(x), y) for x, y in zip(images, out))  # the workers' seeds fix it


def test_rand_augment_changes_images_more_at_a_higher_magnitude():
    images = smooth_images(200)
    mean_change = {}
    for m in (1, 5, 9):
        ra = RandAugmentU8(f"rand-m{m}-inc1", 24, (0.5, 0.5, 0.5))
        random.seed(0)  # the same ops on the same images at every magnitude: only their strength differs
        np.random.seed(0)
        mean_change[m] = np.mean([(ra(x).int() - x.int()).abs().float().mean() for x in images])
    assert mean_change[1] * 1.5 < mean_change[5] and mean_change[5] * 1.1 < mean_change[9], mean_change


def test_posterize_at_magnitude_10_gives_black_instead_of_an_error():
    # PosterizeIncreasing keeps 0 bits at magnitude 10 (which mstd noise reaches); Pillow 13 raises for 0 bits, and an
    # exception in the decoder would silently count the image as undecodable.
    ra = RandAugmentU8("rand-m10-inc1", 24, (0.5, 0.5, 0.5))
    op = next(o for o in ra.transform.ops if o.name == "PosterizeIncreasing")
    op.prob = 1.0
    image = Image.fromarray(smooth_images(1)[0].permute(1, 2, 0).numpy())
    assert np.asarray(op(image)).max() == 0


class Invert:
    """A stand-in augmentation whose effect is known exactly."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return 255 - image


def first_batch(split, train: bool, augment=None, workers: int = 1) -> torch.Tensor:
    data = DataConfig(num_workers=workers, shuffle_buffer=0)
    _, loader = build_loader(split, data, 24, 8, rank=0, world_size=1, train=train, augment=augment)
    torch.manual_seed(0)  # the workers' seeds derive from it: the same crops in both loaders
    return next(iter(loader))["image"]


def test_the_augmentation_runs_in_the_workers_after_the_crop_and_only_for_training(shards):
    split, _ = load_split(shards, "train")
    plain = first_batch(split, train=True)
    assert torch.equal(first_batch(split, train=True, augment=Invert()), 255 - plain)
    val, _ = load_split(shards, "val")
    assert torch.equal(first_batch(val, train=False, augment=Invert()), first_batch(val, train=False))
    assert ImageDecoder(24, train=False, augment=Invert()).augment is None
    data = png_bytes(np.random.default_rng(0), 24)
    assert ImageDecoder(24, train=True, augment=RandAugmentU8("rand-m9", 24, (0.5,) * 3))(data).dtype == torch.uint8


# --- random erasing, on the normalised batch ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["pixel", "const"])
def test_random_erasing_erases_the_expected_fraction_of_images_and_area(mode):
    random.seed(0)
    torch.manual_seed(0)
    erase = build_random_erasing(AugmentConfig(reprob=0.25, remode=mode), torch.device("cpu"))
    batch = torch.full((800, 3, 24, 24), 5.0)  # normalised units; 5 is neither the noise nor the constant 0
    erased = erase(batch.clone()) != 5.0  # (B, 3, H, W)
    hit = erased.flatten(1).any(1)
    assert 0.2 < hit.float().mean() < 0.3  # probability 0.25: 800 draws, 3.3 standard deviations either side
    area = erased[hit].all(1).float().mean((1, 2))  # fraction of each erased image, all channels
    assert area.min() >= 0.015 and area.max() <= 0.36  # timm's [0.02, 1/3] of the area, up to rounding of the sides
    for mask in erased[hit][:, 0]:  # one rectangle each: its rows and columns span a full block
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        assert mask.sum() == len(rows) * len(cols) == (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1)
    values = erase(torch.full((800, 3, 24, 24), 5.0))
    fill = values[values != 5.0]
    if mode == "pixel":  # per-pixel N(0, 1) in normalised units, as timm/DeiT
        assert abs(float(fill.mean())) < 0.05 and abs(float(fill.std()) - 1) < 0.05
    else:
        assert torch.all(fill == 0)
    assert build_random_erasing(AugmentConfig(), torch.device("cpu")) is None
