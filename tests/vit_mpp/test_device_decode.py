"""`data.decode=gpu` (vit_mpp/data/device_decode.py), run here with the CPU as the device (torchvision decodes the
same batch call on either): the workers send JPEG bytes with the crop and flip the CPU path draws, and what comes out
of `to_device` is the CPU path's batch (same keys in the same order, pixels within 1 of its resize); PNGs and CMYK
JPEGs are decoded in the workers; a body that does not decode is replaced and counted as a bad sample."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.loaders import split_loader
from tests.helpers.shards import png_bytes
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.device_decode import EncodedCrop, collate_images, decode_on_device
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import load_split
from vit_mpp.data.stream import to_device

CPU = torch.device("cpu")


def jpeg(rng: np.random.Generator, w: int, h: int, mode: str = "RGB") -> bytes:
    """A JPEG with smooth structure (random noise would make every resize difference large)."""
    arr = np.cumsum(rng.integers(0, 40, (h, w, 3)), axis=1) % 256
    img = Image.fromarray(arr.astype(np.uint8), "RGB")
    out = io.BytesIO()
    (img.convert(mode) if mode != "RGB" else img).save(out, "JPEG", quality=90)
    return out.getvalue()


def batch_of(images: list, size: tuple[int, int]) -> dict:
    n = len(images)
    return {**collate_images(images, size), "key": [f"k{i}" for i in range(n)], "label": torch.arange(n),
            "epoch": [0] * n, "set": [0] * n, "bad": 0, "bad_keys": []}


def test_a_batch_decoded_on_the_device_is_the_cpu_paths_batch_within_one_level():
    rng = np.random.default_rng(0)
    datas = [jpeg(rng, 50 + 7 * i, 40 + 5 * i) for i in range(6)] + [jpeg(rng, 40, 30, "L"), png_bytes(rng, 30)]
    cpu = ImageDecoder(32, train=True, crop_scale=(0.35, 1.0))
    dev = ImageDecoder(32, train=True, crop_scale=(0.35, 1.0)).decoding_on_device()
    reference = torch.stack([cpu(d, seed=s) for s, d in enumerate(datas)])
    items = [dev(d, seed=s) for s, d in enumerate(datas)]
    assert [isinstance(x, EncodedCrop) for x in items] == [True] * 7 + [False]  # the PNG is decoded in the worker
    assert any(x.flip for x in items[:7]) and not all(x.flip for x in items[:7])
    out = decode_on_device(batch_of(items, (32, 32)), CPU)
    assert "jpeg" not in out and out["image"].dtype == torch.uint8 and out["image"].shape == (8, 3, 32, 32)
    assert (out["image"].int() - reference.int()).abs().max() <= 1
    assert torch.equal(out["image"][7], reference[7])
    assert out["bad"] == 0 and out["bad_keys"] == []


def test_cmyk_jpegs_and_an_all_decoded_batch_stay_on_the_cpu_path():
    rng = np.random.default_rng(1)
    dev = ImageDecoder(16, train=True).decoding_on_device()
    cmyk = dev(jpeg(rng, 30, 30, "CMYK"), seed=0)
    assert isinstance(cmyk, torch.Tensor) and cmyk.shape == (3, 16, 16)
    assert set(collate_images([cmyk, cmyk], (16, 16))) == {"image"}


def test_the_workers_send_one_block_of_bytes_per_batch():
    rng = np.random.default_rng(2)
    dev = ImageDecoder(16, train=True).decoding_on_device()
    datas = [jpeg(rng, 30, 20) for _ in range(3)]
    jpeg_part = collate_images([dev(d, seed=i) for i, d in enumerate(datas)], (16, 16))["jpeg"]
    assert jpeg_part["data"].numel() == sum(map(len, datas)) and jpeg_part["lengths"].tolist() == list(map(len, datas))
    assert jpeg_part["index"].tolist() == [0, 1, 2]


def test_a_body_that_does_not_decode_is_replaced_by_the_previous_image_and_counted_bad():
    rng = np.random.default_rng(3)
    dev = ImageDecoder(16, train=True).decoding_on_device()
    good = [jpeg(rng, 30, 20) for _ in range(3)]
    header = good[1][:200]  # the header parses (the worker's read), the body is gone
    broken = header + bytes(400)
    items = [dev(d, seed=i) for i, d in enumerate([good[0], broken, good[2]])]
    assert isinstance(items[1], EncodedCrop)
    batch = batch_of(items, (16, 16))
    out = decode_on_device(batch, CPU)
    assert out["bad"] == 1 and out["bad_keys"] == ["k1"]
    assert out["key"] == ["k0", "k0", "k2"] and out["label"].tolist() == [0, 0, 2]
    assert torch.equal(out["image"][1], out["image"][0])


@pytest.mark.parametrize("workers", [0, 2])
def test_the_stream_with_gpu_decode_gives_the_cpu_streams_samples_in_order(demo_shards, workers):
    split, _ = load_split(demo_shards, "train")
    batches = {}
    for decode in ("cpu", "gpu"):
        data = DataConfig(num_workers=workers, decode=decode)
        stream, loader = split_loader(split, data, 16, 8)
        raw = list(itertools.islice(loader, 12))  # past an epoch of 80
        assert all(("jpeg" in b) == (decode == "gpu") for b in raw)  # the demo's images are JPEGs
        batches[decode] = [to_device(b, CPU) for b in raw]
        stream.close()
    for cpu, gpu in zip(batches["cpu"], batches["gpu"]):
        assert gpu["key"] == cpu["key"] and gpu["epoch"] == cpu["epoch"] and torch.equal(gpu["label"], cpu["label"])
        # The demo's 24 px JPEGs are not reduced by draft mode: the same crops, resized within one level.
        assert (gpu["image"].int() - cpu["image"].int()).abs().max() <= 1


def test_an_augment_of_the_crop_cannot_run_with_device_decoding():
    with pytest.raises(ValueError, match="crops and flips there"):
        ImageDecoder(16, train=True, augment=lambda x: x).decoding_on_device()
    assert not ImageDecoder(16, train=False).decoding_on_device().on_device  # evaluation decodes in the workers



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_nvjpeg_gives_the_cpu_paths_batch_within_a_few_levels():
    rng = np.random.default_rng(0)
    datas = [jpeg(rng, 120 + 7 * i, 90 + 5 * i) for i in range(8)] + [jpeg(rng, 80, 60, "L"), png_bytes(rng, 30)]
    cpu = ImageDecoder(64, train=True)
    dev = ImageDecoder(64, train=True).decoding_on_device()
    reference = torch.stack([cpu(d, seed=s) for s, d in enumerate(datas)])
    out = to_device(batch_of([dev(d, seed=s) for s, d in enumerate(datas)], (64, 64)), torch.device("cuda"))
    diff = (out["image"].cpu().int() - reference.int()).abs()
    # nvJPEG's IDCT and upsampling are not libjpeg-turbo's: close, not equal
    assert diff.float().mean() < 1.5 and diff.max() <= 24, (diff.float().mean(), diff.max())
    assert out["image"].device.type == "cuda" and out["bad"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_decoding_never_writes_into_memory_that_queued_kernels_still_read():
    """The failure of the first H100 run: blocks freed on the caller's stream while kernels queued there still read
    them are handed to nvJPEG, which writes at once. Here each iteration queues a long kernel, then a sum of each
    block, frees the blocks and decodes: every sum must still be the blocks' own."""
    from vit_mpp.data.device_decode import _decode

    rng = np.random.default_rng(4)
    chunks = [torch.frombuffer(bytearray(jpeg(rng, 500, 375)), dtype=torch.uint8) for _ in range(32)]
    cuda, wrong = torch.device("cuda"), 0
    for _ in range(20):
        blocks = [torch.ones(3 * 375 * 500, dtype=torch.uint8, device=cuda) for _ in chunks]  # the outputs' size
        torch.cuda._sleep(100_000_000)  # about 50-100 ms of queued work before the sums
        sums = [b.sum(dtype=torch.int64) for b in blocks]
        del blocks
        images = _decode(chunks, cuda)
        wrong += sum(int(s) != 3 * 375 * 500 for s in sums)
        assert all(img is not None and img.shape == (3, 375, 500) for img in images)
    assert wrong == 0
