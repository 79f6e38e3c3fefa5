"""The loader start-up benchmark (benchmarks/loader_start_bench.py): a trial starts a rank's real loaders and measures
them, and its tables compare each method with fork's trial of the same round."""

from __future__ import annotations

from benchmarks import loader_start_bench as bench
from tests.helpers.shards import write_shard_set


def test_a_trial_starts_a_ranks_loaders_and_measures_them(tmp_path):
    shards = write_shard_set(tmp_path / "shards", {"train": [40, 40], "val": [20]})
    result = bench.run_trial({**bench.CASES["demo_pretrain"], "case": "demo_pretrain", "method": "fork",
                              "shards": str(shards), "val_split": "val", "batch": 8, "evals": 2, "eval_batches": 0,
                              "warm": 1, "timed": 2})
    assert result["train_first_s"] > 0 and result["train_img_s"] > 0
    assert len(result["eval_first_s"]) == len(result["eval_img_s"]) == 2
    assert result["run_starts_s"] == result["train_first_s"] + sum(result["eval_first_s"])
    assert result["memory"]["processes"] == 3  # the rank, its training worker, the evaluation's worker
    assert result["memory"]["pss_mib"] > 0


def _result(first: float, memory: float) -> dict:
    return {"train_first_s": first, "eval_first_s": [first, first], "run_starts_s": 3 * first,
            "run_starts_cpu_s": 2 * first, "train_img_s": 100.0, "eval_img_s": [50.0, 50.0],
            "memory": {"processes": 3, "pss_mib": memory}}


def test_the_tables_give_medians_and_each_rounds_ratio_to_fork():
    # round 1: fork 1 s, forkserver 2 s; round 2: fork 2 s, forkserver 3 s; round 3: fork 1 s, forkserver 4 s
    results = {"demo_pretrain": {"fork": [_result(1, 100), _result(2, 100), _result(1, 100)],
                                 "forkserver": [_result(2, 200), _result(3, 200), _result(4, 200)]}}
    rows = bench.table(results, ["fork", "forkserver"])
    forkserver = next(row for row in rows if row.startswith("| forkserver"))
    assert forkserver.startswith("| forkserver | 3 (2.00x) | 3 (2.00x) | 3 (2.00x) | 9 (2.00x) | 6 (2.00x) | "
                                 "100 (1.00x) | 50 (1.00x) | 200 (2.00x) | 3 |"), forkserver
    shares = bench.run_shares(results, ["fork", "forkserver"], {"pretrain": 300.0})
    assert "| pretrain (demo_pretrain) | forkserver | 9.00 | +3.00 | +2.00 | 1.00% of 300 s |" in shares
