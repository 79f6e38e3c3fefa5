"""Resumable builds: `_journal.jsonl` records every finished shard, so an interrupted build (even `kill -9`) is
finished by re-running the same command, without duplicates or loss.

The journal's first line names the build (a fingerprint of the settings and every input in its shuffled order);
each later line is one shard, appended and fsynced after the shard's atomic rename. On resume, the shards whose
files are still intact are kept and the build continues after them; a different fingerprint means a different
build, which only `--overwrite` may replace.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from pathlib import Path

from data_tools.sources import Item, Source
from data_tools.writer import file_sha256

JOURNAL_NAME = "_journal.jsonl"


def fingerprint(source: Source, splits: dict[str, list[Item]], settings: dict) -> str:
    """Identifies a build: settings plus every input id in its shuffled order. A resume must match it exactly."""
    digest = hashlib.sha256(json.dumps([source.describe(), settings], sort_keys=True).encode())
    for name, items in splits.items():
        digest.update(f"\n[{name}]".encode())
        for item in items:
            digest.update(f"{item.source_id}\t{item.label}\n".encode())
    return digest.hexdigest()


class Journal:
    """`_journal.jsonl`: a header naming the build, then one line per finished shard (appended and fsynced after
    the shard's rename). A torn last line, from a kill mid-write, is ignored."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / JOURNAL_NAME

    def read(self) -> tuple[str | None, list[dict]]:
        if not self.path.exists():
            return None, []
        header, records = None, []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            if rec.get("type") == "build":
                header = rec["fingerprint"]
            elif rec.get("type") == "shard":
                records.append(rec)
        return header, records

    def start(self, build_id: str, records: list[dict]) -> None:
        """(Re)write the journal with the records that are kept, atomically."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            for rec in [{"type": "build", "fingerprint": build_id}, *records]:
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, recs: list[dict]) -> None:
        """Journal the shards of one finished range (after their renames), in one write."""
        with open(self.path, "a") as f:
            f.write("".join(json.dumps({"type": "shard", **rec}) + "\n" for rec in recs))
            f.flush()
            os.fsync(f.fileno())


def verified_records(out_dir: Path, records: list[dict]) -> list[dict]:
    """The journal's shards that are still intact: per split, a prefix whose files have the recorded size (and,
    for each split's last shard, the one a crash is most likely to have hurt, the recorded sha256)."""
    kept: list[dict] = []
    by_split: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in records:
        by_split[rec["split"]].append(rec)
    for recs in by_split.values():
        for i, rec in enumerate(recs):
            if rec["filename"] is not None:
                path = out_dir / rec["filename"]
                if not path.exists() or path.stat().st_size != rec["bytes"]:
                    break
                if i == len(recs) - 1 and file_sha256(path) != rec["sha256"]:
                    break
            kept.append(rec)
    return kept
