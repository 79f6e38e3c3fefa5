"""The FLOPs a ViT costs per image (vit_mpp/models/flops.py) are what torch's own FLOP counter counts for the encoder's
forward pass (24 T D^2 + 4 T^2 D per block, the patch embedding), training triples them unless the encoder is frozen,
and the peak FLOP/s comes from train.peak_tflops or a table of common GPUs by name, never on a CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.models import SMALL_MODEL
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.flops import peak_flops, table_tflops, training_flops, vit_forward_flops
from vit_mpp.models.vit import create_vit


@pytest.mark.parametrize("cfg", [SMALL_MODEL, ModelConfig(img_size=32, patch_size=8, embed_dim=48, depth=3,
                                                          num_heads=3, mlp_ratio=2.0)])
def test_the_forward_flops_are_what_torch_counts(cfg):
    vit = create_vit(cfg).eval()
    size = cfg.img_size
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        vit.forward_features(torch.zeros(1, 3, size, size))
    assert vit_forward_flops(vit) == counter.get_total_flops()
    tokens, width, blocks = vit.patch_embed.num_patches + 1, vit.embed_dim, len(vit.blocks)
    if cfg is SMALL_MODEL:  # timm's MLP ratio 4: the formula the docs give
        embed = 2 * vit.patch_embed.num_patches * 3 * 4 * 4 * width
        assert vit_forward_flops(vit) == embed + blocks * (24 * tokens * width**2 + 4 * tokens**2 * width)


def test_training_costs_three_forward_passes_and_a_frozen_encoder_one():
    vit = create_vit(SMALL_MODEL)
    assert training_flops(vit) == 3 * vit_forward_flops(vit)
    for p in vit.parameters():
        p.requires_grad_(False)
    assert training_flops(vit) == vit_forward_flops(vit)
    assert training_flops(torch.nn.Linear(2, 2)) is None  # no ViT inside: no MFU


@pytest.mark.parametrize("name, precision, tf32, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.0), ("NVIDIA H100 PCIe", "bf16", False, 756.0),
    ("NVIDIA H100 NVL", "fp16", False, 835.0), ("NVIDIA H200", "bf16", False, 989.0),
    ("NVIDIA GH200 480GB", "bf16", False, 989.0), ("NVIDIA H100 80GB HBM3", "no", True, 494.0),
    ("NVIDIA H100 80GB HBM3", "no", False, 67.0), ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
    ("NVIDIA A100 80GB PCIe", "no", True, 156.0), ("NVIDIA L40S", "bf16", False, 362.0),
    ("NVIDIA L40", "bf16", False, 181.0), ("NVIDIA L4", "bf16", False, 121.0), ("NVIDIA A10", "bf16", False, 125.0),
    ("NVIDIA A10G", "bf16", False, None), ("Tesla V100-SXM2-16GB", "fp16", False, 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", False, 112.0), ("Tesla T4", "fp16", False, 65.0),
    ("NVIDIA GeForce RTX 4090", "bf16", False, 165.2), ("NVIDIA GeForce RTX 3090", "no", False, 35.6),
    ("NVIDIA B200", "bf16", False, None),
])
def test_the_peak_of_a_gpu_comes_from_its_name_and_the_runs_precision(name, precision, tf32, tflops):
    assert table_tflops(name, precision, tf32) == tflops


def test_a_cpu_has_no_peak_unless_one_is_given():
    assert peak_flops(torch.device("cpu"), "no") is None
    assert peak_flops(torch.device("cpu"), "bf16", peak_tflops=120.0) == 120e12
