"""Which monitor ranks MPP recipes as fine-tuning does: Spearman's rank correlation (checked against scipy's, ties
included), and compare's table of every MPP run's last monitors beside its fine-tuned top-1, read from the runs."""

from __future__ import annotations

import json

import pytest
from scipy.stats import spearmanr

from experiments import compare, compare_arms, run_scheduler
from experiments.monitor_ranks import monitor_table, ranks, spearman
from tests.experiments.test_compare import FakeStages, argv, shards  # noqa: F401  (shards: the fixture)


@pytest.mark.parametrize("xs, ys", [
    ([0.1, 0.5, 0.3, 0.9], [0.2, 0.6, 0.1, 0.8]),
    ([1, 2, 2, 3, 5], [5, 3, 3, 2, 1]),  # ties on both sides
    ([0.3, 0.3, 0.4], [0.1, 0.2, 0.3]),
])
def test_spearman_is_scipys(xs, ys):
    assert spearman(xs, ys) == pytest.approx(spearmanr(xs, ys).statistic)


def test_ranks_and_what_has_no_correlation():
    assert ranks([0.5, 0.1, 0.5, 0.9]) == [2.5, 1.0, 2.5, 4.0]
    assert spearman([1, 2], [2, 1]) is None  # two runs rank nothing
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # a monitor that never moved


def test_the_monitor_table_reads_each_pretrainings_last_values(tmp_path):
    runs = []
    for i, (cls, top1) in enumerate([(0.5, 0.8), (0.6, 0.9), (0.4, 0.7)]):
        run_dir = tmp_path / f"r{i}"
        run_dir.mkdir()
        records = [{"step": 1, "knn_top1_cls": 0.1, "knn_top1_avg": 0.9}, {"step": 2, "loss": 1.0},
                   {"step": 3, "knn_top1_cls": cls, "knn_top1_avg": 1 - cls}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs.append((f"mpp-{i}", 0, run_dir, top1))
    table = monitor_table(runs)
    assert [r["knn_top1_cls"] for r in table["runs"]] == [0.5, 0.6, 0.4]  # the last logged, not the first
    assert table["spearman"]["knn_top1_cls"] == {"spearman": pytest.approx(1.0), "runs": 3}
    assert table["spearman"]["knn_top1_avg"]["spearman"] == pytest.approx(-1.0)
    assert "knn_probe_attentive" not in table["spearman"]  # not logged: not shown


def test_compare_tables_the_monitors_of_its_mpp_arms(tmp_path, monkeypatch, shards):  # noqa: F811
    fake = FakeStages(monkeypatch, top1=lambda stage: {"mpp": 0.7, "mpp-a": 0.8, "mpp-b": 0.6}.get(stage.arm, 0.5))
    launch = fake.launch
    attentive = {"mpp": 0.5, "mpp-a": 0.55, "mpp-b": 0.4}

    def with_monitors(stage, log, threads):
        code = launch(stage, log, threads)
        if stage.stage == "pretrain":
            with (stage.run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": stage.steps, "knn_top1_cls": 0.3, "knn_top1_avg": 0.3 + stage.seed_shift,
                                    "knn_probe_attentive": attentive[stage.arm] + stage.seed_shift}) + "\n")
        return code

    monkeypatch.setattr(compare_arms.Stage, "seed_shift", property(lambda s: 0.01 * int(s.name[4])), raising=False)
    monkeypatch.setattr(run_scheduler, "launch", with_monitors)
    # pretrainings of their own (arms that change nothing of it would read the reference's)
    report = compare.main(argv(shards, tmp_path / "out", "--seeds", "0", "1", "--arms", "mpp,mpp-a,mpp-b,scratch",
                               "--set", "mpp-a.pretrain:mpp.mask_ratio=0.4", "mpp-b.pretrain:mpp.mask_ratio=0.3"))
    monitors = report["monitors"]
    assert len(monitors["runs"]) == 6 and {r["arm"] for r in monitors["runs"]} == {"mpp", "mpp-a", "mpp-b"}
    assert monitors["spearman"]["knn_probe_attentive"]["spearman"] == pytest.approx(
        spearmanr([0.5, 0.51, 0.55, 0.56, 0.4, 0.41], [0.7, 0.7, 0.8, 0.8, 0.6, 0.6]).statistic)
    assert monitors["spearman"]["knn_top1_cls"]["spearman"] is None  # flat: ranks nothing
    md = (tmp_path / "out/compare.md").read_text()
    assert "| Spearman with fine-tuning | knn_top1_cls | knn_top1_avg | knn_probe_attentive |" in md
