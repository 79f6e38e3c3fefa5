"""Settings that need a device (vit_mpp/config/device_checks.py): `data.decode=gpu` and `train.fp8=true` are one
`error:` line, exit status 2, before anything is written, in both stages and from code (`start_run`), where they
cannot run: no CUDA device, a GPU before Ada for FP8, no torchao, RandAugment in the workers with device decoding.
The GPU is torch's answers, patched."""

from __future__ import annotations

import sys

import pytest
import torch

from finetune.__main__ import main as finetune_main
from pretrain.__main__ import main as pretrain_main
from pretrain.config import PretrainConfig
from tests.helpers.processes import in_process
from vit_mpp.config.device_checks import check_device_settings
from vit_mpp.config.engine import ConfigError, load_config

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


def test_on_a_gpu_decode_with_rand_augment_in_the_workers_is_refused(demo_shards, encoder_export, tmp_path,
                                                                    monkeypatch, capsys):
    a_gpu(monkeypatch)
    code, _, err = in_process(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={demo_shards}",
                                              f"init.checkpoint={encoder_export}", f"train.run_dir={tmp_path / 'run'}",
                                              "data.decode=gpu", "augment.auto_augment=rand-m9-n2"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: data.decode=gpu crops and flips on the device, but augment.auto_augment='rand-m9-n2' (RandAugment) "
        "runs on the decoded crop in the loader workers; use data.decode=cpu, or augment.auto_augment=''"], err
    assert not (tmp_path / "run").exists()


def test_on_a_hopper_gpu_fp8_without_torchao_says_how_to_install_it(monkeypatch):
    a_gpu(monkeypatch)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # `import torchao.float8` then raises ImportError
    with pytest.raises(ConfigError, match=r"train.fp8=true needs torchao's float8 training, which does not import "
                                          r"here .*pip install 'vit-mpp\[fp8\]', or use train.fp8=false"):
        check_device_settings(load_config(PretrainConfig, "configs/pretrain/tiny.yaml", ["train.fp8=true"]))


@pytest.mark.parametrize("overrides", [["train.fp8=true"], ["train.fp8=true", "train.fp8_recipe=rowwise"]])
def test_on_a_hopper_gpu_with_torchao_fp8_passes_the_check(overrides, monkeypatch):
    pytest.importorskip("torchao.float8")
    a_gpu(monkeypatch)
    check_device_settings(load_config(PretrainConfig, "configs/pretrain/tiny.yaml", overrides))


def test_on_a_gpu_decoding_there_is_refused_until_a_gpu_run_verifies_it(demo_shards, tmp_path, monkeypatch, capsys):
    a_gpu(monkeypatch)
    code, _, err = in_process(pretrain_main, pretrain_argv(demo_shards, tmp_path / "run", "data.decode=gpu"), capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: data.decode=gpu is built but not verified on a GPU: its first run (H100, torchvision 0.26) trained on "
        "NaN losses, nvJPEG's hardware decoder writing into memory the step still read, and fed ViT-S/16 at 0.6 of "
        "CPU decoding; the fix in this version has not run on a GPU yet (docs/data_stream.md#decoding-on-the-gpu); "
        "use data.decode=cpu"], err
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

    cfg = load_config(PretrainConfig, "configs/pretrain/tiny.yaml",
                      [f"data.shards={demo_shards}", f"train.run_dir={tmp_path / 'run'}", "data.decode=gpu"])
    a_gpu(monkeypatch, None)
    with pytest.raises(ConfigError, match="data.decode=gpu decodes JPEGs on a CUDA device"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_the_defaults_pass_and_ask_nothing_of_torch(monkeypatch):
    def no(*args):
        raise AssertionError("the device was asked about")

    monkeypatch.setattr(torch.cuda, "is_available", no)
    check_device_settings(load_config(PretrainConfig, "configs/pretrain/tiny.yaml",
                                      ["data.decode=cpu", "train.fp8=false"]))
