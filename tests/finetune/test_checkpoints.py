"""Loading every checkpoint kind fine-tuning accepts: export, timm .safetensors / .pth, original ViT .npz."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from finetune.config import FinetuneConfig, InitConfig
from finetune.init_model import build_classifier
from tests.helpers.models import SMALL, write_encoder_export
from vit_mpp.config.engine import ConfigError, load_config
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.export import ExportError, strip_prefix
from vit_mpp.models.pretrained import checkpoint_kind, resize_pos_embed
from vit_mpp.models.vit import create_vit
from vit_mpp.models.weight_files import CheckpointError, read_state_dict


@pytest.fixture
def encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    return create_vit(ModelConfig(img_size=16, **SMALL))  # a 4 x 4 grid


def assert_loaded(model, encoder, new_grid=(4, 4)):
    """Every encoder weight arrived (position embeddings resized from the 4 x 4 grid), and the head is zero."""
    src = encoder.state_dict()
    for k, v in model.state_dict().items():
        if k.startswith("head."):
            assert torch.count_nonzero(v) == 0
        elif k == "pos_embed":
            torch.testing.assert_close(v, resize_pos_embed(src[k], (4, 4), new_grid, 1, "bilinear"))
        else:
            torch.testing.assert_close(v, src[k], msg=k)


def vit_npz(model, path):
    """Write a timm ViT in the original ViT checkpoint layout (the names and axes timm's _load_weights reads)."""
    d = model.embed_dim
    h = model.blocks[0].attn.num_heads
    n = lambda t: t.detach().numpy()  # noqa: E731
    w = {"embedding/kernel": n(model.patch_embed.proj.weight).transpose(2, 3, 1, 0),  # OIHW -> HWIO
         "embedding/bias": n(model.patch_embed.proj.bias), "cls": n(model.cls_token),
         "Transformer/posembed_input/pos_embedding": n(model.pos_embed),
         "Transformer/encoder_norm/scale": n(model.norm.weight), "Transformer/encoder_norm/bias": n(model.norm.bias),
         "head/kernel": np.zeros((d, 1000), np.float32), "head/bias": np.zeros(1000, np.float32)}
    for i, b in enumerate(model.blocks):
        p = f"Transformer/encoderblock_{i}/"
        a = p + "MultiHeadDotProductAttention_1/"
        w[p + "LayerNorm_0/scale"], w[p + "LayerNorm_0/bias"] = n(b.norm1.weight), n(b.norm1.bias)
        w[p + "LayerNorm_2/scale"], w[p + "LayerNorm_2/bias"] = n(b.norm2.weight), n(b.norm2.bias)
        for j, name in enumerate(("query", "key", "value")):
            w[a + f"{name}/kernel"] = n(b.attn.qkv.weight[j * d:(j + 1) * d]).T.reshape(d, h, d // h)
            w[a + f"{name}/bias"] = n(b.attn.qkv.bias[j * d:(j + 1) * d]).reshape(h, d // h)
        w[a + "out/kernel"] = n(b.attn.proj.weight).reshape(d, h, d // h).transpose(1, 2, 0)
        w[a + "out/bias"] = n(b.attn.proj.bias)
        for r, fc in enumerate((b.mlp.fc1, b.mlp.fc2)):
            w[p + f"MlpBlock_3/Dense_{r}/kernel"] = n(fc.weight).T
            w[p + f"MlpBlock_3/Dense_{r}/bias"] = n(fc.bias)
    np.savez(path, **w)


def test_export(tmp_path, encoder):
    write_encoder_export(tmp_path, encoder, ModelConfig(img_size=16, **SMALL))
    assert checkpoint_kind(str(tmp_path)) == "export"
    model, *_ = build_classifier(InitConfig(checkpoint=str(tmp_path)), ModelConfig(img_size=24), 3)
    assert_loaded(model, encoder, (6, 6))


def test_an_export_with_no_weights_under_the_prefix_is_refused(tmp_path, encoder):
    # What a torch.compile wrapper's `_orig_mod.encoder.*` keys once produced: an empty encoder file.
    state = {f"_orig_mod.encoder.{k}": v for k, v in encoder.state_dict().items()}
    with pytest.raises(ExportError, match="no weights under 'encoder.'"):
        strip_prefix(state, "encoder.")


@pytest.mark.parametrize("wrap", [None, "model", "state_dict"])
def test_timm_pth_weights_only(tmp_path, encoder, wrap):
    state = {"head.weight": torch.ones(5, 32), "head.bias": torch.ones(5), **encoder.state_dict()}
    torch.save(state if wrap is None else {wrap: state, "epoch": 3}, tmp_path / "w.pth")
    assert checkpoint_kind(str(tmp_path / "w.pth")) == "timm"
    model, *_ = build_classifier(InitConfig(checkpoint=str(tmp_path / "w.pth")), ModelConfig(img_size=24, **SMALL), 3)
    assert_loaded(model, encoder, (6, 6))  # the old head is dropped, the new one is zero


def test_timm_safetensors_with_non_square_grid(tmp_path, encoder):
    wide = create_vit(ModelConfig(img_size=[16, 24], **SMALL))  # a 4 x 6 grid: not inferable, given by init.grid
    save_file(wide.state_dict(), str(tmp_path / "w.safetensors"))
    init = InitConfig(checkpoint=str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match=r"not a square grid: set init.grid"):
        build_classifier(init, ModelConfig(img_size=32, **SMALL), 3)
    init.grid = [4, 6]
    model, *_ = build_classifier(init, ModelConfig(img_size=32, **SMALL), 3)
    expected = resize_pos_embed(wide.pos_embed.detach(), (4, 6), (8, 8), 1, "bilinear")
    torch.testing.assert_close(model.pos_embed.detach(), expected)


class Payload:
    """Any class: unpickling it would run code, so a weights-only load must refuse it."""


def test_pickled_object_is_refused(tmp_path, encoder):
    torch.save({"model": encoder.state_dict(), "payload": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="refused"):
        read_state_dict(tmp_path / "evil.pth")
    torch.save({"pos_embed": torch.zeros(1), "note": "text"}, tmp_path / "odd.pth")
    with pytest.raises(CheckpointError, match=r"not tensors: \['note'\]"):
        read_state_dict(tmp_path / "odd.pth")


def test_a_torch_file_is_mapped_not_read_and_a_legacy_one_still_loads(tmp_path, encoder, monkeypatch):
    torch.save({"model": encoder.state_dict()}, tmp_path / "zip.pth")
    torch.save(encoder.state_dict(), tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k.get("mmap", False)) or real(*a, **k))
    for name in ("zip.pth", "legacy.pth"):
        state = read_state_dict(tmp_path / name)
        assert state.keys() == encoder.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in encoder.state_dict().items())
    # the look before a run read every tensor of a torch file: now only a legacy file is read whole
    assert calls == [True, True, False]


def test_original_vit_npz(tmp_path, encoder):
    vit_npz(encoder, tmp_path / "ViT-tiny.npz")
    assert checkpoint_kind(str(tmp_path / "ViT-tiny.npz")) == "npz"
    init = InitConfig(checkpoint=str(tmp_path / "ViT-tiny.npz"))
    same, *_ = build_classifier(init, ModelConfig(img_size=16, **SMALL), 3)
    assert_loaded(same, encoder)  # the layout round-trips exactly
    larger, *_ = build_classifier(init, ModelConfig(img_size=[24, 32], **SMALL), 3)
    assert_loaded(larger, encoder, (6, 8))


def test_mismatched_checkpoints_are_one_line_errors(tmp_path, encoder):
    save_file(encoder.state_dict(), str(tmp_path / "w.safetensors"))
    deeper = ModelConfig(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks\.1\.") as err:
        build_classifier(InitConfig(checkpoint=str(tmp_path / "w.safetensors")), deeper, 3)
    assert "\n" not in str(err.value)
    vit_npz(encoder, tmp_path / "v.npz")
    with pytest.raises(CheckpointError, match="missing array") as err:
        build_classifier(InitConfig(checkpoint=str(tmp_path / "v.npz")), deeper, 3)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        build_classifier(InitConfig(checkpoint=str(tmp_path / "nothing.pth")), deeper, 3)


def test_normalisation_override(tmp_path, encoder):
    write_encoder_export(tmp_path, encoder, ModelConfig(img_size=16, **SMALL), mean=(0.1, 0.2, 0.3),
                         std=(0.4, 0.5, 0.6))
    _, mean, std, _ = build_classifier(InitConfig(checkpoint=str(tmp_path)), ModelConfig(img_size=16), 3)
    assert (mean, std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))  # the export's own
    cfg = load_config(FinetuneConfig, "configs/finetune/tiny.yaml", [
        f"init.checkpoint={tmp_path}", "init.mean=[0.485,0.456,0.406]", "init.std=[0.229,0.224,0.225]"])
    _, mean, std, _ = build_classifier(cfg.init, ModelConfig(img_size=16), 3)
    assert (mean, std) == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    with pytest.raises(ConfigError, match=r"init.std"):  # checked when the config is loaded
        load_config(FinetuneConfig, None, ["init.std=[0.2,0.0,0.2]"])
