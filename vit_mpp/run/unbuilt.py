"""Settings this version names but does not build yet: `data.decode=gpu` (JPEGs decoded on the device with nvJPEG)
and `train.fp8=true` (FP8 matmuls through torchao). A run that sets one is refused where it starts, before anything
is written, in one line that says what the setting needs and that it is not implemented (docs/pretrain.md)."""

from __future__ import annotations

from typing import Any

from vit_mpp import __version__
from vit_mpp.config.engine import ConfigError

FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada Lovelace (8.9), Hopper (9.0) and later


def refuse_unbuilt(cfg: Any) -> None:
    """Raise a ConfigError when `cfg` (a stage config) sets `data.decode=gpu` or `train.fp8=true`: on a machine
    without CUDA, that the setting needs a CUDA device (FP8: of compute capability 8.9+, and torchao); on one with a
    GPU, that this version does not implement it yet. torch is imported only when one of them is set, so that the
    config check of every other run stays free of it."""
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
        raise ConfigError(f"data.decode=gpu is not implemented in this version (vit-mpp {__version__}): JPEGs are "
                          "decoded in the loader workers; use data.decode=cpu")
    need = "a CUDA GPU of compute capability 8.9 or later (Ada Lovelace, Hopper) and torchao"
    if not cuda:
        raise ConfigError(f"train.fp8=true needs {need}, and this machine has no CUDA device; use train.fp8=false "
                          "(train.mixed_precision=bf16 is the fast path)")
    capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_CAPABILITY:
        raise ConfigError(f"train.fp8=true needs {need}; this GPU ({torch.cuda.get_device_name()}) is of compute "
                          f"capability {capability[0]}.{capability[1]}; use train.fp8=false")
    raise ConfigError(f"train.fp8=true is not implemented in this version (vit-mpp {__version__}): FP8 training "
                      "through torchao is not built yet; use train.fp8=false (train.mixed_precision=bf16 is the "
                      "fast path)")
