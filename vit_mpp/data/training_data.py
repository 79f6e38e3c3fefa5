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

    def labelled(self) -> list[tuple[str, dict[str, Any]]]:
        """(location, manifest) of each labelled training set (all but a semi-supervised run's pool)."""
        return [(loc, man) for loc, man, s in zip(self.locations, self.manifests, self.sets) if s.labelled]

    @property
    def val_name(self) -> str:
        """The name of the set evaluation reads: a training set's, or its own."""
        if self.val_location in self.locations:
            return self.names[self.locations.index(self.val_location)]
        return set_name(self.val_location, self.val_manifest or {})

    @property
    def val_set_manifest(self) -> dict[str, Any]:
        """The manifest of the set evaluation reads: a training set's (`val_manifest` is then None), or its own."""
        if self.val_location in self.locations:
            return self.manifests[self.locations.index(self.val_location)]
        return self.val_manifest or {}

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
                                 "images": s.split.num_samples, **({} if s.labelled else {"pool": True}),
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
        parts = ", ".join(f"{s.name} {s.split.num_samples} images ({s.weight / total:.0%}"
                          f"{'' if s.labelled else ', labels unused'})" for s in self.sets)
        return (f"data mixture of {len(self.sets)} sets{evaluation}: {parts}; an epoch is {self.samples_per_epoch()} "
                "images")


def set_name(location: str, manifest: dict[str, Any]) -> str:
    """A set's name: its manifest's `name`, else the last part of its location."""
    name = manifest.get("name")
    if isinstance(name, str) and name.strip():
        return name.strip()
    return os.path.basename(location.rstrip("/").removesuffix("/_info.json")) or location


def shard_identity(url: str) -> str:
    """A shard's place however it is named (`sh/a.tar`, `./sh/a.tar`): what tells two sets share it."""
    return os.path.abspath(local_path(url)) if is_local(url) else url


def _check_disjoint(locations: list[str], splits: list[Split], labelled: int) -> None:
    """No shard in two sets of a mixture: the same set named two ways (`sh`, `./sh/`, `sh/_info.json`) would be read
    twice as often as its weight says, and its samples counted twice. The sets from `labelled` on are a pool's: none
    of their shards may be a labelled set's, however named."""
    seen: dict[str, tuple[int, str]] = {}
    for i, (location, split) in enumerate(zip(locations, splits)):
        for url in split.urls:
            key = shard_identity(url)
            first, where = seen.setdefault(key, (i, location))
            if first < labelled <= i:
                raise ConfigError(f"config key 'semi.pool': {location} holds the shard {url} of data.shards' {where}: "
                                  "the pool is read beside the labelled sets, so give it shards of its own (a copy "
                                  "of labelled images among them is fine)")
            if where != location:
                raise ConfigError(f"config key 'data.shards': {where} and {location} hold the same shard {url}: "
                                  "name each set once")


@dataclass(frozen=True)
class Pool:
    """The unlabelled pool of semi-supervised fine-tuning (finetune `semi.*`): its shard sets, their split, and how
    many of its images a batch holds per labelled image, on average."""

    locations: list[str]
    split: str
    ratio: float


def load_training_data(data: DataConfig, evaluate: bool = True, pool: Pool | None = None) -> TrainingData:
    """Read the manifests of the training sets, of the pool's sets when there is a pool, and of the evaluation set
    (ManifestError with one line when one is missing or unusable). The pool joins the mixture as sets not labelled,
    named `pool:NAME`: the labelled sets share weight 1 (by data.weights or size), the pool's `pool.ratio` (by
    size)."""
    locations = data.shard_sets()
    loaded = [load_split(location, data.train_split) for location in locations]
    sizes = [split.num_samples for split, _ in loaded]
    weights = [float(w) for w in data.weights] if data.weights is not None else [float(n) for n in sizes]
    labelled = len(locations)
    if pool is not None and pool.locations:
        pool_loaded = [load_split(location, pool.split) for location in pool.locations]
        pool_sizes = [split.num_samples for split, _ in pool_loaded]
        weights = [w / sum(weights) for w in weights] + [pool.ratio * n / sum(pool_sizes) for n in pool_sizes]
        locations, loaded = [*locations, *pool.locations], [*loaded, *pool_loaded]
    _check_disjoint(locations, [split for split, _ in loaded], labelled)
    names: list[str] = []
    for i, (location, (_, manifest)) in enumerate(zip(locations, loaded)):
        name = set_name(location, manifest) if i < labelled else f"pool:{set_name(location, manifest)}"
        names.append(name if name not in names else f"{name}#{len(names)}")  # unique, for logs and the audit
    sets = [TrainSet(name, split, weight, labelled=i < labelled)
            for i, (name, (split, _), weight) in enumerate(zip(names, loaded, weights))]
    manifests = [manifest for _, manifest in loaded]
    if not (evaluate and data.val_split):
        return TrainingData(sets, locations, manifests, data.val_shards or locations[0], None)
    return TrainingData(sets, locations, manifests,
                        *evaluation_set(data, locations[:labelled], manifests[:labelled]))


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
