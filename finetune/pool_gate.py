"""The pool's gate (`semi.gate`): the pool trains the student only while its teacher is measured mostly right. At each
evaluation the teacher labels the validation images by the pool's rule (finetune/scoring.py: `val_pseudo_acc`, the
share of the pseudo-labels it would keep that are right); the gate opens when that share reaches `semi.gate` and
closes when it falls under it. Closed, the run is plain fine-tuning with an EMA: the pool is still read and labelled
(its statistics keep moving), with weight 0. docs/finetune.md#semi-supervised-fine-tuning-semi.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vit_mpp.config.engine import ConfigError
from vit_mpp.data.lineage import SplitOf, shared_samples
from vit_mpp.data.training_data import TrainingData, shard_identity
from vit_mpp.data.urls import ReadPolicy


@dataclass
class PoolGate:
    """`gate.open`: whether the pool's loss counts now. `least` is `semi.gate` (0: always open, no evaluation read)."""

    least: float
    open: bool

    @classmethod
    def resumed(cls, least: float, state: dict[str, Any]) -> PoolGate:
        """The gate of a run at its start (closed until an evaluation opens it) or as its checkpoint left it."""
        if least <= 0:
            return cls(least, True)
        return cls(least, bool(state.get("pool_open", False)))

    @property
    def gates(self) -> bool:
        return self.least > 0

    def update(self, ema_result: dict[str, float], step: int, total: int) -> str | None:
        """After an evaluation of the teacher at `step` of `total`: open or close by its estimate; the line that says
        so when it changed. The metrics were reduced over the processes, so every process decides the same. At the
        last step the change still goes into the checkpoint (a run extended later starts from it), and its line says
        that no step of this run is left to it."""
        if not self.gates:
            return None
        kept, right = ema_result.get("val_pseudo_kept", 0.0), ema_result.get("val_pseudo_acc", 0.0)
        now = kept > 0 and right >= self.least
        if now == self.open:
            return None
        self.open = now
        measured = (f"the teacher would keep {kept:.0%} of the validation images with pseudo-labels {right:.0%} right"
                    if kept > 0 else "the teacher would keep none of the validation images")
        return (f"pool: {'on' if now else 'off'} after step {step}: {measured} "
                f"({'at least' if now else 'under'} semi.gate {self.least:g})"
                + ("; the run ends here" if step >= total else ""))

    def state(self) -> dict[str, bool]:
        """What a checkpoint keeps of it."""
        return {"pool_open": self.open} if self.gates else {}

    def late_warning(self, eval_every: int | None, total: int) -> str | None:
        """The warning for a gate whose first evaluation leaves the pool less than half the run, or None."""
        first = min(eval_every or total, total)
        if not self.gates or first <= total // 2:
            return None
        return (f"warning: semi.gate decides at evaluations, and the first is at step {first} of {total}: the pool can "
                f"train in the last {total - first} steps at most (a lower train.eval_every_epochs evaluates sooner)")

    def describe(self) -> str:
        return (f", on while the teacher's kept pseudo-labels of the validation images are at least "
                f"{self.least:.0%} right (off until an evaluation says so)" if self.gates else "")


def check_validation_apart(least: float, data: TrainingData, read: ReadPolicy = ReadPolicy()) -> None:
    """A gate (`least` > 0) must not judge the teacher on images the run trains on: its validation split may share
    no shard with a labelled training set (`data.val_split=train` of the labelled set itself, say), nor samples
    that the subset records tell are the same (a labelled subset drawn from the validation split, a validation
    subset drawn from the training set, two subsets of one source drawn without `--exclude`)."""
    if least <= 0 or data.val_split is None:
        return
    trained = {shard_identity(url) for s in data.sets if s.labelled for url in s.split.urls}
    shared = [url for url in data.val_split.urls if shard_identity(url) in trained]
    where = f"the validation split ('{data.val_split.name}' of {data.val_name})"
    advice = ("so the gate would judge the teacher on images it learned: give a validation set of its own "
              "(build-shards subset SOURCE VAL --per-class K --exclude LABELLED, then data.val_shards=VAL "
              "data.val_split=train)")
    if shared:
        raise ConfigError(f"config key 'semi.gate': {where} holds the shard {shared[0]} the run trains on, {advice}")
    val = SplitOf(data.val_location, data.val_split.name, data.val_set_manifest)
    for location, info, train_set in zip(data.locations, data.manifests, data.sets):
        if train_set.labelled and (n := shared_samples(SplitOf(location, train_set.split.name, info), val, read)):
            raise ConfigError(f"config key 'semi.gate': {where} holds {n} of the {train_set.split.num_samples} "
                              f"images the run trains on ({train_set.name}, drawn from the same source), {advice}")
