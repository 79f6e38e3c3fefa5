"""Resumable builds: every part journals the ranges it finished (`Journal`), so an interrupted build (even `kill -9`)
is finished by re-running the same command, without duplicates or loss, and `merge` knows when all parts are done.
The first line names the build (`fingerprint`), each later line is one published range; a remote OUT's journal is
uploaded whole at most every `SNAPSHOT_S` seconds. See docs/build_shards.md#resuming-and-interruptions.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from data_tools.builder.shard_layout import Parts
from data_tools.builder.writer import file_sha256
from data_tools.store import LocalStore, RemoteStore

JOURNAL_PREFIX = "_journal"
SNAPSHOT_S = 30.0


def journal_name(parts: Parts) -> str:
    """The journal of one part (a one-machine build is part 0 of 1)."""
    if parts.count == 1:
        return f"{JOURNAL_PREFIX}.jsonl"
    return f"{JOURNAL_PREFIX}-part-{parts.index:05d}-of-{parts.count:05d}.jsonl"


def is_journal(name: str) -> bool:
    return name.startswith(JOURNAL_PREFIX) and name.endswith(".jsonl")


def fingerprint(catalog_digest: str, settings: dict[str, Any]) -> str:
    """Identifies a build: its settings and its listed inputs. Parts, resumes and merges must match it exactly."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(catalog_digest.encode())
    return digest.hexdigest()


def parse_journal(text: str) -> tuple[dict | None, list[dict]]:
    """(header, range records) of a journal's text; reading stops at the first line that is not whole JSON."""
    header, records = None, []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(rec, dict):
            break
        if rec.get("type") == "build" and header is None:
            header = rec
        elif rec.get("type") == "range" and header is not None:
            records.append(rec)
    return header, records


def read_journals(store: LocalStore | RemoteStore, sizes: dict[str, int]) -> dict[str, tuple[dict | None, list]]:
    """Every journal in OUT (their names come from the listing `sizes`), parsed."""
    return {name: parse_journal(store.read_text(name) or "") for name in sorted(sizes) if is_journal(name)}


def intact(record: dict, sizes: dict[str, int]) -> bool:
    """Whether every shard of a journaled range is in OUT with its recorded size."""
    return all(sizes.get(s["filename"]) == s["bytes"] for s in record["shards"])


def last_is_whole(store: LocalStore | RemoteStore, record: dict) -> bool:
    """The last range a journal recorded is the one a crash is most likely to have hurt: check its sha256 where the
    files are local (an object store's upload is atomic, so its size check suffices)."""
    for shard in record["shards"]:
        path = store.local_file(shard["filename"])
        if path is not None and file_sha256(path) != shard["sha256"]:
            return False
    return True


class Journal:
    """This part's journal: `start` (re)writes it whole, `append` adds one finished range."""

    def __init__(self, store: LocalStore | RemoteStore, name: str) -> None:
        self.store, self.name = store, name
        self.lines: list[str] = []  # remote OUT: the journal's text, uploaded as a whole
        self.uploaded_at = 0.0
        self.dirty = False

    def start(self, header: dict, records: list[dict]) -> None:
        self.lines = [json.dumps(rec) + "\n" for rec in [header, *records]]
        self.store.write_text(self.name, "".join(self.lines))
        self.uploaded_at, self.dirty = time.monotonic(), False

    def append(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        if self.store.local:
            self.store.append_text(self.name, line)
            return
        self.lines.append(line)
        self.dirty = True
        if time.monotonic() - self.uploaded_at >= SNAPSHOT_S:
            self.flush()

    def flush(self) -> None:
        """Remote OUT: upload the journal now if it changed since the last upload."""
        if self.dirty and not self.store.local:
            self.store.write_text(self.name, "".join(self.lines))
            self.uploaded_at, self.dirty = time.monotonic(), False
