"""A checkpoint a user brings that is broken is one line, `error: ...`, exit 2, wherever it is read: fine-tuning's
init.checkpoint, predict and analysis. And a resumed pretraining run draws the same corruption as the
uninterrupted one, so its losses are the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import save_file

from analysis.analyze import main as analyze_main
from finetune.__main__ import main as finetune_main
from finetune.predict import main as predict_main
from pretrain.__main__ import main as pretrain_main
from tests.helpers.models import SMALL_MODEL
from tests.helpers.runs import read_metrics
from tests.helpers.shards import write_shard_set
from vit_mpp.models.vit import create_vit
from vit_mpp.processes.exits import run_main


def broken(tmp_path: Path, good: Path, kind: str) -> Path:
    """A checkpoint damaged the way `kind` says (a copy of `good`, when it is an export); returns what to pass as
    init.checkpoint."""
    if kind in ("truncated_export", "empty_export", "garbage_config", "config_without_weights_id"):
        out = tmp_path / "export"
        out.mkdir()
        for f in good.iterdir():
            (out / f.name).write_bytes(f.read_bytes())
        weights, config = out / "model.safetensors", out / "config.json"
        if kind == "truncated_export":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif kind == "empty_export":
            weights.write_bytes(b"")
        elif kind == "garbage_config":
            config.write_text("{not json")
        else:
            data = json.loads(config.read_text())
            data["vit_mpp"]["model"] = {"name": "vit_tiny_patch16_224", "depth": "deep"}
            config.write_text(json.dumps(data))
        return out
    path = tmp_path / {"truncated_safetensors": "w.safetensors", "empty_safetensors": "w.safetensors",
                       "empty_pth": "w.pth", "text_pth": "w.pth", "object_npz": "w.npz", "text_npz": "w.npz",
                       "manifest": "_info.json", "garbage_encoder_json": "encoder.safetensors"}[kind]
    state = create_vit(SMALL_MODEL).state_dict()
    if kind == "truncated_safetensors":
        save_file(state, str(path))
        path.write_bytes(path.read_bytes()[:500])
    elif kind in ("empty_safetensors", "empty_pth"):
        path.write_bytes(b"")
    elif kind in ("text_pth", "manifest"):
        path.write_text("not a checkpoint")
    elif kind == "text_npz":
        path.write_bytes(b"PK\x03\x04 not a zip archive after all")
    elif kind == "object_npz":
        np.savez(path, **{"embedding/kernel": np.array([{"a": 1}], dtype=object),
                          "Transformer/posembed_input/pos_embedding": np.array([{"b": 2}], dtype=object)})
    else:  # an older-format export whose json is garbage
        save_file(state, str(path))
        path.with_suffix(".json").write_text("[1, 2")
        return tmp_path
    return path


CASES = {
    "truncated_export": "cannot read",
    "empty_export": "cannot read",
    "garbage_config": "is not readable JSON",
    "config_without_weights_id": "does not describe a model this tool can build: config key 'depth' expects",
    "truncated_safetensors": "cannot read",
    "empty_safetensors": "cannot read",
    "empty_pth": "cannot read",
    "text_pth": "cannot read",
    "object_npz": "unpickling",
    "text_npz": "as an .npz archive: File is not a zip file",  # a BadZipFile traceback
    "manifest": "unknown checkpoint format '.json'",
    "garbage_encoder_json": "is not readable JSON",
}


def one_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_fine_tuning_from_a_broken_checkpoint_is_one_line(tmp_path, encoder_export, capsys, kind):
    shards = write_shard_set(tmp_path / "shards", {"train": [8], "val": [4]})
    ckpt = broken(tmp_path, encoder_export, kind)
    with pytest.raises(SystemExit) as e:
        run_main(finetune_main, ["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}",
                                 f"train.run_dir={tmp_path / 'run'}", f"init.checkpoint={ckpt}", "data.num_workers=0",
                                 "model.patch_size=4", "model.embed_dim=32", "model.depth=1", "model.num_heads=2"])
    assert e.value.code == 2
    assert CASES[kind] in one_line(capsys)
    # found before the run directory is written (a file of an unknown format, a damaged .npz, safetensors file or
    # export, a bad .pth were found after it, with config.yaml written)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["truncated_export", "garbage_config"])
def test_predict_and_analysis_of_a_broken_export_are_one_line(tmp_path, encoder_export, capsys, kind):
    ckpt = broken(tmp_path, encoder_export, kind)
    Image.new("RGB", (20, 20)).save(tmp_path / "a.png")  # predict lists its images before it loads the model
    for main, argv in ((predict_main, ["--checkpoint", str(ckpt), "--images", str(tmp_path / "a.png")]),
                       (analyze_main, [str(ckpt), "--out", str(tmp_path / "a")])):
        with pytest.raises(SystemExit) as e:
            run_main(main, argv)
        assert e.value.code == 2
        assert CASES[kind] in one_line(capsys)


def test_a_resumed_pretraining_reproduces_the_uninterrupted_losses(demo_shards, tmp_path):
    # No augmentation (whole-image crops, no flips) and no shuffle buffer: what remains random is the corruption.
    argv = ["--config", "configs/pretrain/tiny.yaml", f"data.shards={demo_shards}", "data.num_workers=0",
            "data.shuffle_buffer=0", "data.crop_scale=[1.0,1.0]", "data.hflip=false", "train.log_every=1",
            "train.eval_every=0", "data.val_split=", "train.steps=6", "train.ckpt_every=3", f"train.run_dir={tmp_path}"]

    def losses() -> list[float]:
        return [r["loss"] for r in read_metrics(tmp_path)]

    pretrain_main(argv)
    whole = losses()
    # A run killed after its step-3 checkpoint leaves exactly this behind: re-running resumes from step 3.
    shutil.rmtree(tmp_path / "checkpoints" / "step_000006")
    pretrain_main(argv)
    assert len(whole) == len(losses()) == 6
    np.testing.assert_allclose(losses(), whole, rtol=1e-6)
