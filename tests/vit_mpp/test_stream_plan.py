"""vit_mpp/data/stream_plan.py on its own (no I/O): over random sets, weights, layouts and resume points, every sample
is read at most once per epoch, every epoch all parts have left behind is whole, a same-layout resume skips exactly
what was read, and the mixture's composition follows the weights."""

from __future__ import annotations

import collections
import random

import pytest

from vit_mpp.data.stream_plan import (
    Composition,
    Generation,
    Layout,
    emitted,
    first_generation,
    next_generation,
    part_pieces,
    resume_generation,
    share,
)


def positions(gen: Generation, set_index: int, part: int, size: int, skip: int = 0):
    """(epoch, position of the epoch's canonical order) that a part reads, in order."""
    for piece in part_pieces(gen.sets[set_index], gen.layout.parts, part, size, skip):
        start, _ = share(size, piece.parts, piece.block)
        for offset in range(piece.lo, piece.hi):
            yield piece.epoch, start + offset


def simulate(sizes, weights, layouts, steps):
    """Run each layout for its steps, changing layout in between as a resume does; return what was read, and the
    epoch each part of the last generation reads next."""
    gen = first_generation(layouts[0], sizes, seed=0)
    seen, step, streams = collections.Counter(), 0, {}
    for i, layout in enumerate(layouts):
        if i:
            gen = next_generation(gen, step, layout, weights)
        comp = Composition(weights, gen.seed, gen.index)
        streams = {(p, s): positions(gen, s, p, n) for p in range(layout.parts) for s, n in enumerate(sizes)}
        for _ in range(steps[i]):
            for rank in range(layout.world):
                for j in range(layout.accum):  # the rank's micro-batch j of this step
                    batch = (step - gen.start_step) * layout.accum + j
                    role, rnd = batch % layout.workers, batch // layout.workers
                    for s in comp.slots(rnd * layout.micro, layout.micro):
                        seen[(int(s), *next(streams[(rank * layout.workers + role, int(s))]))] += 1
            step += 1
    upcoming = collections.defaultdict(list)
    for (_, s), it in streams.items():
        upcoming[s].append(next(it)[0])
    return seen, upcoming


@pytest.mark.parametrize("trial", range(40))
def test_random_layout_changes_read_each_sample_once_per_epoch(trial):
    rng = random.Random(trial)
    sizes = [rng.randint(12, 60) for _ in range(rng.choice([1, 2, 3]))]
    weights = [rng.choice([0.2, 1.0, 2.5]) for _ in sizes]
    layouts = []
    for _ in range(rng.randint(2, 4)):
        world, workers = rng.randint(1, 3), rng.randint(1, 3)
        if min(sizes) < world * workers:
            world, workers = 1, 1
        layouts.append(Layout(world, workers, rng.randint(1, 4), rng.randint(1, 3)))
    seen, upcoming = simulate(sizes, weights, layouts, [rng.randint(1, 20) for _ in layouts])
    assert max(seen.values()) == 1  # never twice within an epoch of its set
    for s, n in enumerate(sizes):
        for epoch in range(min(upcoming[s])):  # every epoch that all parts have left is whole
            assert sum(1 for (ss, e, _) in seen if ss == s and e == epoch) == n, (s, epoch)


def test_a_same_layout_resume_skips_exactly_what_each_part_read():
    layout = Layout(world=2, workers=3, micro=4, accum=2)
    gen = first_generation(layout, [50, 17], seed=1)
    comp = Composition([1.0, 2.0], gen.seed, gen.index)
    batches = 7 * layout.accum  # 7 steps taken by each rank
    for role in range(layout.workers):
        done = emitted(gen, comp, batches, role)
        for s, n in enumerate((50, 17)):
            part = layout.workers + role  # rank 1
            whole = list(zip(range(done[s] + 30), positions(gen, s, part, n)))
            assert list(zip(range(30), positions(gen, s, part, n, skip=done[s]))) == \
                [(i, p) for i, (_, p) in enumerate(whole[done[s]:])]


def test_the_composition_follows_the_weights_in_every_stretch():
    comp = Composition([1.0, 1.0, 2.0], seed=0, generation=0)
    assert comp.counts(40_000) == pytest.approx([10_000, 10_000, 20_000], abs=3)
    window = comp.slots(123_456, 64).tolist()
    assert abs(window.count(2) - 32) <= 2  # low discrepancy: right within a single micro-batch, anywhere
    assert Composition([5.0], 0, 0).counts(10) == [10]


