"""Scoring a classifier on a split (finetune/scoring.py `evaluate`) with a pool's rule: the teacher's pseudo-labels of
the validation images, how many the rule keeps and how many of those are right, counted by hand; and the warning a
run prints once when they are mostly wrong (finetune/keep_best.py)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from finetune.config import SemiConfig
from finetune.keep_best import poor_teacher_warning
from finetune.scoring import evaluate
from finetune.thresholds import PoolThresholds

LOGITS = torch.tensor([[4.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.2, 0.0, 0.1], [0.0, 0.0, 5.0], [0.0, 4.0, 0.0]])
LABELS = torch.tensor([0, 2, 1, 2, 0])
VALID = torch.tensor([True, True, True, True, False])  # the last row pads a rank's range: counted nowhere


class Replay(torch.nn.Module):
    """A classifier whose logits for the n-th batch are given: the arithmetic of `evaluate` alone."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        super().__init__()
        self.batches = iter(batches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return next(self.batches)


def batches() -> list[dict[str, torch.Tensor]]:
    image = torch.zeros(5, 3, 2, 2, dtype=torch.uint8)
    return [{"image": image[:3], "label": LABELS[:3], "valid": VALID[:3]},
            {"image": image[3:], "label": LABELS[3:], "valid": VALID[3:]}]


def score(labeller=None) -> dict[str, float]:
    model = Replay([LOGITS[:3], LOGITS[3:]])
    return evaluate(Accelerator(cpu=True), model, batches(), ((0.5,) * 3, (0.5,) * 3), 3, labeller)[0]


def test_the_pools_rule_scores_the_teachers_pseudo_labels_of_the_validation_images():
    rule = PoolThresholds(SemiConfig(pool="x", threshold=0.7), 3, lambda t: t)
    result = score(rule.label)
    probs = LOGITS.softmax(1)
    kept = (probs.max(1).values >= 0.7) & VALID  # rows 0, 1 and 3 (row 2 is unsure, row 4 is padding)
    right = kept & (probs.argmax(1) == LABELS)  # rows 0 and 3 (row 1's pseudo-label 1 is wrong)
    assert kept.tolist() == [True, True, False, True, False] and right.sum() == 2
    assert result["val_pseudo_kept"] == pytest.approx(3 / 4)
    assert result["val_pseudo_acc"] == pytest.approx(2 / 3)
    assert result["val_top1"] == pytest.approx(2 / 4)  # row 2's argmax 0 is wrong too
    assert "val_pseudo_kept" not in score() and score()["val_top1"] == result["val_top1"]  # no rule: no estimate


def test_a_rule_that_keeps_nothing_scores_no_right_pseudo_label_and_no_warning():
    rule = PoolThresholds(SemiConfig(pool="x", threshold=1.0), 3, lambda t: t)
    result = score(rule.label)
    assert result["val_pseudo_kept"] == 0.0 and result["val_pseudo_acc"] == 0.0
    assert poor_teacher_warning(result, 10) is None


def test_a_teacher_mostly_wrong_on_what_it_would_keep_is_warned_of_in_one_line():
    line = poor_teacher_warning({"val_pseudo_kept": 0.4, "val_pseudo_acc": 0.21}, 300)
    assert line.startswith("warning: at step 300 ") and "40%" in line and "21% right" in line and "\n" not in line
    assert "semi.gate=0.5 keeps the pool out while so" in line  # what to do about it
    assert poor_teacher_warning({"val_pseudo_kept": 0.85, "val_pseudo_acc": 0.91}, 300) is None
    assert poor_teacher_warning({"val_top1": 0.2}, 300) is None  # no pool: nothing to say
