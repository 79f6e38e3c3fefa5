"""The shard stream in one process: work split, exactly-once epochs, evaluation padding, resume."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.helpers.shards import bad_shard_set, write_shard_set
from vit_mpp.config import DataConfig
from vit_mpp.data_stream import DataError, build_loader
from vit_mpp.manifest import load_split

UNEVEN = {"train": [7, 1, 12, 4], "val": [5, 2]}  # 24 train samples in 4 uneven shards, 7 val


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return write_shard_set(tmp_path_factory.mktemp("uneven"), UNEVEN, size=8)


def keys_per_rank(shards, split, world, workers, batch, train, epochs=1, start_batch=0):
    """Keys each simulated rank receives, per epoch, by running every rank's loader in this process."""
    s, _ = load_split(shards, split)
    data = DataConfig(num_workers=workers, shuffle_buffer=4)
    out = []
    for rank in range(world):
        stream, loader = build_loader(s, data, 8, batch, rank=rank, world_size=world, train=train, seed=3,
                                      start_batch=start_batch)
        it = iter(loader)
        per_epoch = []
        for _ in range(epochs):
            batches = [next(it) for _ in range(stream.batches_per_epoch - (start_batch if not per_epoch else 0))]
            per_epoch.append(batches)
        out.append(per_epoch)
    return out


def test_train_epoch_sees_every_sample_once_with_equal_steps(uneven):
    # 2 ranks x 2 workers x batch 3 = 12 divides 24: every sample exactly once per epoch.
    ranks = keys_per_rank(uneven, "train", world=2, workers=2, batch=3, train=True, epochs=3)
    orders = []
    for epoch in range(3):
        counts = [len(r[epoch]) for r in ranks]
        assert counts[0] == counts[1] == 4  # same number of steps on both ranks
        keys = [k for r in ranks for b in r[epoch] for k in b["key"]]
        assert collections.Counter(keys) == collections.Counter(f"train_{i:06d}" for i in range(24))
        assert all(b["image"].shape == (3, 3, 8, 8) for r in ranks for b in r[epoch])
        orders.append(keys)
    assert orders[0] != orders[1] != orders[2]  # a different order every epoch


def test_train_drops_less_than_one_global_batch_and_never_repeats(uneven):
    ranks = keys_per_rank(uneven, "train", world=2, workers=1, batch=5, train=True)
    keys = [k for r in ranks for b in r[0] for k in b["key"]]
    assert len(keys) == 20 and len(set(keys)) == 20  # floor(24 / 10) * 10


def test_eval_sees_every_key_exactly_once_with_padding(uneven):
    ranks = keys_per_rank(uneven, "val", world=2, workers=2, batch=2, train=False)
    assert len(ranks[0][0]) == len(ranks[1][0])  # equal batch counts: no rank waits on another
    valid_keys = [k for r in ranks for b in r[0] for k, v in zip(b["key"], b["valid"].tolist()) if v]
    assert sorted(valid_keys) == [f"val_{i:06d}" for i in range(7)]
    labels = {k: int(lbl) for r in ranks for b in r[0]
              for k, lbl, v in zip(b["key"], b["label"], b["valid"]) if v}
    assert all(labels[f"val_{i:06d}"] == i % 3 for i in range(7))


@pytest.mark.parametrize("workers, start", [(2, 5), (2, 12), (3, 4), (3, 13), (1, 7)])
def test_resume_continues_with_the_same_batches(uneven, workers, start):
    s, _ = load_split(uneven, "train")
    data = DataConfig(num_workers=workers, shuffle_buffer=4)

    def keys(start_batch: int, count: int) -> list[list[str]]:
        _, loader = build_loader(s, data, 8, 2, rank=0, world_size=1, train=True, seed=3, start_batch=start_batch)
        return [b["key"] for _, b in zip(range(count), loader)]

    full = keys(0, start + 10)  # runs past an epoch boundary (an epoch is 12 or 9 batches here)
    assert keys(start, 10) == full[start:]


def test_too_few_samples_is_a_clear_error(uneven):
    s, _ = load_split(uneven, "train")
    with pytest.raises(DataError, match="fewer than processes x workers x per-device batch"):
        build_loader(s, DataConfig(num_workers=2), 8, 8, rank=0, world_size=2, train=True)


def zeroed_in_place(root: Path) -> Path:
    """6 samples; the image of sample 2 zeroed in place (same size, so the tar stays valid)."""
    import tarfile

    shards = write_shard_set(root, {"train": [6]}, size=8)
    path = shards / "train-000000.tar"
    with tarfile.open(path) as tf:
        member = tf.getmember("train_000002.png")
    data = bytearray(path.read_bytes())
    data[member.offset_data:member.offset_data + member.size] = b"\0" * member.size
    path.write_bytes(bytes(data))
    return shards


@pytest.mark.parametrize("make, batch, max_bad_fraction, bad", [
    (zeroed_in_place, 3, 0.5, 1),  # 1 of 6: over the default limit
    (lambda root: bad_shard_set(root, good=180, bad=20), 4, 0.2, 20),  # not images at all, 10%, spread out
], ids=["zeroed_in_place", "undecodable_10_percent"])
def test_bad_samples_are_replaced_and_counted(tmp_path, make, batch, max_bad_fraction, bad):
    s, _ = load_split(make(tmp_path / "s"), "train")
    data = DataConfig(num_workers=0, shuffle_buffer=1, max_bad_fraction=max_bad_fraction)
    stream, loader = build_loader(s, data, 8, batch, rank=0, world_size=1, train=True)
    batches = [b for _, b in zip(range(stream.batches_per_epoch), loader)]  # one epoch
    assert [len(b["key"]) for b in batches] == [batch] * stream.batches_per_epoch  # batches stay full
    assert sum(b["bad"] for b in batches) == bad
