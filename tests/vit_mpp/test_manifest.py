"""A hand-edited or damaged manifest is one line naming what is wrong, for training, evaluation and inspect alike
(vit_mpp/data/manifest.py `check_manifest`), before a run directory is written."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from finetune.__main__ import main as finetune_main
from finetune.classes import Classes, classes_of
from finetune.config import FinetuneConfig
from pretrain.__main__ import main as pretrain_main
from vit_mpp.config.engine import ConfigError, load_config
from vit_mpp.config.sections import DataConfig
from vit_mpp.data.manifest import ManifestError, load_split
from vit_mpp.data.training_data import load_training_data
from vit_mpp.processes.exits import run_main


def good() -> dict:
    return {"name": "s", "num_classes": 2, "class_names": ["a", "b"],
            "splits": {"train": {"name": "train", "num_samples": 5, "filenames": ["t-0.tar", "t-1.tar"],
                                 "shard_lengths": [3, 2], "shard_bytes": [10, 10], "shard_sha256": ["x", "y"]}}}


def train(info: dict) -> dict:
    return info["splits"]["train"]


EDITS = [
    ("a negative count", lambda d: train(d)["shard_lengths"].__setitem__(0, -1), "'shard_lengths' must be counts"),
    ("a count that is true", lambda d: train(d).update(shard_lengths=[True, 4]), "'shard_lengths' must be counts"),
    ("a count as text", lambda d: train(d)["shard_lengths"].__setitem__(0, "3"), "'shard_lengths' must be counts"),
    ("a wrong total", lambda d: train(d).update(num_samples=6),
     "split 'train': 'num_samples' (6) is not the sum of 'shard_lengths' (5)"),
    ("no total", lambda d: train(d).pop("num_samples"), "'num_samples' (None) is not the sum"),
    ("a shard listed twice", lambda d: train(d).update(filenames=["t-0.tar", "t-0.tar"]),
     "split 'train': shard t-0.tar is listed twice"),
    ("a path out of the folder", lambda d: train(d)["filenames"].__setitem__(0, "../t.tar"), "not a plain name"),
    ("fewer lengths than files", lambda d: train(d).update(shard_lengths=[5]), "lists of the same length"),
    ("hashes of other shards", lambda d: train(d).update(shard_sha256=["x"]),
     "'shard_sha256' must be a list as long as 'filenames'"),
    ("negative classes", lambda d: d.update(num_classes=-1), "'num_classes' must be a count up to 10000000, not -1"),
    ("classes as text", lambda d: d.update(num_classes="2"), "'num_classes' must be a count up to 10000000, not '2'"),
    ("too many classes", lambda d: d.update(num_classes=10**20, class_names=[]),
     "'num_classes' must be a count up to 10000000, not 100000000000000000000"),
    ("names of other classes", lambda d: d.update(class_names=["a"]),
     "'class_names' names 1 classes but 'num_classes' is 2"),
    ("names that are numbers", lambda d: d.update(class_names=[0, 1]), "'class_names' must be a list of names"),
    ("no splits", lambda d: d.update(splits={}), "no 'splits'"),
]


@pytest.mark.parametrize("edit, message", [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_a_hand_edited_manifest_is_one_line_naming_what_is_wrong(tmp_path, edit, message):
    info = good()
    edit(info)
    (tmp_path / "_info.json").write_text(json.dumps(info))
    with pytest.raises(ManifestError) as e:
        load_split(tmp_path, "train")
    assert str(e.value).startswith(f"{tmp_path / '_info.json'} is not a usable build-shards manifest: ")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_good_manifest_loads(tmp_path):
    (tmp_path / "_info.json").write_text(json.dumps(good()))
    split, info = load_split(tmp_path, "train")
    assert split.lengths == [3, 2] and split.urls == [str(tmp_path / "t-0.tar"), str(tmp_path / "t-1.tar")]


@pytest.mark.parametrize("stage, config, change", [
    ("pretrain", "configs/pretrain/tiny.yaml", {"num_classes": -1}),  # was accepted: pretraining reads no labels
    ("finetune", "configs/finetune/tiny.yaml", {"num_classes": -1}),  # was an AttributeError traceback
    ("finetune", "configs/finetune/tiny.yaml", {"num_classes": "2"}),  # was a TypeError traceback
    ("finetune", "configs/finetune/tiny.yaml", {"class_names": ["only one"]}),  # was accepted: names misread
])
def test_training_on_a_damaged_manifest_stops_before_its_run_directory(tmp_path, demo_shards, encoder_export,
                                                                      capsys, stage, config, change):
    shards = tmp_path / "shards"
    shutil.copytree(demo_shards, shards)
    info = json.loads((shards / "_info.json").read_text())
    (shards / "_info.json").write_text(json.dumps({**info, **change}))
    argv = ["--config", config, f"data.shards={shards}", f"train.run_dir={tmp_path / 'run'}"]
    if stage == "finetune":
        argv.append(f"init.checkpoint={encoder_export}")
    with pytest.raises(SystemExit) as e:
        run_main({"pretrain": pretrain_main, "finetune": finetune_main}[stage], argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "is not a usable build-shards manifest" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("other", ["{s}/", "{s}/_info.json", "{s}/../{name}"])
def test_one_set_named_two_ways_in_a_mixture_is_refused(demo_shards, other):
    # `data.shards=[a, a]` is refused by the config check; these name the same shards in other words
    second = other.format(s=demo_shards, name=demo_shards.name)
    with pytest.raises(ConfigError, match=f"{demo_shards} and {second} hold the same shard .*: name each set once"):
        load_training_data(DataConfig(shards=[str(demo_shards), second]))


UNLABELLED = {"num_classes": 0, "class_names": []}  # an unlabelled build


@pytest.mark.parametrize("change, overrides, message", [
    ({"class_names": ["x", "y", "z", "w"]}, ["data.shards=[{demo},{other}]"],
     "the sets of data.shards name different classes"),
    (UNLABELLED, ["data.shards={other}"], "num_classes is not set and the manifest names no classes"),
    # num_classes given, or the unlabelled set only evaluated on: it ran an epoch, then stopped at evaluation
    (UNLABELLED, ["data.shards={other}", "num_classes=4"],
     "split 'train' of {other} carries no labels (its manifest counts no classes)"),
    (UNLABELLED, ["data.shards={demo}", "data.val_shards={other}"], "split 'val' of {other} carries no labels"),
    # stopped at the first sample with a label beyond them, with the run directory written
    ({}, ["data.shards={other}", "num_classes=2"], "num_classes=2 is below the 4 classes of {other} (labels up to 3)"),
    ({"indexed": True, "num_classes": None, "class_names": None}, ["data.shards={demo}", "data.val_shards={other}"],
     "split 'val' of {other} carries no labels"),
])
def test_fine_tuning_checks_the_classes_before_its_run_directory(tmp_path, demo_shards, encoder_export, capsys,
                                                                 change, overrides, message):
    other = tmp_path / "other"
    shutil.copytree(demo_shards, other)
    info = {**json.loads((other / "_info.json").read_text()), **change, "name": "other"}
    info = {k: v for k, v in info.items() if v is not None}  # an index manifest has no num_classes without labels
    (other / "_info.json").write_text(json.dumps(info))
    message = message.format(other=other)
    overrides = [o.format(demo=demo_shards, other=other) for o in overrides]
    argv = ["--config", "configs/finetune/tiny.yaml", *overrides, f"train.run_dir={tmp_path / 'run'}",
            f"init.checkpoint={encoder_export}"]
    with pytest.raises(SystemExit) as e:
        run_main(finetune_main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()  # it was written before the check


def test_a_mixture_of_indexed_sets_takes_the_most_classes_and_the_evaluation_set_must_fit():
    # indexed sets name no classes, and count those their labels reach: the first set's count was taken, and the
    # stream stopped at the first label of the other set beyond it
    def indexed(num_classes: int) -> dict:
        return {"indexed": True, "num_classes": num_classes, "splits": {"train": {}, "val": {}}}

    sets = [("a", indexed(3)), ("b", indexed(7))]
    data = SimpleNamespace(labelled=lambda: sets, val_location="c", val_manifest=indexed(5))
    cfg = load_config(FinetuneConfig, None, [])
    assert classes_of(cfg, data) == Classes(7, None)
    data.val_manifest = indexed(9)
    with pytest.raises(ConfigError, match=r"num_classes=7 \(from the training sets' manifests\) is below the 9 "
                                          r"classes of c \(labels up to 8\)"):
        classes_of(cfg, data)


# Evaluation in a mixture: the first set that has data.val_split, said at start-up; none is one line saying what to set
def test_a_mixture_evaluates_on_the_first_set_that_has_the_split(demo_shards, tmp_path):
    from tests.helpers.shards import write_shard_set

    theirs = write_shard_set(tmp_path / "theirs", {"train": [24]})  # no val split, as img2dataset's output
    data = load_training_data(DataConfig(shards=[str(theirs), str(demo_shards)]))
    info = json.loads((demo_shards / "_info.json").read_text())
    name, size = info["name"], info["splits"]["val"]["num_samples"]
    assert data.val_location == str(demo_shards) and data.val_split.num_samples == size
    assert f"(evaluation: split 'val' of {name}, {size} images): " in data.describe()
    assert data.record()["val"] == {"set": name, "shards": str(demo_shards), "split": "val", "images": size}
    assert "evaluation" not in load_training_data(DataConfig(shards=str(demo_shards))).describe()  # its only set


@pytest.mark.parametrize("sets, more, where", [
    (["{theirs}", "{other}"], [], "no split 'val' in any set of data.shards ({theirs}/_info.json has: train; "
                                  "{other}/_info.json has: train): "),
    (["{theirs}"], [], "no split 'val' in the manifest of data.shards ({theirs}/_info.json has: train): "),
    (["{demo}"], ["data.val_shards={theirs}"],
     "data.val_shards: split 'val' not in {theirs}/_info.json (has: train): "),
])
def test_no_set_to_evaluate_on_is_one_line_that_says_what_to_set(sets, more, where, demo_shards, tmp_path, capsys):
    from tests.helpers.shards import write_shard_set

    names = {"theirs": write_shard_set(tmp_path / "theirs", {"train": [8]}), "demo": demo_shards,
             "other": write_shard_set(tmp_path / "other", {"train": [8]}, seed=1)}
    shards = ",".join(s.format(**names) for s in sets)
    with pytest.raises(SystemExit) as e:
        run_main(pretrain_main, ["--config", "configs/pretrain/tiny.yaml", f"data.shards=[{shards}]",
                                 f"train.run_dir={tmp_path / 'run'}", *[m.format(**names) for m in more]])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == (f"error: {where.format(**names)}evaluate on another set with data.val_shards=LOCATION or on "
                      "another split with data.val_split=NAME, or train without evaluation with data.val_split=''")
    assert not (tmp_path / "run").exists()
