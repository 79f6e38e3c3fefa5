"""One label rule (vit_mpp/data/labels.py) for `build-shards index`, `inspect` and the training streams."""

from __future__ import annotations

import pytest

from vit_mpp.data.labels import MAX_CLASSES, BadLabel, cls_label, sample_label


@pytest.mark.parametrize("raw, label", [(None, -1), (b"0", 0), (b" 7\n", 7), (b"-1", -1), (b"-40", -1),
                                        (str(MAX_CLASSES - 1).encode(), MAX_CLASSES - 1)])
def test_a_cls_is_a_class_index_or_none(raw, label):
    assert cls_label(raw) == label
    assert sample_label({} if raw is None else {"cls": raw}) == label


@pytest.mark.parametrize("raw, reason", [(b"cat", "b'cat' is not an integer"), (b"", "b'' is not an integer"),
                                         (b"1.5", "is not an integer"), (b"9" * 5000, "is not an integer"),
                                         (str(MAX_CLASSES).encode(),
                                          f"above the largest class index, {MAX_CLASSES - 1}"),
                                         (b"99999999999999999999", "above the largest class index")])
def test_a_bad_cls_is_reported_with_why_and_read_as_no_label(raw, reason):
    with pytest.raises(BadLabel) as e:
        cls_label(raw)
    assert reason in str(e.value) and len(str(e.value)) < 100  # the first bytes only, never the whole member
    assert sample_label({"cls": raw}) == -1