def test_resume_generation_says_what_changed():
    sizes, weights = [40], [40.0]
    old = first_generation(Layout(2, 2, 4, 1), sizes, seed=0)
    same, note = resume_generation(old.to_dict(), 3, Layout(2, 2, 4, 1), sizes, weights, seed=0)
    assert same == old and note is None
    new, note = resume_generation(old.to_dict(), 3, Layout(1, 2, 8, 1), sizes, weights, seed=0)
    assert note == "resuming 2 processes x 2 workers x micro-batch 4 as 1 process x 2 workers x micro-batch 8"
    assert new.start_step == 3 and new.index == 1 and new.sets[0].pending[0].size == 40 - 3 * 8
    _, note = resume_generation(old.to_dict(), 3, Layout(1, 2, 4, 1), sizes, weights, seed=0)
    assert "the global batch changes from 8 to 4: steps keep their numbers" in note
    changed, note = resume_generation(old.to_dict(), 3, Layout(2, 2, 4, 1), [41], weights, seed=0)
    assert note.startswith("note: the training data changed since the checkpoint")
    # the old run reached epoch 0 (24 of 40 samples): the new data's epochs are numbered after it, so the sample
    # audit's (epoch, key) records stay unique (they restarted at 0 and collided with the earlier ones)
    assert changed.sets[0].next_epoch >= 1
    _, note = resume_generation(None, 3, Layout(2, 2, 4, 1), sizes, weights, seed=0)
    assert "records no data-stream position" in note


def read_by_the_plan(gen: Generation, steps: int, weights: list[float]) -> list[tuple[int, int, int, int]]:
    """(set, epoch, parts that cut it, position of its order S) of every sample the parts of `gen` read in `steps`
    optimizer steps from its start: each part's first pieces (`part_pieces`), as many as it emitted (`emitted`)."""
    composition = Composition(weights, gen.seed, gen.index)
    layout, read = gen.layout, []
    for role in range(layout.workers):
        counts = emitted(gen, composition, steps * layout.accum, role)
        for rank in range(layout.world):
            for i, size in enumerate(gen.sizes):
                left = counts[i]
                for piece in part_pieces(gen.sets[i], layout.parts, rank * layout.workers + role, size):
                    if left <= 0:
                        break
                    take = min(left, piece.hi - piece.lo)
                    start = share(size, piece.parts, piece.block)[0]
                    read += [(i, piece.epoch, piece.parts, start + e) for e in range(piece.lo, piece.lo + take)]
                    left -= take
    return read


def random_layouts(rng: random.Random, global_batch: int, count: int) -> list[Layout]:
    layouts = []
    while len(layouts) < count:
        world, workers = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3])
        if global_batch % world:
            continue
        per_rank = global_batch // world
        accum = rng.choice([a for a in (1, 2, 3) if per_rank % a == 0])
        layouts.append(Layout(world, workers, per_rank // accum, accum))
    return layouts


@pytest.mark.parametrize("seed", range(6))
def test_every_sample_once_per_epoch_whatever_the_layouts_and_the_steps_they_change_at(seed):
    # A property over the stop steps and the layouts (2 processes x 2 workers preempted at step 15 and resumed on 1
    # process re-read 10 samples of epoch 0 and left 10 out, in some runs): what every generation's parts read,
    # and what the run would read next, cover each position of each epoch exactly once, all cut alike.
    rng = random.Random(seed)
    for _ in range(60):
        sizes = [rng.randint(20, 160) for _ in range(rng.choice([1, 1, 2]))]
        weights = [float(n) for n in sizes] if rng.random() < 0.5 else [rng.uniform(0.2, 1.0) for _ in sizes]
        layouts = random_layouts(rng, rng.choice([4, 6, 8, 12, 20]), rng.randint(2, 4))
        if min(sizes) < max(layout.parts for layout in layouts):
            continue
        stops = sorted(rng.sample(range(1, 100), len(layouts) - 1)) + [rng.randint(101, 160)]
        gen, step, read = first_generation(layouts[0], sizes, rng.randrange(1000)), 0, []
        for k, stop in enumerate(stops):
            read += read_by_the_plan(gen, stop - step, weights)
            step = stop
            gen = next_generation(gen, step, layouts[k + 1] if k + 1 < len(layouts) else gen.layout, weights)
        read += [(i, p.epoch, p.parts, x) for i, s in enumerate(gen.sets) for p in s.pending
                 for a, b in p.intervals for x in range(a, b)]  # what the run would read next
        times = collections.Counter((i, e, x) for i, e, _, x in read)
        cuts = collections.defaultdict(set)
        for i, e, parts, _ in read:
            cuts[(i, e)].add(parts)
        assert max(times.values()) == 1, (sizes, layouts, stops)
        assert all(len(c) == 1 for c in cuts.values()), (sizes, layouts, stops)
        for i, size in enumerate(sizes):
            for e in range(gen.sets[i].next_epoch):
                assert sum(1 for (j, ep, _) in times if j == i and ep == e) == size, (sizes, layouts, stops, i, e)
