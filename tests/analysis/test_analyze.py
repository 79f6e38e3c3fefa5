"""python -m analysis and its helpers: rollout, position similarity, attention distance, parameter table, the CLI."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

from analysis import attention_stats as stats
from analysis.analyze import main as analyze_main
from data_tools.cli import main as build_main
from tests.helpers.disks import small_disk
from tests.helpers.models import write_encoder_export
from tests.helpers.shards import img2dataset_folder
from vit_mpp.config.sections import ModelConfig
from vit_mpp.models.vit import create_vit
from vit_mpp.processes.exits import run_main

TINY = ModelConfig(name="vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def test_rollout_of_identity_attention_is_identity():
    t = 5
    probs = [torch.eye(t).expand(2, 3, t, t) for _ in range(4)]  # (B, heads, T, T) per layer
    torch.testing.assert_close(stats.attention_rollout(probs), torch.eye(t).expand(2, t, t))


def test_rollout_rows_are_distributions():
    torch.manual_seed(0)
    probs = [torch.rand(2, 3, 6, 6).softmax(dim=-1) for _ in range(3)]
    torch.testing.assert_close(stats.attention_rollout(probs).sum(dim=-1), torch.ones(2, 6))


def test_orthogonal_position_embeddings_have_identity_similarity():
    torch.manual_seed(0)
    n, d = 9, 16
    q, _ = torch.linalg.qr(torch.randn(d, d))  # orthonormal columns
    pos = torch.cat([torch.randn(1, d), 3.0 * q[:, :n].T]).unsqueeze(0)  # (1, 1 + N, D), row 0 is [class]
    torch.testing.assert_close(stats.position_similarity(pos, prefix=1), torch.eye(n), atol=1e-5, rtol=0)


def test_attention_to_own_patch_has_zero_distance():
    grid, prefix = (3, 4), 1
    t = prefix + grid[0] * grid[1]
    probs = [torch.eye(t).expand(2, 2, t, t)]
    torch.testing.assert_close(stats.mean_attention_distance(probs, prefix, grid, 16), torch.zeros(1, 2))


def test_uniform_attention_distance_matches_closed_form():
    model = create_vit(TINY).eval()
    for blk in model.blocks:  # q = k = 0: every logit is 0, so every query attends uniformly to every token
        blk.attn.qkv.weight.data[: 2 * model.embed_dim].zero_()
        blk.attn.qkv.bias.data[: 2 * model.embed_dim].zero_()
    torch.manual_seed(0)
    probs = stats.attention_probs(model, torch.randn(3, 3, 32, 32))
    t = 1 + 16
    assert len(probs) == 2 and probs[0].shape == (3, 2, t, t)
    torch.testing.assert_close(probs[1], torch.full_like(probs[1], 1 / t))
    centres = [(8 * r, 8 * c) for r in range(4) for c in range(4)]
    expected = np.mean([math.dist(a, b) for a, b in itertools.product(centres, centres)])
    dist = stats.mean_attention_distance(probs, 1, (4, 4), 8)
    torch.testing.assert_close(dist, torch.full((2, 2), float(expected)), atol=1e-4, rtol=0)


def test_attention_probs_reproduce_the_block_output():
    """The recomputed probabilities, applied to v, give what timm's (fused) attention module outputs."""
    torch.manual_seed(0)
    model = create_vit(TINY).eval()
    attn = model.blocks[1].attn
    seen = {}
    handle = attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    probs = stats.attention_probs(model, torch.randn(2, 3, 32, 32))
    handle.remove()
    x = seen["x"]  # (B, T, D)
    b, t, d = x.shape
    v = attn.qkv(x).reshape(b, t, 3, attn.num_heads, attn.head_dim)[:, :, 2].transpose(1, 2)  # (B, heads, T, hd)
    out = attn.proj((probs[1] @ v).transpose(1, 2).reshape(b, t, d))
    torch.testing.assert_close(out, seen["out"], atol=1e-5, rtol=1e-4)


def test_patch_embedding_pcs_are_orthonormal():
    torch.manual_seed(0)
    pcs, explained = stats.patch_embedding_pcs(torch.randn(64, 3, 4, 4), 28)
    flat = pcs.reshape(28, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(28), atol=1e-4, rtol=0)
    assert torch.all(explained[:-1] >= explained[1:]) and float(explained.sum()) <= 1.0


def test_param_table_vit_base_four_classes():
    with torch.device("meta"):  # counts only: no memory for the 86M weights, no initialisation time
        model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=4)
    rows = stats.param_table(model)
    total = rows[-1]
    assert total["module"] == "total" and total["params"] == 85_801_732
    assert total["fp32_bytes"] == 4 * 85_801_732 and round(total["fp32_bytes"] / 2**20) == 327
    assert sum(r["params"] for r in rows[:-1]) == total["params"]
    assert [r["module"] for r in rows if r["module"].startswith("blocks.")] == [f"blocks.{i}" for i in range(12)]


