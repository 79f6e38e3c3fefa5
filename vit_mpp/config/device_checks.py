"""Settings that need a particular device: `data.decode=gpu` (JPEGs decoded on the device with nvJPEG) and
`train.fp8=true` (FP8 matmuls through torchao). A run that sets one where it cannot work is refused where it starts,
before anything is written, in one line that says what the setting needs (docs/pretrain.md#device-settings)."""

from __future__ import annotations

from typing import Any

from vit_mpp.config.engine import ConfigError
from vit_mpp.config.fsdp_settings import check_fsdp

FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada Lovelace (8.9), Hopper (9.0) and later
FP8_NEEDS = "a CUDA GPU of compute capability 8.9 or later (Ada Lovelace, Hopper) and torchao"


def check_device_settings(cfg: Any) -> None:
    """Raise a ConfigError when `cfg` (a stage config) sets `data.decode=gpu` or `train.fp8=true` and this machine
    cannot run it: no CUDA device, a GPU too old for FP8, torchao missing; decoding on the device with augmentations
    that must run on the decoded crop in the loader workers, or at all until a GPU run has verified it. torch is
    imported only when one of them is set, so that the config check of every other run stays free of it. Settings
    that cannot go with the launch's FSDP are refused here too (vit_mpp/config/fsdp_settings.py)."""
    check_fsdp(cfg)
    gpu_decode = getattr(cfg.data, "decode", "cpu") == "gpu"
    fp8 = bool(getattr(cfg.train, "fp8", False))
    if not (gpu_decode or fp8):
        return
    import torch

    cuda = torch.cuda.is_available()
    if gpu_decode:
        if not cuda:
            raise ConfigError("data.decode=gpu decodes JPEGs on a CUDA device (nvJPEG, torchvision.io.decode_jpeg "
                              "with device='cuda'), and this machine has none; use data.decode=cpu (the loader "
                              "workers decode)")
        rand_augment = getattr(getattr(cfg, "augment", None), "auto_augment", "")
        if rand_augment:
            raise ConfigError(f"data.decode=gpu crops and flips on the device, but augment.auto_augment="
                              f"{rand_augment!r} (RandAugment) runs on the decoded crop in the loader workers; use "
                              "data.decode=cpu, or augment.auto_augment=''")
        raise ConfigError("data.decode=gpu is built but not verified on a GPU: its first run (H100, torchvision "
                          "0.26) trained on NaN losses, nvJPEG's hardware decoder writing into memory the step still "
                          "read, and fed ViT-S/16 at 0.6 of CPU decoding; the fix in this version has not run on a "
                          "GPU yet (docs/data_stream.md#decoding-on-the-gpu); use data.decode=cpu")
    if not fp8:
        return
    if not cuda:
        raise ConfigError(f"train.fp8=true needs {FP8_NEEDS}, and this machine has no CUDA device; use train.fp8=false "
                          "(train.mixed_precision=bf16 is the fast path)")
    capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_CAPABILITY:
        raise ConfigError(f"train.fp8=true needs {FP8_NEEDS}; this GPU ({torch.cuda.get_device_name()}) is of compute "
                          f"capability {capability[0]}.{capability[1]}; use train.fp8=false")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"train.fp8=true needs torchao's float8 training, which does not import here ({e}): "
                          "pip install 'vit-mpp[fp8]', or use train.fp8=false") from None
