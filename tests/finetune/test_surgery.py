"""The fine-tuning rule: zero-initialised head, position embeddings resized by 2D interpolation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage
from timm.layers import resample_abs_pos_embed

from finetune.config import InitConfig
from finetune.init_model import attach_zero_head, build_classifier
from tests.helpers.models import SMALL, write_encoder_export
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.pretrained import load_weights, resize_pos_embed
from vit_mpp.models.vit import create_vit
from vit_mpp.models.weight_files import CheckpointError


def test_zero_head_gives_zero_logits():
    torch.manual_seed(0)
    model = create_vit(ModelConfig(img_size=16, **SMALL))
    attach_zero_head(model, 10)
    assert model.head.weight.shape == (10, 32)
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    logits = model(torch.randn(3, 3, 16, 16))
    assert logits.shape == (3, 10) and torch.count_nonzero(logits) == 0


def test_resize_is_identity_at_the_same_size():
    posemb = torch.randn(1, 1 + 6 * 5, 8)
    for mode in ("bilinear", "bicubic"):
        assert torch.equal(resize_pos_embed(posemb, (6, 5), (6, 5), 1, mode), posemb)


@pytest.mark.parametrize("old, new", [((4, 4), (7, 7)), ((4, 6), (6, 9)), ((14, 14), (24, 24)), ((5, 3), (2, 4))])
def test_bilinear_matches_scipy_linear_zoom_and_keeps_class_token(old, new):
    d = 6
    posemb = torch.randn(1, 1 + old[0] * old[1], d, dtype=torch.float64)
    out = resize_pos_embed(posemb, old, new, 1, "bilinear")
    assert out.shape == (1, 1 + new[0] * new[1], d)
    assert torch.equal(out[:, :1], posemb[:, :1])
    grid = posemb[0, 1:].reshape(old[0], old[1], d).numpy()
    zoom = (new[0] / old[0], new[1] / old[1], 1)
    ref = ndimage.zoom(grid, zoom, order=1, grid_mode=False, mode="nearest")  # the original ViT code's resize
    assert ref.shape == (new[0], new[1], d)
    np.testing.assert_allclose(out[0, 1:].reshape(new[0], new[1], d).numpy(), ref, atol=1e-5)


def test_bicubic_matches_timm():
    posemb = torch.randn(1, 1 + 4 * 6, 8)
    ours = resize_pos_embed(posemb, (4, 6), (8, 9), 1, "bicubic")
    theirs = resample_abs_pos_embed(posemb, [8, 9], [4, 6], num_prefix_tokens=1)
    torch.testing.assert_close(ours, theirs)


def test_loading_an_export_at_a_larger_non_square_size(tmp_path):
    torch.manual_seed(0)
    pre_cfg = ModelConfig(img_size=16, **SMALL)
    encoder = create_vit(pre_cfg)
    write_encoder_export(tmp_path, encoder, pre_cfg)
    model, _, _, resolved = build_classifier(InitConfig(checkpoint=str(tmp_path)), ModelConfig(img_size=[24, 32]), 5)
    assert resolved.embed_dim == 32 and model.patch_embed.grid_size == (6, 8)
    expected = resize_pos_embed(encoder.pos_embed.detach(), (4, 4), (6, 8), 1, "bilinear")
    torch.testing.assert_close(model.pos_embed.detach(), expected)
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight, encoder.blocks[0].attn.qkv.weight)
    assert torch.count_nonzero(model.head.weight) == 0
    assert model(torch.randn(2, 3, 24, 32)).shape == (2, 5)


def test_patch_size_change_and_mismatched_keys_are_errors():
    src = create_vit(ModelConfig(img_size=16, **SMALL))
    other_patch = create_vit(ModelConfig(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=2))
    with pytest.raises(CheckpointError, match="patch size"):
        load_weights(other_patch, src.state_dict(), (4, 4))
    deeper = create_vit(ModelConfig(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2))
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks\.1\."):
        load_weights(deeper, src.state_dict(), (4, 4))


def test_loading_into_a_model_with_a_head_and_fc_norm_keeps_them_new():
    # Average-pooled timm ViTs have an fc_norm; a classifier has a head: neither comes from the encoder weights.
    torch.manual_seed(0)
    src = create_vit(ModelConfig(img_size=16, **SMALL))
    dst = create_vit(ModelConfig(img_size=16, **SMALL), num_classes=3)
    dst.reset_classifier(3, global_pool="avg")
    dst.fc_norm = torch.nn.LayerNorm(32)
    load_weights(dst, src.state_dict(), (4, 4))
    torch.testing.assert_close(dst.blocks[0].mlp.fc1.weight, src.blocks[0].mlp.fc1.weight)


def test_avg_pool_head_reads_the_mean_of_the_normed_patch_tokens(tmp_path):
    # An MPP loss never reaches the [class] token, so probes and fine-tunes may read the patch tokens instead.
    torch.manual_seed(0)
    pre_cfg = ModelConfig(img_size=16, **SMALL)
    encoder = create_vit(pre_cfg)
    write_encoder_export(tmp_path, encoder, pre_cfg)
    token, *_ = build_classifier(InitConfig(checkpoint=str(tmp_path)), ModelConfig(img_size=16), 3)
    avg, *_ = build_classifier(InitConfig(checkpoint=str(tmp_path)), ModelConfig(img_size=16, global_pool="avg"), 3)
    assert avg.state_dict().keys() == token.state_dict().keys()  # same weights load: no fc_norm appears
    torch.testing.assert_close(avg.norm.weight, encoder.norm.weight)
    torch.nn.init.normal_(avg.head.weight)
    x = torch.randn(2, 3, 16, 16)
    features = avg.forward_features(x)  # (2, 1 + 16, D), after the final norm
    torch.testing.assert_close(avg(x), avg.head(features[:, 1:].mean(dim=1)))
