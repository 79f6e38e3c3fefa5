"""`data.decode=gpu`: training JPEGs decoded on the device in batches (nvJPEG, `torchvision.io.decode_jpeg` with a
CUDA device), cropped, resized and flipped there. The loader workers read the bytes and the JPEG header only, and
draw each sample's crop and flip as the CPU path does (the same seeded draws, on the image's full size), so the
sample order and the audit are those of `data.decode=cpu`, and so are the crops where the CPU path decodes at full
size (it draws on the reduced size where draft mode applies). Other formats, and JPEGs nvJPEG does not
take (CMYK), are decoded in the workers as before. docs/data_stream.md#decoding-on-the-gpu."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

try:  # deprecated in torchvision 0.29 (see vit_mpp/data/image_decoder.py); batched and on CUDA since 0.19
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover - a torchvision without it: data.decode=gpu cannot work there
    decode_jpeg = None


@dataclass
class EncodedCrop:
    """A training sample's JPEG bytes and the crop (top, left, height, width, in the full image) and flip drawn for
    it in the worker: decoded on the device by `decode_on_device`."""

    data: torch.Tensor  # uint8 (n,)
    box: tuple[int, int, int, int]
    flip: bool


def collate_images(images: list[torch.Tensor | EncodedCrop], size: tuple[int, int]) -> dict[str, Any]:
    """The images of one micro-batch: {"image": uint8 (B, 3, H, W)}, and where some are still encoded, "jpeg": their
    bytes in one tensor (one shared-memory block per batch, not one per image), lengths, boxes, flips and places in
    the batch; their rows of "image" are zero until `decode_on_device` fills them."""
    if all(isinstance(x, torch.Tensor) for x in images):
        return {"image": torch.stack(images)}
    encoded = [(i, x) for i, x in enumerate(images) if isinstance(x, EncodedCrop)]
    image = torch.zeros(len(images), 3, *size, dtype=torch.uint8)
    for i, x in enumerate(images):
        if isinstance(x, torch.Tensor):
            image[i] = x
    return {"image": image, "jpeg": {
        "data": torch.cat([x.data for _, x in encoded]),
        "lengths": torch.tensor([x.data.numel() for _, x in encoded], dtype=torch.int64),
        "boxes": torch.tensor([x.box for _, x in encoded], dtype=torch.int64),
        "flips": torch.tensor([x.flip for _, x in encoded], dtype=torch.bool),
        "index": torch.tensor([i for i, _ in encoded], dtype=torch.int64)}}


def decode_on_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Fill the rows of `batch["image"]` (already on `device`) that `batch["jpeg"]` holds encoded: one batched
    decode, then each image's crop resized (bilinear, antialiased, as the CPU path) and flipped. A JPEG the device
    cannot decode (a damaged body the worker's header read did not see) is decoded on the CPU; one that fails there
    too is replaced by the batch's previous image, and counted as a bad sample (`bad`, `bad_keys`) like a sample
    the worker could not decode."""
    jpeg = batch.pop("jpeg")
    lengths = jpeg["lengths"].tolist()  # on the host: these tensors stay there (`to_device` leaves nested dicts)
    boxes, flips, index = jpeg["boxes"].tolist(), jpeg["flips"].tolist(), jpeg["index"].tolist()
    chunks = list(torch.split(jpeg["data"], lengths))
    decoded = _decode(chunks, device)
    image, height, width = batch["image"], batch["image"].shape[2], batch["image"].shape[3]
    crops, places, bad = [], [], []
    for img, (top, left, h, w), flip, i in zip(decoded, boxes, flips, index):
        if img is None:
            bad.append(i)
            continue
        crop = img[:, top:top + h, left:left + w].unsqueeze(0).float()
        crop = F.interpolate(crop, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
        crops.append(crop.flip(-1) if flip else crop)
        places.append(i)
    if crops:
        image[torch.tensor(places, device=image.device)] = torch.cat(crops).round_().clamp_(0, 255).to(torch.uint8)
    good = [j for j in range(image.shape[0]) if j not in bad]
    if bad and not good:
        raise RuntimeError(f"no JPEG of the batch could be decoded on {device} or the CPU: {batch['key'][:3]}...")
    for i in bad:  # like a worker's bad sample: the previous image of the batch (the next one for the first)
        source = max([j for j in good if j < i], default=min(good))
        image[i] = image[source]
        batch["bad_keys"] = [*batch["bad_keys"], batch["key"][i]]
        for name in ("key", "label", "epoch", "set"):
            batch[name][i] = batch[name][source]
    batch["bad"] = batch.get("bad", 0) + len(bad)
    return batch


def _decode(chunks: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """uint8 RGB (3, h, w) on `device` per JPEG (None for one nothing decodes), safely on a CUDA device."""
    if device.type != "cuda":
        return _decode_on(chunks, device)
    # nvJPEG's hardware decoder does not honour the stream it is given: it writes its outputs at once, into blocks
    # the caching allocator may have just freed on the caller's stream while queued kernels still read them (the
    # first run on an H100 trained on NaNs; docs/data_stream.md#decoding-on-the-gpu). So: wait for the caller's
    # stream, and decode on a stream of our own, whose pool holds no block the training step still uses; the outputs
    # are then handed to the caller's stream.
    caller = torch.cuda.current_stream(device)
    caller.synchronize()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side = _SIDE_STREAMS[device]
    with torch.cuda.stream(side):
        images = _decode_on(chunks, device)
    caller.wait_stream(side)
    for img in images:
        if img is not None:
            img.record_stream(caller)
    return images


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _decode_on(chunks: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """One batched call; where that fails, one JPEG at a time, on the device then the CPU."""
    try:
        return list(decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        pass
    out: list[torch.Tensor | None] = []
    for chunk in chunks:
        for where in (device, torch.device("cpu")):
            try:
                out.append(decode_jpeg(chunk, mode=ImageReadMode.RGB, device=where).to(device))
                break
            except RuntimeError:
                continue
        else:
            out.append(None)
    return out
