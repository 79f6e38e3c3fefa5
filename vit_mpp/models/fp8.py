"""FP8 matmuls for training (`train.fp8=true`): the model's linear layers swapped for torchao's `Float8Linear`, which
casts input, weight and gradient to FP8 with dynamic scales and runs the matmuls on FP8 tensor cores (compute
capability 8.9+). The parameters stay the same objects in bf16/fp32, so the optimizer, checkpoints and exports do
not change. Measured against bf16 in docs/benchmarks.md (the GPU suite)."""

from __future__ import annotations

import dataclasses

import torch

RECIPES = ("tensorwise", "rowwise")


def fp8_eligible(module: torch.nn.Module, fqn: str = "") -> bool:
    """FP8 GEMMs need both sizes of a weight to divide by 16: a classifier head of 1000 or 10 classes stays in bf16."""
    return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def to_fp8(model: torch.nn.Module, recipe: str = "tensorwise", emulate: bool = False) -> list[str]:
    """Swap `model`'s eligible linear layers for torchao's Float8Linear (in place) with `recipe`'s scaling; the names
    of the layers swapped. `emulate` computes in FP8 arithmetic without FP8 hardware (for tests on a CPU: slow)."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {RECIPES}, got {recipe!r}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    names = [name for name, m in model.named_modules() if fp8_eligible(m, name)]
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_eligible)
    return names
