"""Every epoch whole in the real stream across a layout change, whatever the step it changes at: the product's
training stream (`TrainStream` and its loader with real worker processes, made as `Run.train_loader` makes them),
stopped after each step of the first one and a half epochs, resumed on another layout from the generation a
checkpoint records (`resume_generation`, as `Run.resume` does), its steps written by the sample audit as the loop
writes them, and the audit read back: every sample once in every epoch, for at least two epochs after the resume.
The plan alone is checked over many more histories in tests/vit_mpp/test_stream_plan.py; this reads the data."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.helpers.runs import epochs_in_audit
from tests.helpers.shards import write_shard_set
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.image_decoder import ImageDecoder
from vit_mpp.data.manifest import load_split
from vit_mpp.data.stream import TrainSet, TrainStream, make_loader, read_settings
from vit_mpp.data.stream_plan import Layout, first_generation, resume_generation
from vit_mpp.run.metering.sample_audit import SampleAudit

SHARDS = [7, 1, 12, 4, 9, 15]  # 48 samples in shards of unequal sizes
SIZE = sum(SHARDS)
SEED = 3
PAIRS = {  # old layout -> new layout (processes x workers x micro-batch x accumulation), a global batch of 8
    "2x2 -> 1x2": (Layout(2, 2, 4, 1), Layout(1, 2, 8, 1)),
    "2x2 -> 1x1": (Layout(2, 2, 4, 1), Layout(1, 1, 8, 1)),
    "1x2 -> 2x2": (Layout(1, 2, 8, 1), Layout(2, 2, 4, 1)),
    "1x2 x accumulation 2 -> 2x1": (Layout(1, 2, 4, 2), Layout(2, 1, 4, 1)),
    "2x2 -> 1x2, the global batch halved": (Layout(2, 2, 4, 1), Layout(1, 2, 4, 1)),
}
STOPS = range(1, SIZE * 3 // 2 // 8 + 1)  # every step of the first one and a half epochs


@pytest.fixture(scope="module")
def train_set(tmp_path_factory) -> TrainSet:
    shards = write_shard_set(tmp_path_factory.mktemp("uneven"), {"train": SHARDS}, size=8)
    return TrainSet("train", load_split(shards, "train")[0], 1.0)


def run(train_set: TrainSet, generation, steps: int, start: int, audit_dir: Path) -> None:
    """`steps` optimizer steps of every rank of `generation`'s layout from step `start`, each rank's micro-batches
    taken from its own loader and written to the sample audit, one line per step, as the loop does."""
    layout = generation.layout
    data = DataConfig(num_workers=layout.workers, shuffle_buffer=4, persistent_workers=True)
    for rank in range(layout.world):
        stream = TrainStream([train_set], ImageDecoder.for_training(data, 8), generation, rank=rank,
                             resume_step=start, read=read_settings(data, SEED))
        batches = iter(make_loader(stream, data))
        audit = SampleAudit(audit_dir, rank, rank == 0, ["train"], True)
        for step in range(start + 1, start + steps + 1):
            audit.write(step, [next(batches) for _ in range(layout.accum)])
        audit.flush()
        del batches


def check(train_set: TrainSet, tmp_path: Path, old: Layout, new: Layout, stop: int) -> None:
    first = first_generation(old, [SIZE], SEED)
    run(train_set, first, stop, 0, tmp_path)
    resumed, note = resume_generation(first.to_dict(), stop, new, [SIZE], [1.0], SEED)
    assert note and note.startswith(f"resuming {old.describe()} as {new.describe()}")
    after = -(-3 * SIZE // new.global_batch)  # steps after the stop: at least two whole epochs after it
    run(train_set, resumed, after, stop, tmp_path)
    seen = epochs_in_audit(tmp_path)
    last_whole = (stop * old.global_batch + after * new.global_batch) // SIZE  # epochs the steps read whole
    assert last_whole >= stop * old.global_batch // SIZE + 2
    every = collections.Counter(f"train_{i:06d}" for i in range(SIZE))
    for epoch in range(last_whole):
        assert seen[epoch] == every, (epoch, seen[epoch] - every, every - seen[epoch])
    assert all(n == 1 for counter in seen.values() for n in counter.values())  # the last, partial ones too


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("stop", STOPS)
def test_every_epoch_is_whole_in_the_stream_after_a_layout_change_at_any_step(train_set, tmp_path, pair, stop):
    check(train_set, tmp_path, *PAIRS[pair], stop)
