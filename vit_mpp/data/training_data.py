"""The data a training run reads: one shard set or a weighted mixture of several (`data.shards`, `data.weights`),
and the one set evaluation reads (`data.val_shards`, default the first training set that has the split
`data.val_split`). Only manifests are read here.

A mixture's epoch is one pass over the set that runs out first at the given proportions (with the default weights,
proportional to the sets' sizes, every set runs out together); each set keeps its own epochs
(vit_mpp/data/stream_plan.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vit_mpp.config.engine import ConfigError
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.manifest import ManifestError, Split, data_record, load_split, manifest_file
from vit_mpp.data.stream import TrainSet
from vit_mpp.data.stream_plan import samples_per_epoch
from vit_mpp.data.urls import is_local, local_path


@dataclass
class TrainingData:
    """The training sets (with their manifests) and the evaluation split."""

    sets: list[TrainSet]
    locations: list[str]
    manifests: list[dict[str, Any]]
    val_location: str
    val_split: Split | None
    val_manifest: dict[str, Any] | None = None

    @property
    def sizes(self) -> list[int]:
        return [s.split.num_samples for s in self.sets]

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.sets]

    @property
    def mixture(self) -> bool:
        return len(self.sets) > 1

    def samples_per_epoch(self) -> int:
        """Samples in one epoch: the whole set, or for a mixture one pass over the set that runs out first."""
        return samples_per_epoch(self.sizes, self.weights)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sets]

    @property
    def val_name(self) -> str:
        """The name of the set evaluation reads: a training set's, or its own."""
        if self.val_location in self.locations:
            return self.names[self.locations.index(self.val_location)]
        return set_name(self.val_location, self.val_manifest or {})

    def record(self, shares: dict[str, float] | None = None, knn: tuple[Split, int] | None = None) -> dict[str, Any]:
        """What an export records of its training data: the first set's manifest record; for a mixture every set
        with its weight, its realised share (`shares`, as the run measured them) and its training images; the set
        and split evaluation read (`val`) and the k-NN monitor's references (`knn`: split and images), when there
        were any."""
        shares = shares or {}
        first = data_record(self.locations[0], self.manifests[0])
        if self.mixture:
            total = sum(self.weights)
            first["mixture"] = [{**data_record(loc, man), "name": s.name, "weight": s.weight / total,
                                 "images": s.split.num_samples,
                                 **({"share": shares[s.name]} if s.name in shares else {})}
                                for loc, man, s in zip(self.locations, self.manifests, self.sets)]
        if self.val_split is not None:
            first["val"] = {"set": self.val_name, "shards": self.val_location, "split": self.val_split.name,
                            "images": self.val_split.num_samples}
        if knn is not None and knn[1]:
            knn_split, knn_images = knn
            first["knn"] = {"set": self.val_name, "shards": self.val_location, "split": knn_split.name,
                            "images": min(knn_images, knn_split.num_samples)}
        return first

    def describe(self) -> str:
        """`data 1000 train images in 4 shards`, or the mixture set by set, for the start-up summary; with the set
        and split evaluation reads when it is not the only set's."""
        evaluation = ""
        if self.val_split is not None and (self.mixture or self.val_location != self.locations[0]):
            evaluation = (f" (evaluation: split '{self.val_split.name}' of {self.val_name}, "
                          f"{self.val_split.num_samples} images)")
        if not self.mixture:
            s = self.sets[0].split
            return f"data {s.num_samples} train images in {len(s.urls)} shards{evaluation}"
        total = sum(self.weights)
        parts = ", ".join(f"{s.name} {s.split.num_samples} images ({s.weight / total:.0%})" for s in self.sets)
        return (f"data mixture of {len(self.sets)} sets{evaluation}: {parts}; an epoch is {self.samples_per_epoch()} "
                "images")


def set_name(location: str, manifest: dict[str, Any]) -> str:
    """A set's name: its manifest's `name`, else the last part of its location."""
    name = manifest.get("name")
    if isinstance(name, str) and name.strip():
        return name.strip()
    return os.path.basename(location.rstrip("/").removesuffix("/_info.json")) or location


def _check_disjoint(locations: list[str], splits: list[Split]) -> None:
    """No shard in two sets of a mixture: the same set named two ways (`sh`, `./sh/`, `sh/_info.json`) would be read
    twice as often as its weight says, and its samples counted twice."""
    seen: dict[str, str] = {}
    for location, split in zip(locations, splits):
        for url in split.urls:
            key = os.path.abspath(local_path(url)) if is_local(url) else url
            if seen.setdefault(key, location) != location:
                raise ConfigError(f"config key 'data.shards': {seen[key]} and {location} hold the same shard {url}: "
                                  "name each set once")


def load_training_data(data: DataConfig, evaluate: bool = True) -> TrainingData:
    """Read the manifests of the training sets and of the evaluation set (ManifestError with one line when one is
    missing or unusable)."""
    locations = data.shard_sets()
    loaded = [load_split(location, data.train_split) for location in locations]
    _check_disjoint(locations, [split for split, _ in loaded])
    sizes = [split.num_samples for split, _ in loaded]
    weights = [float(w) for w in data.weights] if data.weights is not None else [float(n) for n in sizes]
    names: list[str] = []
    for location, (_, manifest) in zip(locations, loaded):
        name = set_name(location, manifest)
        names.append(name if name not in names else f"{name}#{len(names)}")  # unique, for logs and the audit
    sets = [TrainSet(name, split, weight) for name, (split, _), weight in zip(names, loaded, weights)]
    manifests = [manifest for _, manifest in loaded]
    if not (evaluate and data.val_split):
        return TrainingData(sets, locations, manifests, data.val_shards or locations[0], None)
    return TrainingData(sets, locations, manifests, *evaluation_set(data, locations, manifests))


FIX_VAL = ("evaluate on another set with data.val_shards=LOCATION or on another split with data.val_split=NAME, or "
           "train without evaluation with data.val_split=''")


def evaluation_set(data: DataConfig, locations: list[str], manifests: list[dict[str, Any]],
                   ) -> tuple[str, Split, dict[str, Any]]:
    """(location, split, manifest) of what evaluation reads: `data.val_split` of `data.val_shards`, else of the
    first training set whose manifest has it; a ManifestError that says how to choose (data.val_shards=,
    data.val_split=) when there is none."""
    if data.val_shards:
        try:
            return (data.val_shards, *load_split(data.val_shards, data.val_split))
        except ManifestError as e:
            if f"split '{data.val_split}' not in" not in str(e):
                raise
            raise ManifestError(f"data.val_shards: {e}: {FIX_VAL}") from None
    for location, manifest in zip(locations, manifests):
        if data.val_split in (manifest.get("splits") or {}):
            return (location, *load_split(location, data.val_split))
    has = "; ".join(f"{manifest_file(loc)} has: {', '.join(man.get('splits') or {}) or 'no split'}"
                    for loc, man in zip(locations, manifests))
    where = "the manifest of data.shards" if len(locations) == 1 else "any set of data.shards"
    raise ManifestError(f"no split '{data.val_split}' in {where} ({has}): {FIX_VAL}")
