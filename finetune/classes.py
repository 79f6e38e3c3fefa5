"""The classes a classifier learns (`classes_of`): `num_classes`, or what the training sets' manifests count, checked
against every set the run reads before the run directory is touched."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config import FinetuneConfig
from finetune.init_model import check_kept_head
from vit_mpp.config.engine import ConfigError
from vit_mpp.data.manifest import check_every_sample_labelled, manifest_classes
from vit_mpp.data.training_data import TrainingData


@dataclass(frozen=True)
class Classes:
    """How many classes the classifier has, and their names when the manifests give them."""

    count: int
    names: list[str] | None


def classes_of(cfg: FinetuneConfig, data: TrainingData) -> Classes:
    """The classes: `num_classes`, or the most the training sets' manifests count; every set of
    a mixture must name the same classes (labels are class indices), and no set read (training, evaluation) may have
    more classes, be unlabelled or count samples without a usable label; a semi-supervised run's pool is not checked
    (its labels are never trained on). Run by `start_run` before the run directory is touched."""
    labelled = data.labelled()
    names = [m.get("class_names") or None for _, m in labelled]
    if any(n != names[0] for n in names[1:]):
        raise ConfigError("the sets of data.shards name different classes: a classifier's labels must mean the same "
                          "class in every set")
    # the training sets' classes: with indexed sets (no class names) a mixture's sets may count different numbers
    num_classes = cfg.num_classes or max(manifest_classes(m) for _, m in labelled)
    if not num_classes:
        raise ConfigError("num_classes is not set and the manifest names no classes: the shards carry no labels, "
                          "which pretraining accepts but a classifier cannot learn from")
    checked = [(location, manifest, cfg.data.train_split) for location, manifest in labelled]
    if data.val_manifest is not None:
        checked.append((data.val_location, data.val_manifest, cfg.data.val_split))
    for location, manifest, split in checked:
        check_every_sample_labelled(location, manifest, split)
        has = manifest_classes(manifest)
        if has > num_classes:  # the stream would stop at the first label beyond them
            given = "" if cfg.num_classes else " (from the training sets' manifests)"
            raise ConfigError(f"num_classes={num_classes}{given} is below the {has} classes of {location} (labels "
                              f"up to {has - 1}): a classifier needs a class for every label")
    check_kept_head(cfg.init, cfg.model, num_classes, names[0])  # init.keep_head: the checkpoint's head, these classes
    return Classes(num_classes, names[0])
