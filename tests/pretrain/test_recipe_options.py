"""The MPP options beyond the paper's recipe (docs/pretrain.md#beyond-the-papers-recipe), each off by default:
per-patch normalised pixel targets (`mpp.norm_pix`), a light decoder (`mpp.decoder_depth`, `mpp.decoder_dim`) and
BEiT's block-wise masks (`mpp.mask_shape`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretrain import mpp as mpp_module
from pretrain import targets as tg
from pretrain.config import MPPConfig, PretrainConfig
from pretrain.mpp import (
    KEEP,
    MASK,
    RANDOM,
    MaskedPatchPrediction,
    block_mask,
    decoder_heads,
    draw_corruption,
    sincos_2d,
)
from pretrain.train import summary
from tests.helpers.models import SMALL, SMALL_MODEL
from tests.helpers.runs import read_metrics, run_tiny_finetune, run_tiny_pretrain
from vit_mpp.config.engine import ConfigError, load_config
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.export import strip_prefix
from vit_mpp.models.vit import create_vit


def seeded(seed: int = 0, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def tiny_mpp(**options) -> MaskedPatchPrediction:
    torch.manual_seed(0)
    return MaskedPatchPrediction(create_vit(SMALL_MODEL), MPPConfig(**options), (0.5,) * 3, (0.5,) * 3)


# --- config -----------------------------------------------------------------------------------------------------


def test_the_defaults_are_the_papers_recipe():
    cfg = MPPConfig()
    assert (cfg.norm_pix, cfg.decoder_depth, cfg.decoder_dim, cfg.mask_shape) == (False, 0, 0, "random")
    assert tiny_mpp().decoder is None  # the head reads the encoder's output, as in the paper


@pytest.mark.parametrize("overrides, message", [
    (["mpp.norm_pix=true"], "config key 'mpp.norm_pix' needs mpp.target=l2 (it normalises pixel targets), got "
                            "mpp.target=mean_color"),
    (["mpp.norm_pix=true", "mpp.target=pixels_4x4"], "'mpp.norm_pix' needs mpp.target=l2"),
    (["mpp.decoder_dim=128"], "config key 'mpp.decoder_dim' needs mpp.decoder_depth >= 1"),
    (["mpp.decoder_depth=5"], "'mpp.decoder_depth' must be in [0, 4], got 5"),
    (["mpp.decoder_dim=-1", "mpp.decoder_depth=1"], "'mpp.decoder_dim' must be >= 0, got -1"),
    (["mpp.mask_shape=blocks"], "'mpp.mask_shape' expects one of 'random' | 'block'"),
])
def test_bad_option_values_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_options_load_and_the_decoders_shape_is_fixed_on_resume():
    cfg = load_config(PretrainConfig, None, ["mpp.target=l2", "mpp.norm_pix=true", "mpp.decoder_depth=2",
                                             "mpp.decoder_dim=64", "mpp.mask_shape=block"])
    assert (cfg.mpp.norm_pix, cfg.mpp.decoder_depth, cfg.mpp.decoder_dim, cfg.mpp.mask_shape) == (True, 2, 64, "block")
    assert {"mpp.decoder_depth", "mpp.decoder_dim"} <= set(PretrainConfig.FIXED_ON_RESUME)


def fake_run(**mpp_options) -> SimpleNamespace:
    """What `summary` reads of a `Run`."""
    cfg = PretrainConfig(model=SMALL_MODEL, mpp=MPPConfig(**mpp_options))
    data = SimpleNamespace(samples_per_epoch=lambda: 100, describe=lambda: "data")
    return SimpleNamespace(cfg=cfg, data=data, gbatch=SimpleNamespace(describe=lambda: "batch"), steps_per_epoch=1)


def test_the_start_up_line_names_the_options_only_when_set():
    encoder = create_vit(SMALL_MODEL)
    plain = summary(fake_run(), encoder, 0)
    assert "target mean_color, corrupt 50% (80% mask / 10% random / rest kept)\n" in plain
    assert not any(word in plain for word in ("norm_pix", "decoder", "block"))
    line = summary(fake_run(target="l2", norm_pix=True, decoder_depth=2, decoder_dim=128, mask_shape="block"),
                   encoder, 0)
    assert "target l2 (norm_pix), corrupt 50% in block masks (80% mask / 10% random / rest kept), decoder 2 x 128\n" \
           in line
    assert "decoder 1 x 32" in summary(fake_run(decoder_depth=1), encoder, 0)  # 0: the encoder's width


# --- norm_pix ---------------------------------------------------------------------------------------------------


def test_norm_pix_target_of_a_hand_made_two_patch_image():
    # 2 x 4 pixels, patches of 2: patch 0 has varied pixels, patch 1 is one grey (its variance is 0: eps keeps it
    # finite).
    red = [[10, 200, 7, 7], [30, 250, 7, 7]]
    green = [[0, 0, 7, 7], [255, 128, 7, 7]]
    blue = [[64, 32, 7, 7], [16, 8, 7, 7]]
    image = torch.tensor([[red, green, blue]], dtype=torch.uint8)  # (1, 3, 2, 4)
    got = tg.norm_pix_target(image.float() / 255, 2)
    assert got.shape == (1, 2, 12)
    pixels = np.array([red, green, blue], dtype=np.float64) / 255  # (3, 2, 4)
    for n in range(2):
        patch = pixels[:, :, 2 * n:2 * n + 2].transpose(1, 2, 0).reshape(-1)  # row, column, channel
        expected = (patch - patch.mean()) / np.sqrt(patch.var(ddof=1) + 1e-6)  # MAE: torch's unbiased var
        np.testing.assert_allclose(got[0, n].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0, 1], torch.zeros(12))  # a flat patch: every value is its mean
    assert got[0, 0].mean().abs() < 1e-6 and got[0, 0].std().item() == pytest.approx(1.0, abs=1e-3)


def test_norm_pix_is_computed_from_raw_pixels_whatever_the_dataset_statistics(monkeypatch):
    seen = []
    real = tg.norm_pix_target

    def spy(pixels, p):
        seen.append(pixels)
        return real(pixels, p)

    monkeypatch.setattr(tg, "norm_pix_target", spy)
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=seeded(1))
    losses = []
    for mean, std in (((0.5,) * 3, (0.5,) * 3), ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))):
        torch.manual_seed(0)
        model = MaskedPatchPrediction(create_vit(SMALL_MODEL), MPPConfig(target="l2", norm_pix=True), mean, std)
        with torch.no_grad():
            losses.append(model(images, generator=seeded(2))["loss"])
    assert len(seen) == 2 and all(torch.equal(s, images.float() / 255) for s in seen)
    assert all(torch.isfinite(loss) for loss in losses)


# --- hog (MaskFeat's histograms of oriented gradients) -----------------------------------------------------------


def _slow_hog(pixels: np.ndarray, p: int, bins: int = 9) -> np.ndarray:
    """One image (3, H, W) -> (N, 3 * bins * 4), pixel by pixel in float64: the reference hog_target must match."""
    c, h, w = pixels.shape
    padded = np.pad(pixels, ((0, 0), (1, 1), (1, 1)), mode="reflect")
    cell = p // 2
    hist = np.zeros((c, bins, h // cell, w // cell))
    for ch, y, x in np.ndindex(c, h, w):
        win = padded[ch, y:y + 3, x:x + 3]
        gx = (win[:, 0] - win[:, 2]) @ [1, 2, 1]  # Sobel, as a cross-correlation
        gy = [1, 2, 1] @ (win[0] - win[2])
        which = int(np.floor(np.arctan2(gy, gx) * bins / np.pi)) % bins
        hist[ch, which, y // cell, x // cell] += np.hypot(gx, gy)
    hist /= np.maximum(np.linalg.norm(hist, axis=1, keepdims=True), 1e-12)
    rows = []
    for r, col in np.ndindex(h // p, w // p):
        rows.append(hist[:, :, 2 * r:2 * r + 2, 2 * col:2 * col + 2].reshape(-1))  # channel, bin, cell row, column
    return np.stack(rows)


def test_hog_target_matches_a_slow_reference_on_random_images():
    images = torch.randint(0, 256, (2, 3, 16, 24), dtype=torch.uint8, generator=seeded(3))
    got = tg.hog_target(images, 8)
    assert got.shape == (2, 6, 108) and tg.target_dim("hog", 8) == 108
    for b in range(2):  # the border rows' gradients along an axis included: each in its bin, not the next one's
        np.testing.assert_allclose(got[b].numpy(), _slow_hog(images[b].double().numpy(), 8), atol=1e-5)


def test_hog_is_computed_in_float32_under_mixed_precision():
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=seeded(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the training step's autocast: bf16 convolutions
        mixed = tg.hog_target(images, 8)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, tg.hog_target(images, 8))


def test_hog_of_a_hand_made_edge_lies_in_its_orientations_bin_and_a_flat_cell_is_zero():
    image = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    image[..., 4:] = 200  # a vertical edge between columns 3 and 4: the gradient is horizontal, bin 0
    got = tg.hog_target(image, 4).view(1, 4, 3, 9, 2, 2)  # (B, patch, channel, bin, cell row, cell column)
    left, right = got[0, [0, 2]], got[0, [1, 3]]  # patches of 4 pixels: columns 0-3 and 4-7, cells of 2
    edge = torch.cat([left[..., 1], right[..., 0]])  # the cells holding columns 3 and 4, which the 3x3 kernel sees
    assert torch.equal(edge[:, :, 0], torch.ones(4, 3, 2)) and edge[:, :, 1:].abs().sum() == 0
    assert left[..., 0].abs().sum() == 0 and right[..., 1].abs().sum() == 0  # flat cells
    turned = tg.hog_target(image.transpose(2, 3), 4).view(1, 4, 3, 9, 2, 2)  # a horizontal edge: 90 degrees, bin 4
    assert turned[0, 0, :, 4, 1, :].eq(1).all() and turned[0, 0, :, :4].abs().sum() == 0


def test_hog_is_blind_to_a_channels_contrast_and_level_and_follows_its_shape():
    image = torch.randint(0, 128, (1, 3, 16, 16), generator=seeded(5)) * 2
    recoloured = image.clone()
    recoloured[:, 1] = recoloured[:, 1] // 2 + 100  # the green channel's contrast halved, its level raised
    image, recoloured = image.to(torch.uint8), recoloured.to(torch.uint8)
    assert torch.equal(tg.hog_target(image, 8), tg.hog_target(recoloured, 8))
    assert not torch.equal(tg.hog_target(image, 8), tg.hog_target(image.flip(-1), 8))


def test_hog_needs_an_even_patch_size():
    with pytest.raises(ValueError, match="even patch size"):
        tg.hog_target(torch.zeros(1, 3, 15, 15, dtype=torch.uint8), 5)
    with pytest.raises(ConfigError, match="mpp.target=hog needs an even patch size"):
        MaskedPatchPrediction(create_vit(ModelConfig(img_size=15, patch_size=5, embed_dim=32, depth=1, num_heads=2)),
                              MPPConfig(target="hog"), (0.5,) * 3, (0.5,) * 3)


def test_a_hog_pretraining_through_the_real_command_then_fine_tunes(demo_shards, tmp_path):
    run_tiny_pretrain(demo_shards, tmp_path / "pretrain", "mpp.target=hog", "train.eval_every=3")
    records = read_metrics(tmp_path / "pretrain")
    evaluations = [r for r in records if "val_loss" in r]
    assert evaluations and all(np.isfinite(r["val_loss"]) and "val_acc" not in r for r in evaluations)
    train = [r for r in records if "loss" in r and "val_loss" not in r]
    assert train and "acc" not in train[-1] and "target_entropy" not in train[-1]
    run_tiny_finetune(demo_shards, tmp_path / "finetune", tmp_path / "pretrain" / "export", "train.epochs=1")
    assert (tmp_path / "finetune" / "export" / "model.safetensors").exists()


# --- the decoder ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dim", [0, 16])
def test_decoder_output_shapes(depth, dim):
    model = tiny_mpp(target="l2", decoder_depth=depth, decoder_dim=dim)
    width = dim or 32
    assert len(model.decoder.blocks) == depth and model.head[1].in_features == width
    encoded = torch.randn(3, 17, 32)  # [class] + 4 x 4 patches, encoder width 32
    assert model.decoder(encoded).shape == (3, 17, width)
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8, generator=seeded(3))
    out = model(images, generator=seeded(4))
    assert out["pred"].shape == (3, 8, 4 * 4 * 3)  # K = 8 corrupted of 16, P*P*3 values each
    out["loss"].backward()
    assert model.decoder.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.encoder.blocks[0].attn.qkv.weight.grad.abs().sum() > 0  # the gradient reaches the encoder


def test_decoder_heads_and_parameter_count():
    assert decoder_heads(128) == 4 and decoder_heads(16) == 1 and decoder_heads(96) == 3
    assert decoder_heads(100) == 2  # 100 // 32 = 3 does not divide 100: lowered to 2
    assert tiny_mpp(decoder_depth=1).decoder.blocks[0].attn.num_heads == SMALL["num_heads"]  # the encoder's
    assert tiny_mpp(decoder_depth=1, decoder_dim=128).decoder.blocks[0].attn.num_heads == 4

    def decoder_params(model: MaskedPatchPrediction) -> int:
        named = dict(model.named_parameters())
        assert sum(p.numel() for n, p in named.items() if n.startswith("decoder.")) == \
            sum(p.numel() for p in model.decoder.parameters())  # every decoder parameter is under decoder.*
        return sum(p.numel() for p in model.decoder.parameters())

    # A block of width d: qkv 3d^2 + 3d, proj d^2 + d, MLP 4d^2 + 4d + 4d^2 + d, two norms 4d: 12d^2 + 13d; the final
    # norm 2d; the projection from 32: 32 d + d. The sin-cos position embedding is a buffer, not a parameter.
    assert decoder_params(tiny_mpp(decoder_depth=1)) == 12 * 32**2 + 13 * 32 + 2 * 32 == 12768
    assert decoder_params(tiny_mpp(decoder_depth=2, decoder_dim=16)) == \
        (32 * 16 + 16) + 2 * (12 * 16**2 + 13 * 16) + 2 * 16 == 7120


def test_the_decoder_runs_over_every_token_the_class_token_included():
    decoder = tiny_mpp(decoder_depth=1).decoder.eval()
    encoded = torch.randn(1, 17, 32, generator=seeded(5))
    changed = encoded.clone()
    changed[0, 0] += torch.randn(32, generator=seeded(6))  # only the [class] token
    with torch.no_grad():
        a, b = decoder(encoded), decoder(changed)
    assert ((a - b)[0, 1:].abs().amax(dim=-1) > 0).all()  # every patch position saw it


def test_the_decoders_position_embeddings_are_fixed_sin_cos():
    pos = sincos_2d((2, 3), 8)
    assert pos.shape == (6, 8)
    # channels: sin/cos of the row at 2 frequencies, then sin/cos of the column (1 / 10000^(i / 2), i = 0, 1)
    r, c = 1, 2
    row = [np.sin(r), np.sin(r / 100), np.cos(r), np.cos(r / 100)]
    col = [np.sin(c), np.sin(c / 100), np.cos(c), np.cos(c / 100)]
    np.testing.assert_allclose(pos[r * 3 + c].numpy(), row + col, rtol=1e-6)
    assert torch.unique(pos, dim=0).shape[0] == 6  # every position differs
    assert torch.equal(sincos_2d((2, 2), 6)[:, 4:], torch.zeros(4, 2))  # past a multiple of 4: zero
    decoder = tiny_mpp(decoder_depth=1).decoder
    assert torch.equal(decoder.pos_embed[0, 0], torch.zeros(32))  # [class] gets none
    assert not any(name.startswith("pos") for name in dict(decoder.named_parameters()))
    assert "pos_embed" not in decoder.state_dict()  # rebuilt from the grid, never saved


def test_the_export_holds_the_encoder_alone_with_or_without_a_decoder():
    plain, decoded = tiny_mpp(), tiny_mpp(decoder_depth=2, decoder_dim=16)
    assert any(k.startswith("decoder.") for k in decoded.state_dict())
    exported = strip_prefix(decoded.state_dict(), "encoder.")  # what pretrain/train.py export_encoder keeps
    assert set(exported) == set(strip_prefix(plain.state_dict(), "encoder.")) == set(plain.encoder.state_dict())
    assert "decoder.blocks.0.attn.qkv.weight" in dict(decoded.named_parameters())


# --- block masks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [(4, 4), (8, 8), (4, 8)])
@pytest.mark.parametrize("ratio", [0.15, 0.4, 0.5, 0.75])
def test_block_masks_cover_exactly_k_distinct_patches(grid, ratio):
    n = grid[0] * grid[1]
    k = round(ratio * n)
    c = draw_corruption(256, n, MPPConfig(mask_ratio=ratio, mask_shape="block"), generator=seeded(6), grid=grid)
    assert c.positions.shape == (256, k)
    assert all(len(set(row.tolist())) == k for row in c.positions)
    assert ((c.positions >= 0) & (c.positions < n)).all()
    assert (c.donor != c.positions).all() and set(c.kind.unique().tolist()) <= {MASK, RANDOM, KEEP}


def test_block_masks_exact_also_at_the_extremes(monkeypatch):
    assert block_mask(4, (4, 4), 16, generator=seeded(7)).all()  # everything
    assert (block_mask(64, (4, 8), 1, generator=seeded(7)).sum(dim=1) == 1).all()
    monkeypatch.setattr(mpp_module, "BLOCK_MAX_ROUNDS", 1)  # the rest taken at random among the uncovered patches
    assert (block_mask(64, (8, 8), 48, generator=seeded(7)).sum(dim=1) == 48).all()


def test_block_masks_finish_within_the_rounds(monkeypatch):
    # The bound on rounds is a safety net, not part of the draw: a large batch at a high ratio never reaches it.
    grid, k = (16, 16), 192
    bounded = block_mask(2048, grid, k, generator=seeded(8))
    monkeypatch.setattr(mpp_module, "BLOCK_MAX_ROUNDS", 10_000)
    assert torch.equal(bounded, block_mask(2048, grid, k, generator=seeded(8)))


def masked_neighbours(positions: torch.Tensor, grid: tuple[int, int]) -> float:
    """Mean number of a corrupted patch's 4-neighbours that are corrupted too."""
    b, (gh, gw) = positions.shape[0], grid
    mask = torch.zeros(b, gh * gw).scatter_(1, positions, 1.0).view(b, 1, gh, gw)
    cross = torch.tensor([[0.0, 1, 0], [1, 0, 1], [0, 1, 0]]).view(1, 1, 3, 3)
    return ((F.conv2d(mask, cross, padding=1) * mask).sum() / mask.sum()).item()


