"""The data half of experiments/pretrain_vs_scratch.py: the digits class-folder tree and the labelled subsets."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("sklearn")  # the dev extra; its bundled digits are the dataset

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "pretrain_vs_scratch.py"
spec = importlib.util.spec_from_file_location("pretrain_vs_scratch", SCRIPT)
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def test_digits_tree_has_every_image_in_ten_folders_per_split(tmp_path: Path) -> None:
    items = bench.write_digits(tmp_path, size=16, val_fraction=0.2)
    assert {k: len(v) for k, v in items.items()} == {"train": 1437, "val": 360}
    pngs = sorted(tmp_path.glob("*/*/*.png"))
    assert len(pngs) == 1797
    for split in ("train", "val"):
        assert sorted(p.name for p in (tmp_path / split).iterdir()) == [str(d) for d in range(10)]
    # Stratified: every digit is in val in about its share (the classes hold 174 to 183 images).
    assert all(35 <= n <= 37 for n in Counter(label for _, label in items["val"]).values())
    img = Image.open(pngs[0])
    assert img.size == (16, 16) and img.mode == "L"
    # Nearest upsampling: each original pixel is a 2x2 block.
    px = img.load()
    assert all(px[2 * x, 2 * y] == px[2 * x + 1, 2 * y + 1] for x in range(8) for y in range(8))
    assert not {p for p, _ in items["train"]} & {p for p, _ in items["val"]}


def test_labelled_subset_is_per_class_and_seeded(tmp_path: Path) -> None:
    items = bench.write_digits(tmp_path, size=8, val_fraction=0.2)
    a, b, c = (bench.labelled_subset(items, 10, seed) for seed in (0, 0, 1))
    assert a == b and a != c
    assert Counter(label for _, label in a) == {d: 10 for d in range(10)}
    assert set(a) <= set(items["train"])
    assert bench.labelled_subset(items, 0, 0) == items["train"]


def test_the_flags_become_compare_arms_and_overrides(tmp_path: Path) -> None:
    args = bench.build_parser().parse_args(["--seeds", "0", "1", "--ablations", "--ablation-steps", "50",
                                            "--finetune-epochs", "7", "--finetune-set", "optim.base_lr=5e-4",
                                            "--arms", "scratch,mpp", "--labels-per-class", "0"])
    argv = bench.compare_argv(args, tmp_path)
    arms = argv[argv.index("--arms") + 1].split(",")
    assert arms == ["scratch", "mpp", "mpp-mean_color", "mpp-pixels_4x4", "mpp-l2", "mpp-mask15"]
    sets = argv[argv.index("--set") + 1:]
    assert sets[:2] == ["finetune:train.epochs=7", "finetune:optim.base_lr=5e-4"]
    assert "mpp-l2.pretrain:mpp.target=l2" in sets and "mpp-mask15.pretrain:mpp.mask_ratio=0.15" in sets
    assert "mpp-l2.pretrain:train.steps=50" in sets and not any("probe-avg" in s for s in sets)
    assert argv[argv.index("--labelled") + 1] == str(tmp_path / "shards" / "all")  # 0 per class: every label
    assert argv[argv.index("--test") + 1] == f"{tmp_path / 'shards' / 'all'}:val"


def test_set_gives_a_variant_arm_its_own_overrides_after_the_scripts(tmp_path: Path) -> None:
    # The digits run of the normalised-pixel recipe (docs/results.md, "The digits") needs a variant arm's own --set.
    args = bench.build_parser().parse_args(["--arms", "mpp-l2n,scratch", "--pretrain-set", "train.steps=9", "--set",
                                            "mpp-l2n.pretrain:mpp.target=l2", "mpp-l2n.pretrain:mpp.norm_pix=true"])
    argv = bench.compare_argv(args, tmp_path)
    sets = argv[argv.index("--set") + 1:]
    assert sets == ["pretrain:train.steps=9", "mpp-l2n.pretrain:mpp.target=l2", "mpp-l2n.pretrain:mpp.norm_pix=true"]
