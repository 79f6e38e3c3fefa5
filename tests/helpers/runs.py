"""What a training run leaves behind, read back."""

from __future__ import annotations

import collections
import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every record of `run_dir`/metrics.jsonl, in order (training logs and evaluations)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run_tiny_pretrain(shards: str | Path, run_dir: str | Path, *overrides: str) -> None:
    """configs/pretrain/tiny.yaml in this process, on `shards`, without loader workers; `overrides` win."""
    from pretrain.__main__ import main

    main(["--config", "configs/pretrain/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}",
          "data.num_workers=0", *overrides])


def run_tiny_finetune(shards: str | Path, run_dir: str | Path, init: str | Path, *overrides: str) -> None:
    """configs/finetune/tiny.yaml in this process, from the checkpoint `init`, without loader workers; `overrides`
    win."""
    from finetune.__main__ import main

    main(["--config", "configs/finetune/tiny.yaml", f"data.shards={shards}", f"train.run_dir={run_dir}",
          f"init.checkpoint={init}", "data.num_workers=0", *overrides])


def audit(run_dir: str | Path) -> list[dict]:
    """Every record of the run's sample audit (`samples/rank_*.jsonl`), rank by rank."""
    return [json.loads(line) for path in sorted((Path(run_dir) / "samples").glob("rank_*.jsonl"))
            for line in path.read_text().splitlines()]


def epochs_in_audit(run_dir: str | Path) -> dict[int, collections.Counter]:
    """How often each sample key was read in each epoch, over every rank of the run's sample audit."""
    seen: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in audit(run_dir):
        for key, epoch in zip(record["keys"], record["epochs"]):
            seen[epoch][key] += 1
    return seen


def assert_each_sample_once_per_epoch(run_dir: str | Path, last_step: int, size: int = 96) -> int:
    """Every step up to `last_step` was recorded once per rank, no sample twice in an epoch, and every epoch before
    the last one started is whole (`train_000000`... `size` keys); returns the number of whole epochs."""
    steps = collections.Counter(r["step"] for r in audit(run_dir))
    assert set(steps) == set(range(1, last_step + 1)), sorted(set(range(1, last_step + 1)) - set(steps))
    seen = epochs_in_audit(run_dir)
    whole = max(seen)
    for epoch in range(whole):
        assert seen[epoch] == collections.Counter(f"train_{i:06d}" for i in range(size)), epoch
    assert max(seen[whole].values()) == 1
    return whole