@pytest.mark.parametrize("ratio", [0.15, 0.4, 0.5])
def test_block_masks_are_contiguous(ratio):
    # On 8 x 8 at 50%, random masks give about 1.7 corrupted 4-neighbours per corrupted patch, blocks about 3.0.
    grid = (8, 8)
    block = draw_corruption(512, 64, MPPConfig(mask_ratio=ratio, mask_shape="block"), generator=seeded(9), grid=grid)
    scattered = draw_corruption(512, 64, MPPConfig(mask_ratio=ratio), generator=seeded(9))
    assert masked_neighbours(block.positions, grid) > masked_neighbours(scattered.positions, grid) + 0.8


def test_block_masks_are_reproducible_from_the_generator_state():
    cfg = MPPConfig(mask_shape="block")
    gen = seeded(10)
    draw_corruption(32, 64, cfg, generator=gen, grid=(8, 8))  # the stream is somewhere in the middle
    state = gen.get_state()
    first = draw_corruption(32, 64, cfg, generator=gen, grid=(8, 8))
    gen.set_state(state)  # as a resumed run restores it
    again = draw_corruption(32, 64, cfg, generator=gen, grid=(8, 8))
    for a, b in zip((first.positions, first.kind, first.donor), (again.positions, again.kind, again.donor)):
        assert torch.equal(a, b)
    other = draw_corruption(32, 64, cfg, generator=gen, grid=(8, 8))
    assert not torch.equal(first.positions, other.positions)  # ... and the stream moves on


