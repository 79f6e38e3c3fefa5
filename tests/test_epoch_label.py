"""Epochs printed as people write them: a long fine-tuning logs `eval epoch 1160`, not `eval epoch 1.16e+03` (the
label finetune/train.py builds with plain_number)."""

from __future__ import annotations

import pytest

from vit_mpp.step_meter import plain_number


@pytest.mark.parametrize("value, shown", [
    (1160, "1160"), (1160.0, "1160"), (1_000_000 / 1, "1000000"), (30, "30"), (1, "1"),
    (2.5, "2.5"), (1 / 3, "0.33"), (1160.25, "1160.25"), (0.1, "0.1"),
])
def test_an_epoch_count_is_a_plain_number(value, shown):
    assert plain_number(value) == shown
    assert "e+" not in plain_number(value)

