"""A sample's class label, as every part of the project reads it: the decimal integer of its `.cls` member; a
negative one is no label, and text that is not an integer or an index at or above `MAX_CLASSES` is a bad label.
`build-shards index` counts labels with `cls_label`, `build-shards inspect` checks them with it, and the training
and evaluation streams read them with `sample_label`, so a label the index counted is the label training meets.
See docs/data_stream.md#bad-samples.
"""

from __future__ import annotations

from typing import Any

# The most classes a manifest or a classifier takes (labels 0 .. MAX_CLASSES - 1), for build-shards, index and
# fine-tuning alike: above the largest label spaces in use (ImageNet-21k has 21,841; face sets a few million
# identities), and a bound on what a stray label can make (a head and class-name list sized by a label of 10**20
# would exhaust memory, and a batch cannot hold an index beyond int64).
MAX_CLASSES = 10_000_000


class BadLabel(ValueError):
    """A `.cls` that is not a class index; the message says why."""


def cls_label(raw: bytes | None) -> int:
    """The class index in a `.cls` member's bytes; -1 for none (no `.cls`, or a negative integer). Raises
    `BadLabel` for text that is not an integer or an index at or above `MAX_CLASSES`."""
    if raw is None:
        return -1
    try:
        label = int(raw)
    except ValueError:  # also text too long to be an integer (Python's digit limit)
        raise BadLabel(f"{raw[:20]!r} is not an integer") from None
    if label >= MAX_CLASSES:
        raise BadLabel(f"{label} is above the largest class index, {MAX_CLASSES - 1}")
    return max(label, -1)


def sample_label(sample: dict[str, Any]) -> int:
    """The label a training or evaluation stream gives a raw sample: `cls_label` of its `.cls`, with a bad label
    read as none (-1), as `build-shards index` counts it (`num_unlabelled`)."""
    try:
        return cls_label(sample.get("cls"))
    except BadLabel:
        return -1
