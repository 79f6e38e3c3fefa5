"""Turning a raw sample into the uint8 image tensor a model sees: its image member found by extension
(vit_mpp/data/image_formats.py), decoded (at a reduced scale where the crop allows), cropped and resized."""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as TV1
from torchvision.transforms import v2 as T
from torchvision.transforms.v2.functional import pil_to_tensor

from vit_mpp.config.sections import DataConfig, img_hw
from vit_mpp.data.device_decode import EncodedCrop
from vit_mpp.data.image_formats import IMAGE_EXTENSIONS, image_member

try:  # deprecated since torchvision 0.29 (for TorchCodec, which needs FFmpeg) and to be removed: where it is gone,
    # PIL decodes those JPEGs (the same libjpeg-turbo, the same pixels; tests/vit_mpp/test_image_decoder.py)
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover - a torchvision without it
    decode_jpeg = None


def image_bytes(sample: dict[str, Any]) -> bytes:
    """The bytes of a raw sample's image member (vit_mpp/data/image_formats.py); a KeyError when it has none."""
    ext = image_member(sample)
    if ext is None:
        raise KeyError(f"sample {sample.get('__key__')} has no image ({', '.join(IMAGE_EXTENSIONS)})")
    return sample[ext]


class ImageDecoder:
    """Bytes -> augmented uint8 tensor (3, H, W). Train: RandomResizedCrop + flip (+ `augment`); eval: resize + center
    crop.

    Decoding and resizing are most of a loader's cost, so: a JPEG large enough is decoded at 1/2, 1/4 or 1/8 scale
    (PIL's draft mode, DCT scaling) when that still leaves enough pixels for the smallest crop; any other JPEG is
    decoded by torchvision (libjpeg-turbo, straight into a tensor; by PIL where torchvision no longer has it); other
    formats by PIL. The crop and resize then run on the uint8 tensor in channels-last layout, where torch's
    antialiased resize is several times faster than PIL's. `augment` (training only, e.g. fine-tuning's
    RandAugment) takes the uint8 crop (3, H, W), in any memory layout, and returns a uint8 tensor of the same shape;
    it runs here, in the data-loader workers. `pool_augment`, when given, does the same for the pool images of
    semi-supervised fine-tuning instead (their strong view, `semi.strong`).
    """

    def __init__(self, img_size: int | tuple[int, int], train: bool, crop_scale: tuple[float, float] = (0.35, 1.0),
                 hflip: bool = True, eval_crop_pct: float = 0.875,
                 augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        h, w = img_hw(img_size)
        self.size = (h, w)
        self.augment = augment if train else None  # evaluation stays deterministic
        self.pool_augment: Callable[[torch.Tensor], torch.Tensor] | None = None  # see `for_training`
        self.train, self.hflip = train, hflip
        self.on_device = False  # see `decoding_on_device`
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

    @classmethod
    def for_training(cls, data: DataConfig, img_size: int | list[int],
                     augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     pool_augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ImageDecoder:
        """The training decoder `data` describes (crop scale, flips), with `augment` after the crop (`pool_augment`
        for a pool's images, when given)."""
        decoder = cls(img_size, train=True, crop_scale=tuple(data.crop_scale), hflip=data.hflip,
                      eval_crop_pct=data.eval_crop_pct, augment=augment)
        decoder.pool_augment = pool_augment
        return decoder.decoding_on_device() if data.decode == "gpu" else decoder

    def decoding_on_device(self) -> ImageDecoder:
        """This decoder for data.decode=gpu: a training JPEG leaves the worker encoded, with the crop and flip drawn
        for it (vit_mpp/data/device_decode.py); crops and flips only, so no `augment`. Evaluation is unchanged."""
        if self.train and (self.augment is not None or self.pool_augment is not None):
            raise ValueError("decoding on the device crops and flips there: an augment of the crop cannot run")
        self.on_device = self.train
        return self

    @classmethod
    def for_evaluation(cls, data: DataConfig, img_size: int | list[int]) -> ImageDecoder:
        """The evaluation decoder `data` describes (resize, centre crop of `data.eval_crop_pct`)."""
        return cls(img_size, train=False, eval_crop_pct=data.eval_crop_pct)

    def decode(self, data: bytes) -> torch.Tensor:
        """Bytes -> uint8 RGB tensor (3, H, W), at a reduced scale where the crop allows it (see the class doc)."""
        img = Image.open(io.BytesIO(data))  # reads the header only
        if (decode_jpeg is not None and img.format == "JPEG"
                and min(img.size[0] // self.draft[0], img.size[1] // self.draft[1]) < 2):
            return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        img.draft("RGB", self.draft)  # a no-op except for JPEGs
        return pil_to_tensor(img.convert("RGB"))

    def _encoded_crop(self, data: bytes, size: tuple[int, int]) -> EncodedCrop:
        """The bytes with the crop and flip the CPU path would draw for an image of `size` (width, height): the same
        calls on the same generator, on the full size (the CPU path draws on the size it decoded at, which draft mode
        can reduce: there the two crops are drawn alike but land elsewhere)."""
        width, height = size
        crop = self.transform.transforms[0]  # the CPU path's RandomResizedCrop: its scale and ratio
        top, left, h, w = TV1.RandomResizedCrop.get_params(torch.empty(1, height, width, dtype=torch.uint8),
                                                          list(crop.scale), list(crop.ratio))
        flip = self.hflip and bool(torch.rand(1) < 0.5)
        return EncodedCrop(torch.frombuffer(bytearray(data), dtype=torch.uint8), (top, left, h, w), flip)

    def __call__(self, data: bytes, seed: int | None = None, weak: bool = False) -> Any:
        """The model's input for an image's bytes. With `seed` the random crop, flip and `augment` are drawn from it
        alone (torch's and Python's generators, restored after): a sample then gets the same augmentation whenever and
        by whichever worker it is read, so a resumed run sees what the uninterrupted run saw. With `weak` (a pool
        image of semi-supervised fine-tuning): the pair (input, weak view), the weak view being the crop and flip
        before the augmentation (`pool_augment` when given, else `augment`)."""
        if seed is None:
            return self._prepare(data, weak)
        # The CPU generator alone (torch.manual_seed would also seed CUDA, 100x slower); Python's `random` and numpy's
        # only for `augment` (timm's RandAugment draws its magnitudes from the one, its ops from the other), since
        # seeding them costs more than the rest. Unseeded, numpy's state is the one a worker was forked with, which
        # differs in a resumed run.
        generator, torch_state = torch.default_generator, torch.default_generator.get_state()
        augments = self.augment is not None or self.pool_augment is not None
        states = (random.getstate(), np.random.get_state()) if augments else None
        generator.manual_seed(seed)
        if states is not None:
            random.seed(seed)
            np.random.seed(seed % 2**32)
        try:
            return self._prepare(data, weak)
        finally:
            generator.set_state(torch_state)
            if states is not None:
                random.setstate(states[0])
                np.random.set_state(states[1])

    def _prepare(self, data: bytes, weak: bool = False) -> Any:
        if self.on_device:
            img = Image.open(io.BytesIO(data))  # the header only: size and colour mode
            if img.format == "JPEG" and img.mode in ("RGB", "L"):  # what nvJPEG decodes to RGB (not CMYK)
                return self._encoded_crop(data, img.size)
        x = self.decode(data).unsqueeze(0).contiguous(memory_format=torch.channels_last)  # (1, 3, h, w)
        x = self.transform(x)[0]  # (3, H, W) uint8, channels-last in memory
        crop = x.contiguous() if weak else None
        augment = self.pool_augment if weak and self.pool_augment is not None else self.augment
        if augment is not None:
            x = augment(x)
        return x.contiguous() if crop is None else (x.contiguous(), crop)
