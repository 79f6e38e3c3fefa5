"""Settings this version names but does not build (vit_mpp/run/unbuilt.py): `data.decode=gpu` and `train.fp8=true`
are one `error:` line, exit status 2, before anything is written, in both stages and from code (`start_run`), on a
machine without CUDA (they need one) and on one with a GPU (not implemented yet), whatever the GPU."""

from __future__ import annotations

import pytest
import torch

from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from pretrain.config import PretrainConfig
from tests.helpers.processes import in_process
from vit_mpp import __version__
from vit_mpp.config.engine import ConfigError, load_config
from vit_mpp.run.unbuilt import refuse_unbuilt

NO_CUDA = {"data.decode=gpu": "error: data.decode=gpu decodes JPEGs on a CUDA device (nvJPEG, "
                              "torchvision.io.decode_jpeg with device='cuda'), and this machine has none; use "
                              "data.decode=cpu (the loader workers decode)",
           "train.fp8=true": "error: train.fp8=true needs a CUDA GPU of compute capability 8.9 or later (Ada Lovelace, "
                             "Hopper) and torchao, and this machine has no CUDA device; use train.fp8=false "
                             "(train.mixed_precision=bf16 is the fast path)"}


def a_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H100 80GB HBM3"):
    """What torch tells of the machine's device: `capability` and `name`, or no CUDA device (None)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


def pretrain_argv(shards, run_dir, *overrides: str) -> list[str]:
    return ["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}", *overrides]


@pytest.mark.parametrize("setting", list(NO_CUDA))
def test_without_cuda_each_needs_a_cuda_device(setting, demo_shards, tmp_path, monkeypatch, capsys):
    a_gpu(monkeypatch, None)
    code, _, err = in_process(pretrain_main, pretrain_argv(demo_shards, tmp_path / "run", setting), capsys)
    assert code == 2 and err.strip().splitlines() == [NO_CUDA[setting]], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, line", [
    ("data.decode=gpu", f"error: data.decode=gpu is not implemented in this version (vit-mpp {__version__}): JPEGs "
                        "are decoded in the loader workers; use data.decode=cpu"),
    ("train.fp8=true", f"error: train.fp8=true is not implemented in this version (vit-mpp {__version__}): FP8 "
                       "training through torchao is not built yet; use train.fp8=false (train.mixed_precision=bf16 is "
                       "the fast path)"),
])
def test_on_a_gpu_each_is_not_implemented_yet(setting, line, demo_shards, tmp_path, monkeypatch, capsys):
    a_gpu(monkeypatch)
    code, _, err = in_process(pretrain_main, pretrain_argv(demo_shards, tmp_path / "run", setting, "--dry-run"),
                              capsys)
    assert code == 2 and err.strip().splitlines() == [line], err
    assert not (tmp_path / "run").exists()


def test_fp8_on_a_gpu_before_ada_says_what_it_needs(demo_shards, encoder_export, tmp_path, monkeypatch, capsys):
    a_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
                                              f"init.checkpoint={encoder_export}", f"train.run_dir={tmp_path / 'run'}",
                                              "train.fp8=true"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: train.fp8=true needs a CUDA GPU of compute capability 8.9 or later (Ada Lovelace, Hopper) and torchao; "
        "this GPU (NVIDIA A100-SXM4-80GB) is of compute capability 8.0; use train.fp8=false"], err
    assert not (tmp_path / "run").exists()


def test_a_run_started_from_code_is_refused_before_its_run_directory(demo_shards, tmp_path, monkeypatch):
    from pretrain.train import train

    a_gpu(monkeypatch)
    cfg = load_config(PretrainConfig, "configs/pretrain/tiny.yaml",
                      [f"data.shards={demo_shards}", f"train.run_dir={tmp_path / 'run'}", "data.decode=gpu"])
    with pytest.raises(ConfigError, match="data.decode=gpu is not implemented in this version"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_the_defaults_pass_and_ask_nothing_of_torch(monkeypatch):
    def no(*args):
        raise AssertionError("the device was asked about")

    monkeypatch.setattr(torch.cuda, "is_available", no)
    refuse_unbuilt(load_config(PretrainConfig, "configs/pretrain/tiny.yaml", ["data.decode=cpu", "train.fp8=false"]))
