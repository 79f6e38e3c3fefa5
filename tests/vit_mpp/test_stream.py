"""The shard stream in one process (every rank's loader run here): each sample once per epoch of its set, full
micro-batches, a new order every epoch, evaluation padding, exact resume on the same layout, exactly-once resume on
another one, mixtures in their proportions, bad samples replaced."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.helpers.loaders import eval_loader, split_loader
from tests.helpers.shards import bad_shard_set, write_shard_set
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import load_split
from vit_mpp.data.stream import DataError, TrainSet, TrainStream, make_loader, read_settings
from vit_mpp.data.stream_plan import Generation, Layout, first_generation, next_generation

UNEVEN = {"train": [7, 1, 12, 4], "val": [5, 2]}  # 24 train samples in 4 uneven shards, 7 val


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return write_shard_set(tmp_path_factory.mktemp("uneven"), UNEVEN, size=8)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A second set for mixtures: 30 samples keyed `train_...` too (keys are told apart by their set)."""
    return write_shard_set(tmp_path_factory.mktemp("other"), {"train": [10, 10, 10]}, size=8, seed=1)


def train_sets(*locations: Path, weights: list[float] | None = None) -> list[TrainSet]:
    splits = [load_split(loc, "train")[0] for loc in locations]
    weights = weights or [float(s.num_samples) for s in splits]
    return [TrainSet(f"set{i}", s, w) for i, (s, w) in enumerate(zip(splits, weights))]


def run_steps(sets: list[TrainSet], gen: Generation, steps: int, resume_step: int | None = None,
              shuffle_buffer: int = 4) -> list[list[dict]]:
    """The micro-batches each rank of `gen`'s layout takes for `steps` optimizer steps from `resume_step` (default:
    the generation's start): list (per rank) of batches."""
    layout = gen.layout
    data = DataConfig(num_workers=layout.workers, shuffle_buffer=shuffle_buffer, persistent_workers=False)
    start = gen.start_step if resume_step is None else resume_step
    ranks = []
    for rank in range(layout.world):
        loader = make_loader(TrainStream(sets, ImageDecoder.for_training(data, 8), gen, rank=rank, resume_step=start,
                                         read=read_settings(data, 3)), data)
        it = iter(loader)
        ranks.append([next(it) for _ in range(steps * layout.accum)])
        del it
    return ranks


