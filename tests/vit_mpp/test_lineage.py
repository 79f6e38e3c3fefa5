"""vit_mpp/data/lineage.py: which samples two shard sets share, told by the records `build-shards subset` writes
(the real command draws every subset here) and by key, never by key alone across unrelated sources."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_tools.cli import main as build_main
from tests.helpers.processes import in_process
from tests.helpers.shards import write_shard_set
from vit_mpp.data.lineage import SplitOf, origin, shared_samples, split_keys
from vit_mpp.data.manifest import MANIFEST_NAME, ManifestError, read_manifest


def of(location: Path, split: str = "train") -> SplitOf:
    return SplitOf(str(location), split, read_manifest(location))


def draw(capsys, source: Path, out: Path, per_class: int, seed: int, *exclude: Path) -> Path:
    more = [a for e in exclude for a in ("--exclude", str(e))]
    code, _, err = in_process(build_main, ["subset", str(source), str(out), "--per-class", str(per_class), "--seed",
                                           str(seed), *more], capsys)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_shard_set(tmp_path_factory.mktemp("src") / "set", {"train": [12, 12], "val": [6]})


def test_a_subset_shares_its_samples_with_what_it_was_drawn_from(source, tmp_path, capsys):
    a = draw(capsys, source, tmp_path / "a", 2, 0)
    assert origin(of(a)) == (str(source), "train")
    assert origin(of(a, "val")) == (str(a), "val")  # its val names the source's shards: a shard check tells that
    assert shared_samples(of(source), of(a)) == 6 and shared_samples(of(a), of(source)) == 6
    assert shared_samples(of(source, "val"), of(a)) == 0  # another split of the source
    assert split_keys(of(a)) <= split_keys(of(source))


def test_two_subsets_of_one_source_share_the_keys_they_both_hold(source, tmp_path, capsys):
    a = draw(capsys, source, tmp_path / "a", 3, 0)
    b = draw(capsys, source, tmp_path / "b", 3, 1)
    both = split_keys(of(a)) & split_keys(of(b))
    assert both and shared_samples(of(a), of(b)) == len(both) < 9  # seeds 0 and 1 draw 9 of 24 each
    apart = draw(capsys, source, tmp_path / "apart", 3, 1, a)
    assert shared_samples(of(a), of(apart)) == 0
    deeper = draw(capsys, a, tmp_path / "deeper", 1, 0)  # a subset of a subset: still the source's samples
    assert origin(of(deeper)) == (str(source), "train")
    assert shared_samples(of(deeper), of(a)) == 3 and shared_samples(of(deeper), of(apart)) == 0


def test_sets_of_unrelated_origins_share_nothing_though_their_keys_collide(source, tmp_path, capsys):
    other = write_shard_set(tmp_path / "other", {"train": [12, 12], "val": [6]}, seed=7)  # the same keys
    assert split_keys(of(other)) == split_keys(of(source))
    assert shared_samples(of(other), of(source)) == 0
    assert shared_samples(of(draw(capsys, other, tmp_path / "o", 2, 0)), of(draw(capsys, source, tmp_path / "s", 2,
                                                                                  0))) == 0


def test_a_source_gone_or_a_loop_of_records_ends_the_walk(source, tmp_path, capsys):
    a = draw(capsys, source, tmp_path / "a", 2, 0)
    info = json.loads((a / MANIFEST_NAME).read_text())
    info["subset"]["of"] = str(tmp_path / "gone")
    (a / MANIFEST_NAME).write_text(json.dumps(info))
    assert origin(of(a)) == (str(tmp_path / "gone"), "train")
    info["subset"]["of"] = str(a)  # a record naming itself
    (a / MANIFEST_NAME).write_text(json.dumps(info))
    assert origin(of(a)) == (str(a), "train")


def test_an_unreadable_shard_is_one_line(source, tmp_path, capsys):
    a = draw(capsys, source, tmp_path / "a", 2, 0)
    b = draw(capsys, source, tmp_path / "b", 2, 1)
    shard = next(a.glob("train-*.tar"))
    shard.write_bytes(shard.read_bytes()[:700])  # cut inside a member
    with pytest.raises(ManifestError, match=r"^cannot read the keys of .*train-\d+\.tar: ") as e:
        shared_samples(of(a), of(b))
    assert "\n" not in str(e.value)
