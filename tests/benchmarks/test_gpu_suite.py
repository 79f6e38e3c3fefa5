"""The GPU suite (benchmarks/gpu_suite.sh): its smoke run makes every row of the table on the CPU (all rows:
exhaustive, 2.5-4.5 minutes, most of it compiling; the eager rows end to end: slow, in CI), and a smoke run's table
never reaches docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.helpers.processes import REPO

MODELS = ("ViT-B/16", "ViT-S/16")
PER_MODEL = ("supervised step (timm), bf16 eager", "MPP step, bf16 eager", "supervised step (timm), bf16 compiled",
             "MPP step, bf16 compiled", "lever: torch.compile (default mode)", "pretrain end to end @ 32, bf16 eager",
             "pretrain end to end @ 32, train.compile=true", "finetune end to end @ 48, bf16 eager")
LEVERS = ("lever: attention backend flash", "lever: attention backend cudnn", "lever: attention backend efficient",
          "lever: AdamW kernel foreach (the baseline's is fused on CUDA)", "lever: micro-batch 4",
          "lever: micro-batch 16", "lever: torch.compile max-autotune", "lever: MPP target hog")
ONCE = ("build-shards, 2 workers, bytes kept", "loader alone (ours), 2 workers, crop 32")
TESTS = "GPU tests (pytest -m gpu)"
UNAVAILABLE_ON_CPU = {"lever: attention backend cudnn", "lever: attention backend efficient"}
# FP8: a smoke run on the CPU lists its rows, not run.
CUDA_ONLY = {"fp8_b16": ("ViT-B/16", "levers"),
             "pretrain_compiled_fp8_b16": ("ViT-B/16", "pretrain end to end @ 32, train.compile=true train.fp8=true")}


def table_rows(markdown: str) -> dict[tuple[str, str], list[str]]:
    """(model, row) -> the other cells, for each line of the table."""
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in markdown.splitlines()
             if ln.startswith("| ") and not ln.startswith(("| model ", "| --- "))]
    return {(c[0], c[1]): c[2:] for c in cells}


def smoke(tmp_path, *only: str, pack: bool = False) -> tuple:
    """Run the suite's smoke run (`--only` rows if given); its suite.json rows' statuses and table.md."""
    out = tmp_path / "out"
    result = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "--smoke", "--out", str(out), "--work", str(tmp_path),
                             *(["--only", *only] if only else []), *(["--pack"] if pack else [])],
                            cwd=REPO, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    statuses = {k: r["status"] for k, r in json.loads((out / "suite.json").read_text())["rows"].items()}
    return out, statuses, (out / "table.md").read_text()


@pytest.mark.slow
def test_the_eager_rows_run_end_to_end(tmp_path):
    out, statuses, table = smoke(tmp_path, "step_eager_s16", "loader", "finetune_s16", pack=True)
    assert statuses == dict.fromkeys(["shards", "loader", "pretrain_eager_s16", "finetune_s16", "step_eager_s16"],
                                     "ok"), statuses
    # --pack: raw/ goes out as one archive (rewritten after every row, as table.md and suite.json are)
    assert sorted(p.name for p in out.iterdir()) == ["raw.tar.gz", "suite.json", "table.md"]
    with tarfile.open(out / "raw.tar.gz") as tar:
        assert {f"raw/{k}.log" for k in statuses} <= set(tar.getnames())
    rows = table_rows(table)
    for what in ("supervised step (timm), bf16 eager", "MPP step, bf16 eager", "pretrain end to end @ 32, bf16 eager",
                 "finetune end to end @ 48, bf16 eager"):
        img_s, ms = rows[("ViT-S/16", what)][:2]
        assert float(img_s.replace(",", "")) > 0 and float(ms) > 0, (what, img_s, ms)
    assert ("ViT-B/16", "MPP step, bf16 eager") not in rows  # only what was asked, and what it needs


@pytest.mark.exhaustive
def test_the_smoke_run_makes_every_row(tmp_path):
    out, statuses, table = smoke(tmp_path)
    assert {k: v for k, v in statuses.items() if k not in CUDA_ONLY} == dict.fromkeys(
        set(statuses) - set(CUDA_ONLY), "ok"), statuses
    assert {k: statuses[k] for k in CUDA_ONLY} == dict.fromkeys(CUDA_ONLY, "not run: needs a CUDA device")
    rows = table_rows(table)
    for key in CUDA_ONLY.values():
        assert rows.pop(key)[-1] == "not run: needs a CUDA device", key
    expected = {(m, what) for m in MODELS for what in PER_MODEL} | {("ViT-B/16", what) for what in LEVERS} | {
        ("-", what) for what in (*ONCE, TESTS)}
    assert set(rows) == expected
    assert "skipped" in rows[("-", TESTS)][-1] and "passed" not in rows[("-", TESTS)][-1]  # no CUDA here
    for (_, what), (img_s, ms, mfu, ratio, notes) in rows.items():
        assert not mfu, (what, mfu)  # no MFU on a CPU: its peak is unknown
        if what == TESTS:
            continue
        if what in UNAVAILABLE_ON_CPU:
            assert not img_s and "unavailable" in notes, (what, notes)
        else:
            assert float(img_s.replace(",", "")) > 0 and (what in ONCE or float(ms) > 0), (what, img_s, ms)
        if what.startswith("lever:") and what not in UNAVAILABLE_ON_CPU:
            assert ratio.endswith("vs bf16 eager"), (what, ratio)
        if what.startswith("pretrain end to end"):  # against the step benchmark of the same model and compilation
            assert " of the MPP step (step_" in ratio, (what, ratio)
    assert "smoke run on the CPU" in table
    assert sorted(p.name for p in (out / "raw").glob("*.log")) == sorted(f"{k}.log" for k in statuses
                                                                         if k not in CUDA_ONLY)


def test_a_smoke_table_is_never_appended_to_the_docs(tmp_path):
    (tmp_path / "table.md").write_text("### GPU suite: CPU (smoke run on the CPU: tiny sizes, the figures mean "
                                       "nothing), 2026-01-01\n")
    before = (REPO / "docs" / "benchmarks.md").read_text()
    result = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--append-from", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and result.stderr.strip().startswith("error: "), result.stderr
    assert "a smoke run's table" in result.stderr
    assert (REPO / "docs" / "benchmarks.md").read_text() == before
