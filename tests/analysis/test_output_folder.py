"""Where `python -m analysis` writes: beside the export (`EXPORT-analysis`, evaluation's rule, one function), never
into an export folder; the model card's figures, which belong in the export, are still drawn there (--out)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from analysis.analyze import default_out
from analysis.analyze import main as analyze_main
from finetune.evaluate import default_out as eval_out
from tests.helpers.models import SMALL_MODEL, write_encoder_export
from vit_mpp.config.engine import ConfigError
from vit_mpp.models.hub import draw_figures
from vit_mpp.models.vit import create_vit


def files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_the_figures_go_beside_the_export_and_the_export_is_untouched(tmp_path):
    torch.manual_seed(0)
    export = write_encoder_export(tmp_path / "run" / "export", create_vit(SMALL_MODEL), SMALL_MODEL)
    before = files(export)
    analyze_main([str(export), "--components", "4"])
    assert files(export) == before  # no analysis/ inside the export
    out = tmp_path / "run" / "export-analysis"
    assert (out / "summary.json").is_file() and (out / "position_similarity.png").is_file()
    # One rule for every tool that writes about a checkpoint.
    assert default_out(str(export / "model.safetensors")) == out
    assert default_out(f"local-dir:{export}") == out
    assert eval_out(str(export), "val") == tmp_path / "run" / "export-eval-val"
    best = write_encoder_export(export / "best", create_vit(SMALL_MODEL), SMALL_MODEL)
    assert default_out(str(best)) == tmp_path / "run" / "export-best-analysis"  # outside the outer export too
    (tmp_path / "bare.npz").write_bytes(b"")
    assert default_out(str(tmp_path / "bare.npz")) == tmp_path / "bare-analysis"
    assert default_out("hf-hub:timm/vit_base_patch16_224") == Path("hf-hub_timm_vit_base_patch16_224-analysis")


def test_the_model_cards_figures_are_still_drawn_into_the_export(demo_shards, tmp_path, capsys):
    torch.manual_seed(0)
    export = write_encoder_export(tmp_path / "export", create_vit(SMALL_MODEL), SMALL_MODEL)
    draw_figures(export, str(demo_shards))
    assert "warning" not in capsys.readouterr().err
    drawn = files(export / "analysis")
    assert {"position_similarity.png", "embedding_filters.png", "attention_distance.png"} <= set(drawn)
    assert any(name.startswith("attention_0_") for name in drawn)
    assert not (tmp_path / "export-analysis").exists()


def test_a_bad_out_is_found_before_the_model_is_loaded(tmp_path):
    # The checkpoint does not exist: the error names --out, so --out was checked first.
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*f is a file: give a folder for the results"):
        analyze_main([str(tmp_path / "no-such-export"), "--out", str(tmp_path / "f")])