def test_block_masks_need_the_grid():
    with pytest.raises(ValueError, match="patch grid"):
        draw_corruption(2, 64, MPPConfig(mask_shape="block"), generator=seeded(11))
    with pytest.raises(ValueError, match="patch grid"):
        draw_corruption(2, 64, MPPConfig(mask_shape="block"), generator=seeded(11), grid=(4, 8))


def test_the_model_draws_block_masks_on_its_own_grid():
    torch.manual_seed(0)
    cfg = MPPConfig(mask_shape="block", mask_ratio=0.4)
    model = MaskedPatchPrediction(create_vit(ModelConfig(img_size=[16, 32], **SMALL)), cfg, (0.5,) * 3, (0.5,) * 3)
    images = torch.randint(0, 256, (4, 3, 16, 32), dtype=torch.uint8, generator=seeded(12))
    with torch.no_grad():
        out = model(images, generator=seeded(13))
    expected = draw_corruption(4, 32, cfg, generator=seeded(13), grid=(4, 8))
    assert torch.equal(out["corruption"].positions, expected.positions)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_masks_on_cuda():
    cfg = MPPConfig(mask_shape="block", mask_ratio=0.75)
    a = draw_corruption(4096, 196, cfg, device="cuda", generator=seeded(14, "cuda"), grid=(14, 14))
    b = draw_corruption(4096, 196, cfg, device="cuda", generator=seeded(14, "cuda"), grid=(14, 14))
    assert a.positions.shape == (4096, 147) and a.positions.is_cuda and torch.equal(a.positions, b.positions)
    assert all(len(set(row)) == 147 for row in a.positions.cpu().tolist())
