"""What a training step asks of the hardware: the FLOPs of a timm ViT per image (`vit_forward_flops`,
`training_flops`) and the peak FLOP/s of the device (`peak_flops`: `train.peak_tflops`, else a table of common GPUs),
from which vit_mpp/run/metering/step_meter.py logs the model FLOPs utilisation (MFU). See
docs/pretrain.md#what-a-run-prints.
"""

from __future__ import annotations

import math
import re

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

# Dense (no sparsity) peak TFLOP/s of one GPU from its maker's datasheet: (16-bit tensor cores with fp32
# accumulation, TF32 tensor cores, plain fp32). Matched in this order against torch.cuda.get_device_name(), so that a
# variant comes before its family. V100 and T4 have no bf16 tensor cores: their 16-bit figure is fp16's.
PEAK_TFLOPS = (
    (r"\bH100 PCIe\b", (756.0, 378.0, 51.0)),
    (r"\bH100 NVL\b", (835.0, 418.0, 60.0)),
    (r"\bH200 NVL\b", (835.0, 418.0, 60.0)),
    (r"\bG?H[12]00\b", (989.0, 494.0, 67.0)),  # H100 SXM, H200 SXM, GH200
    (r"\bA100\b", (312.0, 156.0, 19.5)),
    (r"\bL40S\b", (362.0, 183.0, 91.6)),
    (r"\bL40\b", (181.0, 90.5, 90.5)),
    (r"\bL4\b", (121.0, 60.0, 30.3)),
    (r"\bA10\b", (125.0, 62.5, 31.2)),
    (r"\bV100-PCIE", (112.0, 14.0, 14.0)),
    (r"\bV100\b", (125.0, 15.7, 15.7)),
    (r"\bT4\b", (65.0, 8.1, 8.1)),
    (r"\bRTX 4090\b", (165.2, 82.6, 82.6)),
    (r"\bRTX 3090\b", (71.0, 35.6, 35.6)),
)


def table_tflops(device_name: str, mixed_precision: str, tf32: bool) -> float | None:
    """The table's peak TFLOP/s of the GPU named `device_name` at the run's precision (`bf16`/`fp16`: the 16-bit
    tensor cores; `no`: TF32 when `tf32` matmuls are allowed, else fp32); None for a GPU the table does not know."""
    for pattern, (half, tf32_peak, fp32) in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return half if mixed_precision in ("bf16", "fp16") else (tf32_peak if tf32 else fp32)
    return None


def peak_flops(device: torch.device, mixed_precision: str, peak_tflops: float = 0.0) -> float | None:
    """The peak FLOP/s of one device: `peak_tflops` (train.peak_tflops) when above 0, else the table's figure for
    this CUDA device; None otherwise (a CPU, an unknown GPU): no MFU is then reported."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    tflops = table_tflops(torch.cuda.get_device_name(device), mixed_precision, tf32)
    return None if tflops is None else tflops * 1e12


def find_vit(model: nn.Module) -> VisionTransformer | None:
    """The timm VisionTransformer inside a stage's model (pretraining wraps it, fine-tuning is one)."""
    return next((m for m in model.modules() if isinstance(m, VisionTransformer)), None)


def vit_forward_flops(vit: VisionTransformer) -> float:
    """FLOPs of one image's forward pass through the encoder, two per multiply-add: the patch embedding (N patches,
    each C x P x P inputs to D outputs) and, in each block on every one of the T = N + prefix tokens, its linear
    layers (qkv 3D^2, projection D^2, MLP 2 x 4D^2 for timm's ratio 4) and attention's two T x T products (scores
    and weighted values, T^2 D each): 24 T D^2 + 4 T^2 D per block. Norms, activations, softmax, biases, the
    position embedding and the heads are left out (under 1% for ViT-B/16 at 224: 35.1 GFLOPs counted)."""
    conv = vit.patch_embed.proj
    patches = vit.patch_embed.num_patches
    tokens = patches + vit.num_prefix_tokens
    macs = patches * conv.in_channels * math.prod(conv.kernel_size) * conv.out_channels
    for block in vit.blocks:
        macs += tokens * sum(m.in_features * m.out_features for m in block.modules() if isinstance(m, nn.Linear))
        attn_dim = block.attn.qkv.out_features // 3
        macs += 2 * tokens * tokens * attn_dim
    return 2.0 * macs


def training_flops(model: nn.Module) -> float | None:
    """FLOPs one training image costs `model` (a stage's, unwrapped): 3 x the forward when the encoder trains (the
    backward pass is twice the forward), 1 x when it is frozen (a linear probe); recomputation by gradient
    checkpointing is not counted (model FLOPs, not hardware FLOPs). None without a timm ViT inside."""
    vit = find_vit(model)
    if vit is None:
        return None
    trains = any(p.requires_grad for p in vit.blocks.parameters())
    return vit_forward_flops(vit) * (3 if trains else 1)