@pytest.fixture()
def tiny_export(tmp_path):
    torch.manual_seed(0)
    return write_encoder_export(tmp_path / "export", create_vit(TINY), TINY)


def test_cli_end_to_end(tiny_export, tmp_path):
    rng = np.random.default_rng(0)
    images = []
    for i, size in enumerate([(40, 50), (32, 32)]):
        images.append(tmp_path / f"img{i}.png")
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(images[-1])
    out = tmp_path / "analysis"
    analyze_main([str(tiny_export), "--images", *map(str, images), "--out", str(out), "--components", "8",
                  "--device", "cpu"])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["attention_0_img0.png", "attention_1_img1.png", "attention_distance.png",
                    "embedding_filters.png", "position_similarity.png"]
    for name in pngs:
        with Image.open(out / name) as im:
            im.verify()
        with Image.open(out / name) as im:
            assert 200 <= im.width <= 2000 and 150 <= im.height <= 2000, (name, im.size)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grid"] == [4, 4] and summary["params"] == sum(p.numel() for p in create_vit(TINY).parameters())
    assert len(summary["mean_attention_distance_px"]) == 2 and len(summary["filter_pc_explained_variance"]) == 8
    assert (out / "params.csv").read_text().splitlines()[-1].startswith("total,")


@pytest.mark.parametrize("room_kib", [4, 16])  # full at the parameter table (the first files), at a figure
def test_a_full_disk_under_analyze_is_one_line_and_what_it_wrote_is_whole(tiny_export, tmp_path, capsys, room_kib):
    """A real full disk (a small tmpfs): the parameter table and summary.json were plain writes, a traceback and a cut
    file on a full disk; every file analyze writes is now whole or not there."""
    with small_disk(tmp_path / "disk", 256) as disk:
        (disk / "filler").write_bytes(b"x" * (256 - room_kib) * 1024)
        out = disk / "analysis"
        with pytest.raises(SystemExit) as e:
            run_main(analyze_main, [str(tiny_export), "--out", str(out), "--components", "8", "--device", "cpu"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err and "cannot be written: no space left on device" in err, err
        written = sorted(p.name for p in out.iterdir())
        assert not [n for n in written if n.endswith(".tmp")], written
        for name in written:
            if name.endswith(".json"):
                json.loads((out / name).read_text())
        assert ("/params." in err) if room_kib == 4 else ("params.json" in written and ".png cannot" in err), err


def test_cli_timm_state_dict(tmp_path, capsys):
    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False, num_classes=3, img_size=32)  # timm's tiny test ViT
    bare = tmp_path / "timm.safetensors"
    save_file(model.state_dict(), str(bare))
    with pytest.raises(SystemExit) as e:
        run_main(analyze_main, [str(bare)])
    assert e.value.code == 2 and "--model NAME" in capsys.readouterr().err
    # At 48 pixels the 2x2 grid of position embeddings is resized to 3x3; no images: attention is skipped.
    analyze_main([str(bare), "--model", "test_vit", "--img-size", "48", "--out", str(tmp_path / "a")])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["grid"] == [3, 3] and summary["num_classes"] == 3 and "mean_attention_distance_px" not in summary
    assert sorted(p.name for p in (tmp_path / "a").glob("*.png")) == ["embedding_filters.png",
                                                                      "position_similarity.png"]


def test_an_unreadable_image_or_another_model_is_one_line_and_writes_nothing(tiny_export, tmp_path, capsys):
    # an undecodable --images file was a BadImage traceback, after the first figures were written; --model naming
    # another architecture than the export's was silently ignored
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    out = tmp_path / "analysis"
    for extra, message in ((["--images", str(bad)], f"error: --images {bad}: undecodable: "),
                           (["--model", "vit_base_patch16_224"], "error: --model vit_base_patch16_224: "
                                                                 f"{tiny_export} is a vit_tiny_patch16_224 and names")):
        with pytest.raises(SystemExit) as e:
            run_main(analyze_main, [str(tiny_export), "--out", str(out), "--device", "cpu", *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith(message) and "\n" not in err, err
        assert not out.exists()


def test_an_undecodable_shard_sample_is_passed_over_and_said(tiny_export, tmp_path, capsys):
    shards = img2dataset_folder(tmp_path / "shards", [4], corrupt="000000001")
    build_main(["index", str(shards), "--workers", "1"])
    out = tmp_path / "analysis"
    analyze_main([str(tiny_export), "--shards", str(shards), "--split", "train", "--num-images", "4", "--num-maps",
                  "1", "--out", str(out), "--device", "cpu"])
    assert f"warning: 1 undecodable sample(s) of {shards} passed over (first: 000000001)" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["images"] == ["000000000", "000000002", "000000003"]
