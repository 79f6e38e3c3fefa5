"""`train.fp8=true` (vit_mpp/models/fp8.py through vit_mpp/run/start/accelerator.py `prepare_model`): the linear layers
whose sizes divide by 16 become torchao's Float8Linear, the parameters stay the objects the optimizer holds, and a
step trains. torch runs FP8 matmuls on the CPU, slowly: the speed is measured on a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import MPPConfig, PretrainConfig
from pretrain.mpp import MaskedPatchPrediction
from vit_mpp.config.engine import load_config
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.fp8 import fp8_eligible, to_fp8
from vit_mpp.models.vit import create_vit, norm_stats
from vit_mpp.run.optimizer import build_optimizer
from vit_mpp.run.start.accelerator import make_accelerator, prepare_model

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

MODEL = ModelConfig(name="vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)


def test_only_linears_whose_sizes_divide_by_16_are_swapped_and_the_parameters_stay_the_same_objects():
    model = create_vit(MODEL, num_classes=10)
    params = dict(model.named_parameters())
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    swapped = to_fp8(model, "tensorwise")
    assert swapped == [n for n in linears if n != "head"]  # 32 -> 10 classes stays in bf16
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in swapped)
    assert not isinstance(model.head, Float8Linear) and not fp8_eligible(model.head)
    assert all(p is params[n] for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="fp8 recipe must be one of"):
        to_fp8(create_vit(MODEL), "blockwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_mpp_step_computes_the_bf16_loss_within_a_few_percent_and_trains(recipe):
    torch.manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 16, 16), dtype=torch.uint8)
    losses = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        encoder = create_vit(MODEL)
        model = MaskedPatchPrediction(encoder, MPPConfig(), *norm_stats(encoder))
        if fp8:
            to_fp8(model, recipe, emulate=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        run = []
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(images, generator=torch.Generator().manual_seed(1))["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.append(loss.item())
        losses[fp8] = run
    assert abs(losses[True][0] - losses[False][0]) < 0.05 * losses[False][0], losses
    assert losses[True][-1] < losses[True][0], losses


def test_prepare_model_swaps_before_the_accelerator_and_a_step_runs(tmp_path, capsys):
    cfg = load_config(PretrainConfig, "configs/pretrain/tiny.yaml", [f"train.run_dir={tmp_path}", "train.fp8=true"])
    accelerator, _ = make_accelerator(cfg.train)
    encoder = create_vit(cfg.model)
    model = MaskedPatchPrediction(encoder, cfg.mpp, *norm_stats(encoder))
    model, optimizer = prepare_model(accelerator, model, lambda m: build_optimizer(m, cfg.optim, 1e-3), cfg.train)
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    assert "linear layers in FP8 (tensorwise scaling, torchao); without train.compile=true" in capsys.readouterr().out
    images = torch.randint(0, 256, (4, 3, cfg.model.img_size, cfg.model.img_size), dtype=torch.uint8)
    loss = model(images, generator=torch.Generator().manual_seed(0))["loss"]
    accelerator.backward(loss)
    optimizer.step()
    assert torch.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability 8.9+")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_on_an_fp8_gpu_an_mpp_step_computes_the_bf16_loss_within_a_few_percent(recipe):
    model_cfg = ModelConfig(name="vit_small_patch16_224", img_size=64)
    images = torch.randint(0, 256, (32, 3, 64, 64), dtype=torch.uint8, device="cuda")
    losses = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        encoder = create_vit(model_cfg)
        model = MaskedPatchPrediction(encoder, MPPConfig(), *norm_stats(encoder)).cuda()
        if fp8:
            to_fp8(model, recipe)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(images, generator=torch.Generator("cuda").manual_seed(1))["loss"]
        loss.backward()
        losses[fp8] = loss.item()
    assert abs(losses[True] - losses[False]) < 0.05 * losses[False], losses
