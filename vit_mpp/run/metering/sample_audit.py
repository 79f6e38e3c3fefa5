"""The sample audit (`train.record_samples=true`, `SampleAudit`): which samples each rank used at every optimizer
step, one JSON line per step in `run_dir/samples/rank_<R>.jsonl`, flushed at every checkpoint and cut back to the
resumed step on resume. See docs/data_stream.md#the-sample-audit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vit_mpp.durable import writing
from vit_mpp.run.metering.metrics_log import rewind_jsonl

AUDIT_DIR = "samples"


def audit_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / AUDIT_DIR / f"rank_{rank}.jsonl"


class SampleAudit:
    """Writes the keys of each step's micro-batches as one line (`write`); a no-op when off."""

    def __init__(self, run_dir: str | Path, rank: int, is_main: bool, set_names: list[str], enabled: bool) -> None:
        self.enabled, self.rank, self.is_main, self.set_names = enabled, rank, is_main, set_names
        self.path = audit_file(run_dir, rank)
        self.file: Any = None

    def rewind(self, step: int) -> None:
        """On the main process, cut every rank's file back to `step` (the other ranks write their first line only
        after the first step's gradient all-reduce, which waits for the main process)."""
        if self.enabled and self.is_main and self.path.parent.is_dir():
            for path in sorted(self.path.parent.glob("rank_*.jsonl")):
                rewind_jsonl(path, step)

    def write(self, step: int, micro_batches: list[dict[str, Any]]) -> None:
        """The line of optimizer step `step`: the keys of its micro-batches, the epoch of each, its set (a mixture)
        and the undecodable samples replaced in them."""
        if not self.enabled:
            return
        keys = [k for b in micro_batches for k in b["key"]]
        record: dict[str, Any] = {"step": step, "keys": keys, "epochs": [e for b in micro_batches for e in b["epoch"]]}
        if len(self.set_names) > 1:
            record["sets"] = [self.set_names[i] for b in micro_batches for i in b["set"]]
        bad = [k for b in micro_batches for k in b["bad_keys"]]
        if bad:
            record["bad"] = bad
        with writing(self.path):
            if self.file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.file = self.path.open("a", buffering=1 << 16)
            self.file.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        """Push the buffered lines to the file (at checkpoints and at the end)."""
        if self.file is not None:
            with writing(self.path):
                self.file.flush()