def per_epoch(ranks: list[list[dict]]) -> dict[tuple[int, int], collections.Counter]:
    """(set, epoch) -> how many times each key was read."""
    seen: dict[tuple[int, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for batches in ranks:
        for b in batches:
            for key, s, e in zip(b["key"], b["set"], b["epoch"]):
                seen[(s, e)][key] += 1
    return seen


def all_keys(n: int) -> collections.Counter:
    return collections.Counter(f"train_{i:06d}" for i in range(n))


def test_every_sample_once_per_epoch_full_batches_and_a_new_order_each_epoch(uneven):
    sets = train_sets(uneven)
    gen = first_generation(Layout(world=2, workers=2, micro=3, accum=1), [24], seed=3)
    ranks = run_steps(sets, gen, steps=12)  # 12 steps x 6 = 72 samples: 3 epochs
    assert all(len(b["key"]) == 3 and b["image"].shape == (3, 3, 8, 8) for r in ranks for b in r)
    seen = per_epoch(ranks)
    assert {e for _, e in seen} == {0, 1, 2}
    for epoch in range(3):
        assert seen[(0, epoch)] == all_keys(24), epoch
    orders = [[k for r in ranks for b in r for k, e in zip(b["key"], b["epoch"]) if e == epoch] for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2]


def test_nothing_is_dropped_when_the_global_batch_does_not_divide_the_set(uneven):
    # 24 samples, global batch 2 x 5: epochs straddle micro-batches, but each is whole.
    gen = first_generation(Layout(world=2, workers=1, micro=5, accum=1), [24], seed=3)
    seen = per_epoch(run_steps(train_sets(uneven), gen, steps=10))  # 100 samples: epochs 0-3 whole
    for epoch in range(4):
        assert seen[(0, epoch)] == all_keys(24)


def test_eval_sees_every_key_exactly_once_with_padding(uneven):
    s, _ = load_split(uneven, "val")
    ranks = []
    for rank in range(2):
        loader = eval_loader(s, DataConfig(num_workers=2), 8, 2, rank=rank, world_size=2)
        ranks.append(list(loader))
    assert len(ranks[0]) == len(ranks[1])  # equal batch counts: no rank waits on another
    valid = [(k, int(lbl)) for r in ranks for b in r for k, lbl, v in zip(b["key"], b["label"], b["valid"]) if v]
    assert sorted(valid) == [(f"val_{i:06d}", i % 3) for i in range(7)]


@pytest.mark.parametrize("workers, micro, accum, start", [(2, 2, 1, 5), (2, 2, 2, 6), (3, 2, 1, 4), (3, 1, 2, 7),
                                                         (1, 3, 1, 9)])
def test_a_resume_on_the_same_layout_continues_with_the_same_batches(uneven, workers, micro, accum, start):
    gen = first_generation(Layout(1, workers, micro, accum), [24], seed=3)
    sets = train_sets(uneven)
    full = [b["key"] for b in run_steps(sets, gen, steps=start + 8)[0]]  # past an epoch boundary
    resumed = [b["key"] for b in run_steps(sets, gen, steps=8, resume_step=start)[0]]
    assert resumed == full[start * accum:]


@pytest.mark.parametrize("old, new", [
    (Layout(2, 2, 3, 1), Layout(1, 2, 6, 1)),  # 2 processes -> 1: the same global batch
    (Layout(1, 2, 4, 1), Layout(2, 2, 2, 1)),  # 1 -> 2 processes
    (Layout(1, 2, 2, 2), Layout(1, 1, 4, 1)),  # 2 -> 1 workers, accumulation -> a bigger micro-batch
    (Layout(2, 1, 3, 1), Layout(1, 3, 2, 2)),  # and the global batch itself changes (6 -> 4)
])
def test_a_resume_on_another_layout_reads_every_remaining_sample_once(uneven, other, old, new):
    sets = train_sets(uneven, other)  # a mixture: each set keeps its own epochs
    gen = first_generation(old, [24, 30], seed=3)
    before = run_steps(sets, gen, steps=5)
    after = run_steps(sets, next_generation(gen, 5, new, [s.weight for s in sets]), steps=16)
    seen = per_epoch(before + after)
    for (s, e), keys in seen.items():
        assert max(keys.values()) == 1, (s, e)  # never twice in an epoch
    last = {s: max(e for ss, e in seen if ss == s) for s in (0, 1)}
    for s, n in ((0, 24), (1, 30)):
        for epoch in range(last[s]):  # every epoch before the last started one is whole
            assert seen[(s, epoch)] == all_keys(n), (s, epoch)


def test_a_mixture_draws_its_sets_in_the_weights_proportions(uneven, other):
    sets = train_sets(uneven, other, weights=[1.0, 3.0])
    gen = first_generation(Layout(1, 2, 8, 1), [24, 30], seed=3)
    batches = run_steps(sets, gen, steps=25)[0]
    counts = collections.Counter(s for b in batches for s in b["set"])
    assert counts[0] == pytest.approx(50, abs=2) and counts[1] == pytest.approx(150, abs=2)  # of 200
    for b in batches:  # every micro-batch holds both sets near their shares (a low-discrepancy sequence)
        assert 1 <= b["set"].count(0) <= 3


def test_fewer_samples_than_parts_is_a_clear_error(uneven):
    with pytest.raises(DataError, match="fewer than processes x workers"):
        TrainStream(train_sets(uneven), ImageDecoder.for_training(DataConfig(), 8),
                    first_generation(Layout(8, 4, 1, 1), [24], 0), rank=0, resume_step=0,
                    read=read_settings(DataConfig()))


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
    stream, loader = split_loader(s, data, 8, batch)
    batches = [b for _, b in zip(range(s.num_samples // batch), loader)]  # one epoch
    assert all(len(b["key"]) == batch for b in batches)  # batches stay full
    assert sum(b["bad"] for b in batches) == bad
    replaced = [k for b in batches for k in b["bad_keys"]]
    assert len(replaced) == bad and all(k.startswith("train_") for k in replaced)  # each named, for the audit
