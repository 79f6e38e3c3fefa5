"""Which pool images train the student (finetune/thresholds.py): a fixed threshold, FreeMatch's self-adaptive
thresholds and distribution alignment, computed here by hand from their papers' formulas; their running means saved
and restored; the per-class record of a log."""

from __future__ import annotations

import pytest
import torch

from finetune.config import SemiConfig
from finetune.thresholds import PoolThresholds


def alone(t: torch.Tensor) -> torch.Tensor:
    return t  # one process: the sum over processes is the tensor itself


def thresholds(**semi) -> PoolThresholds:
    return PoolThresholds(SemiConfig(pool="x", **semi), 3, alone)


PROBS = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4], [0.1, 0.1, 0.8]])
POOL = torch.tensor([False, True, True, True])


def test_a_fixed_threshold_keeps_the_pool_images_at_or_above_it():
    t = thresholds(threshold=0.7)
    confidence, pseudo, kept = t(PROBS, POOL)
    assert pseudo.tolist() == [0, 1, 2, 2] and confidence.tolist() == pytest.approx([0.8, 0.7, 0.4, 0.8])
    assert kept.tolist() == [False, True, False, True]  # row 0 is labelled: never kept
    assert not t.stateful


def test_freematch_updates_its_statistics_from_the_pool_then_thresholds_each_class():
    m = 0.9
    t = thresholds(threshold_mode="freematch", momentum=m)
    _, pseudo, kept = t(PROBS, POOL)
    pool = PROBS[1:]
    tau = m / 3 + (1 - m) * pool.max(1).values.mean()  # starts at 1/K
    p = m / 3 + (1 - m) * pool.mean(0)
    per_class = tau * p / p.max()
    assert t.global_threshold.item() == pytest.approx(tau.item())
    assert t.class_means.tolist() == pytest.approx(p.tolist())
    assert t.class_thresholds().tolist() == pytest.approx(per_class.tolist())
    assert kept.tolist() == [False, *(PROBS[1:].max(1).values >= per_class[pseudo[1:]]).tolist()]
    assert t.stateful


def test_a_micro_batch_without_pool_images_leaves_the_running_means_alone():
    t = thresholds(threshold_mode="freematch", align=True, momentum=0.5)
    before = {k: v.clone() for k, v in t.state_dict().items()}
    _, _, kept = t(PROBS, torch.zeros(4, dtype=torch.bool))
    assert not kept.any()
    assert all(torch.equal(before[k], v) for k, v in t.state_dict().items())


def test_alignment_divides_by_the_teachers_running_mean_and_renormalises():
    m = 0.5
    t = thresholds(align=True, momentum=m, threshold=0.0)
    confidence, pseudo, _ = t(PROBS, POOL)
    q = m / 3 + (1 - m) * PROBS[1:].mean(0)
    aligned = PROBS / q
    aligned = aligned / aligned.sum(1, keepdim=True)
    assert t.teacher_means.tolist() == pytest.approx(q.tolist())
    assert confidence.tolist() == pytest.approx(aligned.max(1).values.tolist())
    assert pseudo.tolist() == aligned.argmax(1).tolist()


def test_the_running_means_are_what_a_checkpoint_keeps():
    t = thresholds(threshold_mode="freematch", align=True, momentum=0.8)
    for _ in range(3):
        t(PROBS, POOL)
    restored = thresholds(threshold_mode="freematch", align=True, momentum=0.8)
    restored.load_state_dict(t.state_dict())
    assert set(t.state_dict()) == {"global_threshold", "class_means", "teacher_means"}
    assert torch.equal(restored.class_thresholds(), t.class_thresholds())
    assert [x.tolist() for x in restored(PROBS, POOL)] == [x.tolist() for x in t(PROBS, POOL)]


def test_labelling_the_validation_images_applies_the_rule_now_and_moves_no_running_mean():
    """What the evaluation asks of the teacher's rule (`label`): the pool's alignment and thresholds as they stand,
    the decisions a pool image with the same probabilities would get, and no running mean or log count moved."""
    t = thresholds(threshold_mode="freematch", align=True, momentum=0.8)
    for _ in range(3):
        t(PROBS, POOL)
    before = {k: v.clone() for k, v in t.state_dict().items()}
    counts = (t.labelled_as.clone(), t.kept_as.clone())
    pseudo, kept = t.label(PROBS)
    assert all(torch.equal(before[k], v) for k, v in t.state_dict().items())
    assert torch.equal(t.labelled_as, counts[0]) and torch.equal(t.kept_as, counts[1])
    aligned = PROBS / t.teacher_means
    aligned = aligned / aligned.sum(1, keepdim=True)
    assert pseudo.tolist() == aligned.argmax(1).tolist()
    assert kept.tolist() == (aligned.max(1).values >= t.class_thresholds()[pseudo]).tolist()
    fixed = thresholds(threshold=0.7)
    assert [x.tolist() for x in fixed.label(PROBS)] == [[0, 1, 2, 2], [True, True, False, True]]


def test_a_log_record_has_each_classs_threshold_and_share_kept_since_the_last():
    t = thresholds(threshold=0.75)
    t(PROBS, POOL)  # pool rows: labelled 1 (0.7, not kept), 2 (0.4, not kept), 2 (0.8, kept)
    record = t.per_class()
    assert record == {"pseudo_class_threshold": [0.75, 0.75, 0.75], "pseudo_class_kept": [None, 0.0, 0.5],
                      "pseudo_class_share": [0.0, pytest.approx(1 / 3, abs=1e-4), pytest.approx(2 / 3, abs=1e-4)]}
    assert t.per_class()["pseudo_class_kept"] == [None, None, None]  # counted again from the last record
