"""The MPP step benchmark (benchmarks/mpp_step_bench.py): a lever moves one knob of the baseline, a bad one is one
`error:` line, and --levers times each lever's real step against the baseline's in one process."""

from __future__ import annotations

import json

import pytest

from benchmarks import mpp_step_bench as bench

TINY = ["--device", "cpu", "--img-size", "16", "--patch-size", "4", "--embed-dim", "32", "--depth", "1",
        "--num-heads", "2", "--batch", "4", "--steps", "1", "--rounds", "1"]  # no --threads: it would set pytest's own


def test_a_target_lever_moves_the_target_alone():
    baseline = bench.Setting(8, True, None, "default", "auto")
    assert bench.lever_setting(baseline, "target=hog") == bench.Setting(8, True, None, "default", "auto", None, "hog")
    assert bench.lever_setting(baseline, "target=l2+batch=4").target == "l2"
    assert "target hog" in bench.lever_setting(baseline, "target=hog").describe()
    assert "target" not in baseline.describe()  # the paper's, said by nothing


def test_a_lever_the_benchmark_does_not_know_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.lever_setting(bench.Setting(8, True, None, "default", "auto"), "target=hug")
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --levers takes") and "target=TARGET" in err[0]


def test_the_target_lever_times_a_real_hog_step_against_the_papers(tmp_path):
    out = tmp_path / "levers.json"
    bench.main([*TINY, "--levers", "target=hog", "--json", str(out)])
    record = json.loads(out.read_text())["levers"]["target=hog"]
    assert record["setting"]["target"] == "hog" and record["lever"]["img_s"] > 0 and record["baseline"]["img_s"] > 0
    assert record["ratio_to_baseline"] == pytest.approx(record["lever"]["img_s"] / record["baseline"]["img_s"])
