"""Masked patch prediction: the corruption rule, the targets, and the loss (docs/method.md)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pretrain import targets as tg
from pretrain.config import MPPConfig
from pretrain.mpp import KEEP, MASK, RANDOM, MaskedPatchPrediction, apply_corruption, draw_corruption, entropy_bits
from tests.helpers.models import SMALL_MODEL
from vit_mpp.models.vit import create_vit


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_exact_count_distinct_positions_and_donors():
    b, n = 64, 196
    c = draw_corruption(b, n, MPPConfig(), generator=seeded())
    assert c.positions.shape == (b, 98)  # exactly round(0.5 * 196) per image
    assert all(len(set(row.tolist())) == 98 for row in c.positions)
    assert ((c.donor >= 0) & (c.donor < n)).all()
    assert (c.donor != c.positions).all()  # a random replacement never copies the patch itself
    c15 = draw_corruption(b, n, MPPConfig(mask_ratio=0.15), generator=seeded())
    assert c15.positions.shape == (b, 29)  # round(0.15 * 196) = 29


def test_split_fractions_within_statistical_bounds():
    # 4096 images x 98 slots = 401,408 draws: a 5-sigma band for p = 0.1 is about +-0.0024.
    c = draw_corruption(4096, 196, MPPConfig(), generator=seeded(1))
    total = c.kind.numel()
    for kind, p in ((MASK, 0.8), (RANDOM, 0.1), (KEEP, 0.1)):
        frac = (c.kind == kind).sum().item() / total
        sigma = (p * (1 - p) / total) ** 0.5
        assert abs(frac - p) < 5 * sigma, (kind, frac)
    # donors are uniform over the other N - 1 patches: check the mean offset from the position is unbiased
    donors = c.donor[c.kind == RANDOM]
    assert donors.float().mean().item() == pytest.approx((196 - 1) / 2, rel=0.02)


def test_apply_corruption_replaces_exactly_what_was_drawn():
    b, n, d = 8, 16, 4
    tokens = torch.randn(b, n, d, generator=seeded(2))
    mask_token = torch.full((d,), 7.0)
    c = draw_corruption(b, n, MPPConfig(), generator=seeded(3))
    out = apply_corruption(tokens, c, mask_token)
    for i, k in itertools.product(range(b), range(c.positions.shape[1])):
        pos, kind = c.positions[i, k].item(), c.kind[i, k].item()
        expected = {MASK: mask_token, RANDOM: tokens[i, c.donor[i, k]], KEEP: tokens[i, pos]}[kind]
        assert torch.equal(out[i, pos], expected)
    untouched = torch.ones(b, n, dtype=torch.bool)
    untouched[torch.arange(b)[:, None], c.positions] = False
    assert torch.equal(out[untouched], tokens[untouched])


def _image_of_patches(colours: list[tuple[int, int, int]], p: int, grid: tuple[int, int]) -> torch.Tensor:
    """A (1, 3, gh*p, gw*p) uint8 image whose patches are flat colours, in raster order."""
    gh, gw = grid
    img = torch.zeros(1, 3, gh * p, gw * p, dtype=torch.uint8)
    for idx, rgb in enumerate(colours):
        r, c = divmod(idx, gw)
        img[0, :, r * p:(r + 1) * p, c * p:(c + 1) * p] = torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1)
    return img


def test_mean_color_of_known_patches():
    colours = [(0, 0, 0), (255, 255, 255), (32, 0, 0), (31, 0, 0), (0, 64, 0), (0, 0, 224), (100, 150, 200),
               (255, 0, 31)]
    expected = [0, 511, 64, 0, 16, 7, 3 * 64 + 4 * 8 + 6, 7 * 64]
    img = _image_of_patches(colours, p=4, grid=(2, 4))
    assert tg.mean_color_target(img, 4).tolist() == [expected]


def test_mean_color_bin_edge_uses_the_exact_mean():
    # A patch half 31, half 33 has mean exactly 32: level 1, not 0.
    img = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    img[:, 0, :2] = 31
    img[:, 0, 2:] = 33
    assert tg.mean_color_target(img, 4).item() == 64


def _slow_level(v: float) -> int:
    return min(7, int(v * 8 // 256))


def test_targets_match_a_slow_reference_on_random_images():
    g = seeded(4)
    p = 8
    images = torch.randint(0, 256, (2, 3, 16, 24), dtype=torch.uint8, generator=g)
    x = images.float()
    mean_color = tg.mean_color_target(images, p)
    pixels = tg.pixels_4x4_target(images, p)
    normed = (x / 255 - 0.5) / 0.25
    l2 = tg.l2_target(normed, p)
    for b in range(2):
        for n, (r, c) in enumerate(itertools.product(range(2), range(3))):
            patch = x[b, :, r * p:(r + 1) * p, c * p:(c + 1) * p]
            lv = [_slow_level(patch[ch].mean().item()) for ch in range(3)]
            assert mean_color[b, n].item() == lv[0] * 64 + lv[1] * 8 + lv[2]
            for j, (i, k) in enumerate(itertools.product(range(4), range(4))):
                cell = patch[:, 2 * i:2 * i + 2, 2 * k:2 * k + 2]
                lv = [_slow_level(cell[ch].mean().item()) for ch in range(3)]
                assert pixels[b, n, j].item() == lv[0] * 64 + lv[1] * 8 + lv[2]
            ref = normed[b, :, r * p:(r + 1) * p, c * p:(c + 1) * p].permute(1, 2, 0).flatten()
            assert torch.allclose(l2[b, n], ref)


def tiny_mpp(target: str = "mean_color") -> MaskedPatchPrediction:
    torch.manual_seed(0)
    enc = create_vit(SMALL_MODEL)
    return MaskedPatchPrediction(enc, MPPConfig(target=target), (0.5,) * 3, (0.5,) * 3)


@pytest.mark.parametrize("target", ["mean_color", "pixels_4x4", "l2", "hog"])
def test_loss_ignores_targets_of_uncorrupted_patches(target, monkeypatch):
    model = tiny_mpp(target).eval()
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=seeded(5))
    # The same generator seed gives the same corruption draw, so we know in advance which patches are corrupted.
    positions = draw_corruption(4, 16, model.cfg, generator=seeded(6)).positions
    corrupted = torch.zeros(4, 16, dtype=torch.bool)
    corrupted[torch.arange(4)[:, None], positions] = True
    name = {"mean_color": "mean_color_target", "pixels_4x4": "pixels_4x4_target", "l2": "l2_target",
            "hog": "hog_target"}[target]
    real = getattr(tg, name)

    def loss_with_scrambled(where: torch.Tensor) -> float:
        def scrambled(*args, **kwargs):
            t = real(*args, **kwargs).clone()
            noise = torch.randint_like(t, 0, 512) if t.dtype == torch.int64 else torch.randn_like(t) * 9
            t[where] = noise[where]
            return t

        monkeypatch.setattr(tg, name, scrambled)
        with torch.no_grad():
            return model(images, generator=seeded(6))["loss"].item()

    with torch.no_grad():
        reference = model(images, generator=seeded(6))["loss"].item()
    assert loss_with_scrambled(~corrupted) == reference  # bit-identical: uncorrupted targets do not count
    assert loss_with_scrambled(corrupted) != reference  # ... while corrupted ones do


def test_forward_reports_loss_accuracy_and_fractions():
    model = tiny_mpp()
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=seeded(7))
    out = model(images)
    assert out["loss"].ndim == 0 and out["loss"].requires_grad
    m = out["metrics"]
    assert 0 <= m["acc"] <= 1 and m["target_entropy"] > 0
    assert m["frac_mask"] + m["frac_random"] + m["frac_keep"] == pytest.approx(1.0)
    out["loss"].backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0


def test_the_target_entropy_is_that_of_the_histogram():
    classes = torch.tensor([[0, 0, 1, 3], [3, 3, 3, 5]])  # counts 2, 1, 0, 4, 0, 1 of 8
    p = torch.tensor([2, 1, 4, 1]) / 8
    assert entropy_bits(classes, 8).item() == pytest.approx(-(p * p.log2()).sum().item())
    assert entropy_bits(torch.zeros(3, 5, dtype=torch.long), 512).item() == 0


def test_compiled_forward_breaks_its_graph_once_around_the_corruption_draw():
    # A run passes its own torch.Generator (resumable draws), which dynamo cannot put in a graph: each random call
    # broke it (5 graphs); the draw is now one eager piece between two graphs.
    torch._dynamo.reset()
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, generator=seeded(8))
    explained = torch._dynamo.explain(tiny_mpp())(images, generator=seeded(9))
    assert (explained.graph_count, explained.graph_break_count) == (2, 1), explained.break_reasons
