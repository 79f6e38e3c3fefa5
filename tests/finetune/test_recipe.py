"""The MAE/DeiT-style fine-tuning recipe: RandAugment in the loader workers, random erasing, model EMA (evaluated,
exported, checkpointed and resumed exactly), and the recipe's config run end to end on tiny data."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from accelerate import Accelerator
from PIL import Image
from safetensors.torch import load_file

from finetune import evaluate
from finetune.__main__ import main
from finetune.augment import RandAugmentU8, build_random_erasing
from finetune.config import AugmentConfig, FinetuneConfig, InitConfig, is_rand_augment
from finetune.ema import build_ema
from finetune.init_model import build_classifier
from tests.helpers.loaders import split_loader
from tests.helpers.runs import read_metrics, run_tiny_finetune
from tests.helpers.shards import png_bytes
from vit_mpp.config.engine import ConfigError, load_config
from vit_mpp.config.sections import DataConfig, ModelConfig
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import load_split
from vit_mpp.models.export import read_export


def smooth_images(n: int, size: int = 24, seed: int = 0) -> list[torch.Tensor]:
    """Smooth colour fields, uint8 (3, size, size): geometric ops move content, colour ops change it."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
        out.append(torch.from_numpy(np.array(small.resize((size, size), Image.BICUBIC))).permute(2, 0, 1))
    return out


# --- RandAugment, in the workers ----------------------------------------------------------------------------------

def test_rand_augment_changes_uint8_images_and_keeps_their_shape_and_dtype():
    ra = RandAugmentU8("rand-m9-mstd0.5-inc1", 24, (0.5, 0.5, 0.5))
    images = smooth_images(200)
    random.seed(0)
    np.random.seed(0)
    out = [ra(x) for x in images]
    assert all(y.dtype == torch.uint8 and y.shape == (3, 24, 24) and y.is_contiguous() for y in out)
    changed = np.mean([not torch.equal(x, y) for x, y in zip(images, out)])
    # each of the 2 ops is applied with probability 0.5, so about 1/4 of the images keep both skipped
    assert 0.65 < changed < 0.85
    random.seed(0)
    np.random.seed(0)
    assert all(torch.equal(ra(x), y) for x, y in zip(images, out))  # the workers' seeds fix it


def test_rand_augment_changes_images_more_at_a_higher_magnitude():
    images = smooth_images(200)
    mean_change = {}
    for m in (1, 5, 9):
        ra = RandAugmentU8(f"rand-m{m}-inc1", 24, (0.5, 0.5, 0.5))
        random.seed(0)  # the same ops on the same images at every magnitude: only their strength differs
        np.random.seed(0)
        mean_change[m] = np.mean([(ra(x).int() - x.int()).abs().float().mean() for x in images])
    assert mean_change[1] * 1.5 < mean_change[5] and mean_change[5] * 1.1 < mean_change[9], mean_change


@pytest.mark.parametrize("text", ["", "rand", "rand-m9-mstd0.5-inc1", "rand-n2-m10-mstd101", "rand-m15-mmax20",
                                  "rand-n1-p1", "rand-m0-tweights"])
def test_rand_augment_strings_timm_takes_as_written_are_accepted(text):
    assert is_rand_augment(text)
    if text:
        RandAugmentU8(text, 24, (0.5, 0.5, 0.5))  # and timm builds them


@pytest.mark.parametrize("text", ["rand-m11", "rand-m99", "rand-m21-mmax20", "rand-n0", "rand-p1.5", "rand-m9-x1",
                                  "randm9", "rand-m9.5"])
def test_rand_augment_strings_timm_would_clip_skip_or_ignore_are_refused(text):
    # timm clips m above mmax to mmax, runs no op for n0 and skips an unknown section: each trains without the
    # augmentation the user wrote
    assert not is_rand_augment(text)


def test_posterize_at_magnitude_10_gives_black_instead_of_an_error():
    # PosterizeIncreasing keeps 0 bits at magnitude 10 (which mstd noise reaches); Pillow 13 raises for 0 bits, and an
    # exception in the decoder would silently count the image as undecodable.
    ra = RandAugmentU8("rand-m10-inc1", 24, (0.5, 0.5, 0.5))
    op = next(o for o in ra.transform.ops if o.name == "PosterizeIncreasing")
    op.prob = 1.0
    image = Image.fromarray(smooth_images(1)[0].permute(1, 2, 0).numpy())
    assert np.asarray(op(image)).max() == 0


