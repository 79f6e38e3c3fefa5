"""Labels from the pool's structure, measured before they are built: label propagation's rule on pools whose answer is
known, and the probe's command on shards and an export the project makes, its bad inputs one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from experiments.pool_labels import confident_accuracy, main, propagate
from tests.helpers.processes import in_process
from tests.helpers.shards import write_shard_set
from vit_mpp.models.knn import knn_top1


def two_moons(n: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved half-circles, lifted into 3-D so that cosine similarity follows distance in the plane."""
    g = torch.Generator().manual_seed(0)
    t = torch.rand(n, generator=g) * math.pi
    upper, lower = torch.stack([t.cos(), t.sin()], 1), torch.stack([1 - t.cos(), 0.5 - t.sin()], 1)
    points = torch.cat([upper, lower]) + 0.05 * torch.randn(2 * n, 2, generator=g)
    return torch.cat([points, torch.full((2 * n, 1), 3.0)], 1), torch.cat([torch.zeros(n), torch.ones(n)]).long()


def test_propagation_follows_the_pools_structure_where_a_nearest_neighbour_cannot():
    features, truth = two_moons()
    given = torch.full_like(truth, -1)
    given[0], given[200] = 0, 1  # one label per moon
    probs, weight = propagate(features, given, 2)
    assert (probs.argmax(1) == truth).float().mean() == 1.0
    nearest = knn_top1(features[[0, 200]], truth[[0, 200]], features, truth, 1, 0.07)
    assert nearest < 0.9  # the moons' tips lie nearer the other moon's label
    assert probs.sum(1).allclose(torch.ones(400)) and ((weight >= 0) & (weight <= 1 + 1e-6)).all()


def test_a_class_with_more_labels_does_not_flood_the_graph():
    g = torch.Generator().manual_seed(1)
    centres = torch.eye(3) * 4 + 1
    features = torch.cat([c + 0.3 * torch.randn(50, 3, generator=g) for c in centres])
    truth = torch.arange(3).repeat_interleave(50)
    given = torch.full_like(truth, -1)
    given[:20] = 0  # twenty labels of class 0, one each of the others
    given[50], given[100] = 1, 2
    probs, _ = propagate(features, given, 3)
    assert (probs.argmax(1) == truth).all()


def test_an_image_no_label_reaches_has_no_class_and_no_weight():
    features = torch.tensor([[1.0, 0.0], [0.99, 0.14], [0.0, 1.0], [0.14, 0.99]])  # two pairs at right angles
    probs, weight = propagate(features, torch.tensor([0, -1, -1, -1]), 2, neighbours=1)
    assert probs[1].argmax() == 0 and weight[1] > 0.9
    assert probs[2].tolist() == [0.5, 0.5] and weight[2] == pytest.approx(0, abs=1e-6)


def test_confident_accuracy_scores_the_most_confident_shares():
    right = torch.tensor([True] * 5 + [False] * 5)
    confidence = torch.linspace(1, 0, 10)  # the right ones first
    assert confident_accuracy(right, confidence) == {"all": 0.5, "top50%": 1.0, "top20%": 1.0, "top10%": 1.0}


def test_the_probe_scores_every_labeller_on_an_export_and_shards(tmp_path, encoder_export, capsys):
    labelled = write_shard_set(tmp_path / "labelled", {"train": [6]})
    pool = write_shard_set(tmp_path / "pool", {"train": [20, 10]}, seed=1)
    out = tmp_path / "table.json"
    code, stdout, stderr = in_process(main, ["--checkpoint", str(encoder_export), "--labelled", str(labelled),
                                             "--pool", str(pool), "--workers", "0", "--out", str(out)], capsys)
    assert code == 0, stderr
    table = json.loads(out.read_text())["table"]
    assert set(table) == {f"{kind}, {pooling}" for kind in ("1-NN", "20-NN", "propagation")
                          for pooling in ("[class] token", "patch mean")}  # an encoder export: no head
    assert set(table["propagation, patch mean"]) == {"all", "top50%", "top20%", "top10%"}
    assert all(0 <= v <= 1 for row in table.values() for v in row.values())
    assert "6 labelled images, 30 pool images, 3 classes" in stdout


@pytest.mark.parametrize("flag, value, message", [
    ("--neighbours", "0", "--neighbours must be at least 1, got 0"),
    ("--batch-size", "-1", "--batch-size must be at least 1, got -1"),
    ("--out", "{tmp}/a_file/table.json", "--out"),  # before the features are read, not after
    ("--labelled", "/no/such/set", "shard directory not found: /no/such/set"),
])
def test_bad_settings_are_one_line(tmp_path, encoder_export, capsys, flag, value, message):
    sets = {"--labelled": str(write_shard_set(tmp_path / "labelled", {"train": [6]})),
            "--pool": str(write_shard_set(tmp_path / "pool", {"train": [6]}))}
    sets[flag] = value.format(tmp=tmp_path)
    (tmp_path / "a_file").write_text("")
    code, stdout, stderr = in_process(main, ["--checkpoint", str(encoder_export), "--workers", "0",
                                             *[x for kv in sets.items() for x in kv]], capsys)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("error:") and not stdout


def test_an_unlabelled_pool_cannot_score_anything(tmp_path, encoder_export, capsys):
    labelled = write_shard_set(tmp_path / "labelled", {"train": [6]})
    pool = write_shard_set(tmp_path / "pool", {"train": [6]}, labels={"train": [None] * 6})
    code, _, stderr = in_process(main, ["--checkpoint", str(encoder_export), "--labelled", str(labelled),
                                        "--pool", str(pool), "--workers", "0"], capsys)
    assert code == 2 and stderr.startswith("error:") and len(stderr.strip().splitlines()) == 1
