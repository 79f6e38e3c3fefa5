"""Which samples each data-loader worker of each rank reads, and in which order: a pure function of the seed, the
sizes of the shard sets and the run's layout history (no I/O, no torch), so any rank computes it alone and a resume
continues exactly, also on another layout. `resume_generation` (`first_generation`, `next_generation`) makes the
`Generation`, `Composition` fills each micro-batch from the sets, `part_pieces` is what a part reads.
See docs/data_stream.md#how-the-work-is-split-vit_mppdatastream_planpy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Interval = tuple[int, int]  # [start, stop) of positions in an epoch's canonical order S


@dataclass(frozen=True)
class Layout:
    """How the work of one optimizer step is split: processes x workers x micro-batch x accumulation steps."""

    world: int
    workers: int
    micro: int
    accum: int

    @property
    def parts(self) -> int:
        return self.world * self.workers

    @property
    def global_batch(self) -> int:
        return self.world * self.micro * self.accum

    def describe(self) -> str:
        return (f"{self.world} process{'es' if self.world != 1 else ''} x {self.workers} worker"
                f"{'s' if self.workers != 1 else ''} x micro-batch {self.micro}"
                f"{f' x {self.accum} accumulation steps' if self.accum > 1 else ''}")


@dataclass
class Pending:
    """What is left of a started epoch: intervals of its canonical order S, which `parts` blocks defined."""

    epoch: int
    parts: int
    intervals: list[Interval]

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.intervals)


@dataclass
class SetState:
    """Where one set stands at the start of a generation."""

    pending: list[Pending] = field(default_factory=list)
    next_epoch: int = 0


@dataclass
class Generation:
    """A stretch of the run with one layout (see the module doc); saved in every checkpoint."""

    start_step: int
    layout: Layout
    sets: list[SetState]
    sizes: list[int]  # samples per set, to notice a set that changed since
    seed: int
    index: int = 0  # the how-many-th generation: seeds the set composition

    def to_dict(self) -> dict[str, Any]:
        return {"start_step": self.start_step, "index": self.index, "seed": self.seed, "sizes": list(self.sizes),
                "layout": vars(self.layout).copy(),
                "sets": [{"next_epoch": s.next_epoch,
                          "pending": [{"epoch": p.epoch, "parts": p.parts, "intervals": [list(i) for i in p.intervals]}
                                      for p in s.pending]} for s in self.sets]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Generation:
        sets = [SetState([Pending(p["epoch"], p["parts"], [tuple(i) for i in p["intervals"]]) for p in s["pending"]],
                         s["next_epoch"]) for s in data["sets"]]
        return cls(data["start_step"], Layout(**data["layout"]), sets, list(data["sizes"]), data["seed"],
                   data.get("index", 0))


def first_generation(layout: Layout, sizes: list[int], seed: int) -> Generation:
    """The generation a new run starts with: every set at its epoch 0."""
    return Generation(0, layout, [SetState() for _ in sizes], list(sizes), seed)


def share(total: int, parts: int, p: int) -> tuple[int, int]:
    """[start, stop) of part `p` when `total` items are cut into `parts` near-equal contiguous shares (the first
    total % parts shares hold one more)."""
    base, extra = divmod(total, parts)
    start = p * base + min(p, extra)
    return start, start + base + (p < extra)


def epoch_order(num_shards: int, seed: int, set_index: int, epoch: int) -> list[int]:
    """The shard order of an epoch of a set: the same on every rank, different from epoch to epoch."""
    order = list(range(num_shards))
    random.Random(f"{seed}-{set_index}-{epoch}").shuffle(order)
    return order


def block_rng(seed: int, set_index: int, epoch: int, parts: int, block: int) -> random.Random:
    """The shuffle-buffer generator of one block of one epoch (its emissions are positions of S)."""
    return random.Random(f"{seed}-{set_index}-{epoch}-{parts}-{block}")


@dataclass(frozen=True)
class Piece:
    """Emissions [lo, hi) of block `block` of epoch `epoch` of a set, whose blocks were cut by `parts` parts."""

    epoch: int
    parts: int
    block: int
    lo: int
    hi: int


def pieces_of(epoch: int, parts: int, size: int, interval: Interval) -> Iterator[Piece]:
    """The block pieces that make up positions `interval` of S (an epoch of `size` samples cut into `parts`)."""
    a, b = interval
    while a < b:
        base, extra = divmod(size, parts)
        # the block holding position a: the first `extra` blocks have base + 1 positions
        p = a // (base + 1) if a < extra * (base + 1) else extra + (a - extra * (base + 1)) // max(base, 1)
        start, stop = share(size, parts, p)
        end = min(b, stop)
        yield Piece(epoch, parts, p, a - start, end - start)
        a = end


def slice_of(intervals: list[Interval], lo: int, hi: int) -> list[Interval]:
    """Items [lo, hi) of the concatenation of `intervals`, as intervals."""
    out, offset = [], 0
    for a, b in intervals:
        n = b - a
        if offset + n > lo and offset < hi:
            out.append((a + max(0, lo - offset), a + min(n, hi - offset)))
        offset += n
        if offset >= hi:
            break
    return out


def part_intervals(state: SetState, parts: int, part: int, size: int) -> Iterator[tuple[int, int, Interval]]:
    """(epoch, parts that cut its blocks, interval of its S) in the order part `part` of a generation with `parts`
    parts reads them: its share of each pending epoch, then its block of every later epoch. Endless."""
    for pend in state.pending:
        lo, hi = share(pend.size, parts, part)
        for interval in slice_of(pend.intervals, lo, hi):
            yield pend.epoch, pend.parts, interval
    epoch = state.next_epoch
    while True:
        yield epoch, parts, share(size, parts, part)
        epoch += 1


def part_pieces(state: SetState, parts: int, part: int, size: int, skip: int = 0) -> Iterator[Piece]:
    """The pieces part `part` reads, after the first `skip` samples (a resume within the generation). Endless."""
    for epoch, cut, interval in part_intervals(state, parts, part, size):
        for piece in pieces_of(epoch, cut, size, interval):
            n = piece.hi - piece.lo
            if skip >= n:
                skip -= n
                continue
            yield Piece(piece.epoch, piece.parts, piece.block, piece.lo + skip, piece.hi)
            skip = 0


# ---------------------------------------------------------------- the mixture: which slot comes from which set

_WEYL = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd: the additive low-discrepancy (Weyl) sequence of 64-bit ints
_MASK = (1 << 64) - 1


class Composition:
    """Which set each slot of a round's micro-batch comes from, in proportion to the weights.

    Slot t of a part (t = round * micro + position in the micro-batch) comes from set i when the t-th term of a
    64-bit Weyl sequence, started at an offset drawn from (seed, generation), falls in the i-th share of the range.
    Deterministic, the same on every worker, computable for any t without the earlier ones, and low-discrepancy:
    after t slots each set has received its weight times t, within a few slots.
    """

    def __init__(self, weights: list[float], seed: int, generation: int) -> None:
        total = float(sum(weights))
        cumulative = np.cumsum(np.asarray(weights, dtype=np.float64) / total)[:-1]
        self.thresholds = np.array([min(int(c * 2.0**64), _MASK) for c in cumulative], dtype=np.uint64)
        self.single = len(weights) == 1
        self.offset = random.Random(f"mix-{seed}-{generation}").getrandbits(64)
        self.num_sets = len(weights)

    def slots(self, start: int, count: int) -> np.ndarray:
        """The set of slots start .. start + count - 1, as an int array."""
        if self.single:
            return np.zeros(count, dtype=np.int64)
        t = np.arange(start, start + count, dtype=np.uint64)
        with np.errstate(over="ignore"):  # the sequence lives modulo 2^64
            u = t * np.uint64(_WEYL) + np.uint64(self.offset)
        return np.searchsorted(self.thresholds, u, side="right").astype(np.int64)

    def counts(self, slots: int, chunk: int = 1 << 20) -> list[int]:
        """Samples each set received in the first `slots` slots."""
        totals = np.zeros(self.num_sets, dtype=np.int64)
        for start in range(0, slots, chunk):
            totals += np.bincount(self.slots(start, min(chunk, slots - start)), minlength=self.num_sets)
        return totals.tolist()


def batches_of_role(batches: int, workers: int, role: int) -> int:
    """Micro-batches worker `role` made when its rank has taken `batches` (the DataLoader takes them round-robin)."""
    return max(0, -(-(batches - role) // workers))


def emitted(gen: Generation, composition: Composition, batches: int, role: int) -> list[int]:
    """Samples of each set that a part with worker index `role` emitted after its rank took `batches` micro-batches
    in generation `gen` (the same for every rank)."""
    rounds = batches_of_role(batches, gen.layout.workers, role)
    return composition.counts(rounds * gen.layout.micro)


# ---------------------------------------------------------------- a new layout: what is left, shared out anew

def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def left_of_set(state: SetState, parts: int, size: int, consumed: list[int]) -> SetState:
    """What is left of set `state` once its `parts` parts have emitted `consumed[p]` samples each."""
    # The last epoch any part has started: it, and every epoch before it, is pending for all parts.
    last = state.next_epoch - 1
    for p in range(parts):
        todo = consumed[p]
        for epoch, _, (a, b) in part_intervals(state, parts, p, size):
            if todo <= 0:
                break
            todo -= min(todo, b - a)
            last = max(last, epoch)
    left: dict[tuple[int, int], list[Interval]] = {}  # (epoch, parts that cut it) -> intervals not yet read
    for p in range(parts):
        todo = consumed[p]
        for epoch, cut, (a, b) in part_intervals(state, parts, p, size):
            if epoch > last:
                break
            taken = min(todo, b - a)
            todo -= taken
            left.setdefault((epoch, cut), []).append((a + taken, b))
    pending = [Pending(epoch, cut, _merge(intervals)) for (epoch, cut), intervals in sorted(left.items())]
    return SetState([p for p in pending if p.size], last + 1)


def next_generation(gen: Generation, step: int, layout: Layout, weights: list[float]) -> Generation:
    """The generation that takes over at optimizer step `step` (reached under `gen`) with another layout."""
    composition = Composition(weights, gen.seed, gen.index)
    batches = (step - gen.start_step) * gen.layout.accum
    old = gen.layout
    per_role = [emitted(gen, composition, batches, role) for role in range(old.workers)]
    sets = []
    for i, (state, size) in enumerate(zip(gen.sets, gen.sizes)):
        consumed = [per_role[p % old.workers][i] for p in range(old.parts)]  # part p = rank * workers + role
        sets.append(left_of_set(state, old.parts, size, consumed))
    return Generation(step, layout, sets, list(gen.sizes), gen.seed, gen.index + 1)


def samples_per_epoch(sizes: list[int], weights: list[float]) -> int:
    """Samples in one epoch of the mixture: a pass over the set that runs out first at these proportions (for one
    set, its size)."""
    total = float(sum(weights))
    return min(int(n * total / w) for n, w in zip(sizes, weights) if w > 0)


def epochs_after(gen: Generation, step: int) -> int:
    """An epoch number above every epoch any set of `gen` can have started by optimizer step `step` (what a part
    reads in the steps since the generation began, over its smallest block), to number epochs on from."""
    rounds = -(-(step - gen.start_step) * gen.layout.accum // gen.layout.workers)
    block = max(1, min(gen.sizes) // gen.layout.parts)
    return max((s.next_epoch + len(s.pending) for s in gen.sets), default=0) + -(-rounds * gen.layout.micro // block)


def resume_generation(saved: dict[str, Any] | None, step: int, layout: Layout, sizes: list[int],
                      weights: list[float], seed: int) -> tuple[Generation, str | None]:
    """The generation a run continues with at optimizer step `step`, and a line saying what changed (None when it
    continues as it was). `saved` is the generation a checkpoint recorded (None for a new run)."""
    if saved is None:
        if step == 0:
            return first_generation(layout, sizes, seed), None
        return Generation(step, layout, [SetState() for _ in sizes], list(sizes), seed, 1), (
            "note: the checkpoint records no data-stream position (an earlier version wrote it): the data stream "
            "starts a new epoch")
    gen = Generation.from_dict(saved)
    if gen.sizes != list(sizes) or gen.seed != seed:
        # epochs go on being numbered after any a set may have started: the sample audit's records stay unique
        return Generation(step, layout, [SetState(next_epoch=epochs_after(gen, step)) for _ in sizes], list(sizes),
                          seed, gen.index + 1), (
            "note: the training data changed since the checkpoint (its sets, their sizes or train.seed): the data "
            "stream starts a new epoch of every set")
    if gen.layout == layout:
        return gen, None
    note = f"resuming {gen.layout.describe()} as {layout.describe()}"
    if gen.layout.global_batch != layout.global_batch:
        note += (f"; the global batch changes from {gen.layout.global_batch} to {layout.global_batch}: steps keep "
                 f"their numbers (step {step + 1} is the first of {layout.global_batch} images) and the learning "
                 "rate stays the same function of the step")
    return next_generation(gen, step, layout, weights), note
