"""The loader's decoder gives the same pixels whichever library decodes a JPEG: torchvision's `decode_jpeg` is
deprecated (torchvision 0.29) and will go, and PIL then decodes those images."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from vit_mpp.data import image_decoder
from vit_mpp.data.image_decoder import ImageDecoder


def jpeg(width: int, height: int, mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((width, height), Image.BILINEAR).convert(mode)
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90)
    return out.getvalue()


CASES = [(97, 131, "RGB"), (40, 30, "RGB"), (64, 64, "L"), (120, 80, "CMYK"), (400, 300, "RGB")]  # the last: draft


@pytest.mark.parametrize("train", [False, True])
def test_a_jpeg_decodes_to_the_same_tensor_without_torchvisions_decoder(train, monkeypatch):
    decoder = ImageDecoder(32, train=train)
    images = [jpeg(w, h, mode, seed) for seed, (w, h, mode) in enumerate(CASES)]
    used = []
    real = image_decoder.decode_jpeg
    monkeypatch.setattr(image_decoder, "decode_jpeg", lambda *a, **k: used.append(1) or real(*a, **k))
    with_torchvision = [decoder(data, seed=7) for data in images]
    assert 0 < len(used) < len(CASES)  # small JPEGs went through torchvision, larger ones through PIL's draft
    monkeypatch.setattr(image_decoder, "decode_jpeg", None)
    for data, expected in zip(images, with_torchvision):
        got = decoder(data, seed=7)
        assert got.dtype == torch.uint8 and got.shape == (3, 32, 32)
        assert torch.equal(got, expected)


def test_a_seeded_randaugment_draws_the_same_whatever_numpys_state():
    """timm's RandAugment picks its ops with numpy's global generator: a worker forked after a resume has another
    state than the uninterrupted run's, so the seed must fix it too (the resumed fine-tuning once diverged)."""
    from finetune.augment import RandAugmentU8

    decoder = ImageDecoder(16, train=True, augment=RandAugmentU8("rand-m9-n3-mstd0.5-inc1", 16, (0.5, 0.5, 0.5)))
    data = jpeg(40, 32, "RGB", 3)
    got = []
    for state in (1, 2, 3):
        np.random.seed(state)
        got.append(decoder(data, seed=11))
        assert np.random.randint(1 << 30) == np.random.RandomState(state).randint(1 << 30)  # its state kept
    assert all(torch.equal(got[0], g) for g in got[1:])
    assert any(not torch.equal(got[0], decoder(data, seed=s)) for s in range(12, 20))  # the seed still matters


def test_a_loader_leaves_the_global_generator_alone(tmp_path):
    """Starting a loader's iterator draws its workers' base seed from the loader's own generator, not torch's global
    one, which the device's augmentations (colour jitter, erasing) draw from: a resumed run starts its iterator after
    the checkpoint restored that generator (the resumed fine-tuning with colour jitter once diverged)."""
    from tests.helpers.loaders import split_loader
    from tests.helpers.shards import write_shard_set
    from vit_mpp.config.sections import DataConfig
    from vit_mpp.data.manifest import load_split

    split = load_split(write_shard_set(tmp_path / "s", {"train": [8]}), "train")[0]
    for workers in (0, 1):
        torch.manual_seed(5)
        before = torch.get_rng_state()
        stream, loader = split_loader(split, DataConfig(num_workers=workers, shuffle_buffer=0), 16, 4)
        batches = iter(loader)
        next(batches)
        del batches
        assert torch.equal(torch.get_rng_state(), before)
