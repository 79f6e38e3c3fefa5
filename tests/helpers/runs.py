"""What a training run leaves behind, read back."""

from __future__ import annotations

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
