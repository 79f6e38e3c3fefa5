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