class Invert:
    """A stand-in augmentation whose effect is known exactly."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return 255 - image


def first_batch(split, augment=None, workers: int = 1) -> torch.Tensor:
    data = DataConfig(num_workers=workers, shuffle_buffer=0)
    _, loader = split_loader(split, data, 24, 8, augment=augment)
    torch.manual_seed(0)  # the workers' seeds derive from it: the same crops in both loaders
    return next(iter(loader))["image"]


def test_the_augmentation_runs_in_the_workers_after_the_crop_and_only_for_training(shards):
    split, _ = load_split(shards, "train")
    plain = first_batch(split)
    assert torch.equal(first_batch(split, augment=Invert()), 255 - plain)
    # Evaluation loaders take no augmentation at all (vit_mpp/run/start/run.py `Run.eval_loader`), and a decoder for
    # evaluation drops one.
    assert ImageDecoder(24, train=False, augment=Invert()).augment is None
    data = png_bytes(np.random.default_rng(0), 24)
    assert ImageDecoder(24, train=True, augment=RandAugmentU8("rand-m9", 24, (0.5,) * 3))(data).dtype == torch.uint8


# --- random erasing, on the normalised batch ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["pixel", "const"])
def test_random_erasing_erases_the_expected_fraction_of_images_and_area(mode):
    random.seed(0)
    torch.manual_seed(0)
    erase = build_random_erasing(AugmentConfig(reprob=0.25, remode=mode), torch.device("cpu"))
    batch = torch.full((800, 3, 24, 24), 5.0)  # normalised units; 5 is neither the noise nor the constant 0
    erased = erase(batch.clone()) != 5.0  # (B, 3, H, W)
    hit = erased.flatten(1).any(1)
    assert 0.2 < hit.float().mean() < 0.3  # probability 0.25: 800 draws, 3.3 standard deviations either side
    area = erased[hit].all(1).float().mean((1, 2))  # fraction of each erased image, all channels
    assert area.min() >= 0.015 and area.max() <= 0.36  # timm's [0.02, 1/3] of the area, up to rounding of the sides
    for mask in erased[hit][:, 0]:  # one rectangle each: its rows and columns span a full block
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        assert mask.sum() == len(rows) * len(cols) == (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1)
    values = erase(torch.full((800, 3, 24, 24), 5.0))
    fill = values[values != 5.0]
    if mode == "pixel":  # per-pixel N(0, 1) in normalised units, as timm/DeiT
        assert abs(float(fill.mean())) < 0.05 and abs(float(fill.std()) - 1) < 0.05
    else:
        assert torch.all(fill == 0)
    assert build_random_erasing(AugmentConfig(), torch.device("cpu")) is None


# --- model EMA -----------------------------------------------------------------------------------------------------

def test_ema_is_the_running_average_of_the_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = build_ema(Accelerator(cpu=True), model, 0.75)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        expected = {k: 0.75 * expected[k] + 0.25 * v for k, v in model.state_dict().items()}
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v, expected[k])
    assert build_ema(Accelerator(cpu=True), model, 0.0) is None


EMA_RUN = ("train.ema_decay=0.5", "train.ckpt_every=1", "train.keep_last=100", "data.crop_scale=[1.0,1.0]",
           "data.hflip=false")  # full-image crops: a resumed run sees exactly the same pixels


@pytest.fixture(scope="module")
def ema_run(shards, pretrained, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ema")
    run_tiny_finetune(shards, run_dir, pretrained, *EMA_RUN)
    return run_dir


def checkpoint_weights(run_dir: Path, step: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model, EMA) weights of the checkpoint at `step`."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    ema = torch.load(path / "custom_checkpoint_0.pkl", weights_only=True)  # accelerate's file for the EMA
    return load_file(path / "model.safetensors"), {k.removeprefix("module."): v for k, v in ema.items()}


def test_ema_in_training_is_the_running_average_of_every_step(ema_run, pretrained):
    initial, *_ = build_classifier(InitConfig(checkpoint=str(pretrained)), ModelConfig(img_size=24), 3)
    expected = initial.state_dict()  # the EMA starts from the initial classifier (zero head)
    for step in range(1, 11):
        weights, ema = checkpoint_weights(ema_run, step)
        expected = {k: 0.5 * expected[k] + 0.5 * weights[k] for k in weights}
        assert ema.keys() == expected.keys()
        for k in ema:
            torch.testing.assert_close(ema[k], expected[k], rtol=1e-5, atol=1e-6, msg=f"step {step}: {k}")


def test_ema_is_evaluated_beside_the_model_and_exported_as_its_own_model(ema_run):
    evals = [m for m in read_metrics(ema_run) if "val_top1" in m]
    assert len(evals) == 2
    assert all({"ema_val_top1", "ema_val_loss", "ema_val_mean_class_acc"} <= m.keys() for m in evals)
    last = read_export(ema_run / "export_ema")
    assert last.record["finetune"]["weights"] == "ema" and last.record["finetune"]["ema_decay"] == 0.5
    assert last.record["metrics"]["val_top1"] == evals[-1]["ema_val_top1"]
    assert read_export(ema_run / "export").record["finetune"]["weights"] == "model"
    best = read_export(ema_run / "export_ema" / "best")
    assert best.record["metrics"]["val_top1"] == max(m["ema_val_top1"] for m in evals)
    # the export is the EMA of the last checkpoint, and a plain timm model folder
    _, ema = checkpoint_weights(ema_run, 10)
    model = timm.create_model(f"local-dir:{ema_run / 'export_ema'}", pretrained=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ema[k]), k
    assert model.pretrained_cfg["label_names"] == ["a", "b", "c"]


def test_evaluate_on_the_ema_export_gives_the_ema_numbers_of_training(ema_run, shards, tmp_path):
    evals = [m for m in read_metrics(ema_run) if "val_top1" in m]
    report = evaluate.main(["--checkpoint", str(ema_run / "export_ema"), "--shards", str(shards), "--workers",
                            "0", "--out", str(tmp_path)])
    assert report["metrics"]["val_top1"] == evals[-1]["ema_val_top1"]
    assert report["metrics"]["val_loss"] == pytest.approx(evals[-1]["ema_val_loss"], rel=1e-5)


def test_a_resumed_run_restores_the_ema_exactly(ema_run, shards, pretrained, tmp_path):
    # The run as if it had been killed after its checkpoint at step 4, then started again.
    resumed = tmp_path / "resumed"
    shutil.copytree(ema_run, resumed, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(resumed / "export"), shutil.rmtree(resumed / "export_ema")
    for ckpt in (resumed / "checkpoints").glob("step_*"):
        if int(ckpt.name[5:]) > 4:
            shutil.rmtree(ckpt)
    run_tiny_finetune(shards, resumed, pretrained, *EMA_RUN)
    for step in range(5, 11):  # every later step's model and EMA, bit for bit
        for a, b in zip(checkpoint_weights(ema_run, step), checkpoint_weights(resumed, step)):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    assert (resumed / "export_ema" / "best" / "model.safetensors").is_file()
    a, b = (load_file(r / "export_ema" / "model.safetensors") for r in (ema_run, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((resumed / "checkpoints" / "step_000010" / "trainer_state.json").read_text())
    assert state["best_ema_top1"] == json.loads(
        (ema_run / "checkpoints" / "step_000010" / "trainer_state.json").read_text())["best_ema_top1"]


def test_a_resumed_run_keeps_its_ema_setting(ema_run, shards, pretrained):
    with pytest.raises(ConfigError, match=r"cannot change train.ema_decay \(0.5 -> 0.0\)"):
        run_tiny_finetune(shards, ema_run, pretrained, *EMA_RUN, "train.ema_decay=0")


# --- the recipe --------------------------------------------------------------------------------------------------

def test_the_mae_style_config_is_the_recipe():
    cfg = load_config(FinetuneConfig, "configs/finetune/mae_style_in1k.yaml")
    assert (cfg.optim.name, cfg.optim.layer_decay, cfg.optim.weight_decay) == ("adamw", 0.65, 0.05)
    assert (cfg.augment.mixup, cfg.augment.cutmix, cfg.train.label_smoothing) == (0.8, 1.0, 0.1)
    assert (cfg.model.drop_path_rate, cfg.augment.auto_augment) == (0.1, "rand-m9-mstd0.5-inc1")
    assert (cfg.augment.reprob, cfg.augment.remode, cfg.augment.recount) == (0.25, "pixel", 1)
    assert cfg.optim.base_lr * cfg.train.batch_size / cfg.optim.base_batch_size == pytest.approx(2e-3)
    paper = load_config(FinetuneConfig, "configs/finetune/vit_b16_384_in1k.yaml")  # the other recipe is untouched
    assert (paper.optim.name, paper.augment.auto_augment, paper.augment.reprob, paper.train.ema_decay) == \
        ("sgd", "", 0.0, 0.0)


def test_the_mae_style_recipe_runs_on_tiny_data(shards, pretrained, tmp_path):
    # Every part of the recipe on: RandAugment in a worker process, erasing, mixup/cutmix, layer decay, drop path,
    # label smoothing, and an EMA.
    main(["--config", "configs/finetune/mae_style_in1k.yaml", f"data.shards={shards}", f"train.run_dir={tmp_path}",
          f"init.checkpoint={pretrained}", "model.name=vit_tiny_patch16_224", "model.img_size=24",
          "data.num_workers=1", "data.shuffle_buffer=16", "train.batch_size=8", "train.micro_batch_size=null",
          "train.mixed_precision='no'", "train.epochs=2", "train.eval_every_epochs=1", "train.log_every=5",
          "train.ckpt_every=100", "optim.warmup_steps=2", "train.ema_decay=0.9"])
    records = read_metrics(tmp_path)
    assert records[-1]["val_samples"] == 13 and "ema_val_top1" in records[-1]
    assert all(r["bad_samples"] == 0 for r in records if "bad_samples" in r)  # no augmentation error: no bad sample
    for folder in ("export", "export/best", "export_ema", "export_ema/best"):
        assert read_export(tmp_path / folder).model.drop_path_rate == 0.1
