"""Finishing a build: check that every range of every split is in OUT, then write failures.jsonl and `_info.json`.

    build-shards merge OUT

A one-machine build does this itself when its ranges are done; a build run as parts (`--num-parts N --part I`)
needs it once all parts are done. It reads every journal in OUT (all must name the same build), checks that every
range of every split is journaled and its shards are in OUT with their recorded sizes, and writes the failures and,
last, the manifest (the commit point). What it writes depends only on the journals' contents, so a build made of
parts is byte for byte the build one machine would have made.
"""

from __future__ import annotations

import collections
import hashlib
import json

from data_tools.journal import intact, read_journals
from data_tools.layout import iter_ranges
from data_tools.store import LocalStore, RemoteStore
from vit_mpp.errors import UserError
from vit_mpp.manifest import write_manifest_url

FAILURES_NAME = "failures.jsonl"
LISTING_FAILURES_NAME = "_listing_failures.jsonl"  # inputs met while listing and not used; written by part 0


class MergeError(UserError):
    """OUT cannot be merged (no journal, parts of different builds, a part missing or unfinished); one line."""


def split_entry(name: str, records: list[dict]) -> dict:
    """The manifest's entry for one split (timm's schema plus shard_bytes and shard_sha256)."""
    shards = [s for r in records for s in r["shards"]]
    return {"name": name, "num_samples": sum(s["count"] for s in shards), "filenames": [s["filename"] for s in shards],
            "shard_lengths": [s["count"] for s in shards], "shard_bytes": [s["bytes"] for s in shards],
            "shard_sha256": [s["sha256"] for s in shards]}


def manifest(base: dict, entries: dict, num_failures: int, reasons: dict, build_id: str) -> dict:
    """The manifest: timm's `wds/` info (name, splits) extended; the same fields in the same order on every path."""
    return {"name": base["name"], "splits": entries, "num_classes": base["num_classes"],
            "class_names": base["class_names"], "source": base["source"],
            **{k: base[k] for k in ("seed", "val_fraction", "existing_splits", "shard_size", "shard_bytes")},
            "encoder": base["encoder"], "num_unlabelled": base["num_unlabelled"], "num_failures": num_failures,
            "failure_reasons": reasons, "tool_version": base["tool_version"], "fingerprint": build_id}


def _differences(a: dict, b: dict) -> str:
    """What differs between two journals' manifest fields, for the error message."""
    base_a, base_b = a.get("manifest", {}), b.get("manifest", {})
    keys = [k for k in ("seed", "val_fraction", "existing_splits", "shard_size", "shard_bytes", "encoder", "source",
                        "tool_version") if base_a.get(k) != base_b.get(k)]
    return ", ".join(f"{k} {base_a.get(k)!r} vs {base_b.get(k)!r}" for k in keys[:3]) or "the inputs listed"


def _missing_parts(num_parts: int, journals: dict[str, tuple], sizes: dict[str, int], plan_sizes: dict[str, int],
                   shard_size: int, done: set) -> list[str]:
    """One phrase per part that has not run or has not finished its ranges."""
    ran = {h["part"] for h, _ in journals.values() if h is not None and h.get("num_parts") == num_parts}
    todo: dict[int, list] = collections.defaultdict(list)
    total: collections.Counter[int] = collections.Counter()
    for r in iter_ranges(plan_sizes, shard_size):
        part = r.number % num_parts
        total[part] += 1
        if (r.split, r.index) not in done:
            todo[part].append(r)
    phrases = []
    for part in sorted(todo):
        name = f"part {part} of {num_parts}" if num_parts > 1 else "the build"
        if part not in ran:
            phrases.append(f"{name} has not run")
        else:
            first = todo[part][0]
            phrases.append(f"{name} is incomplete ({total[part] - len(todo[part])} of {total[part]} ranges done; "
                           f"first missing: {first.split} range {first.index})")
    return phrases


def finalize(store: LocalStore | RemoteStore, build_id: str | None = None) -> dict:
    """Check the journals in OUT and write failures.jsonl and the manifest; returns the manifest."""
    sizes = store.list_sizes()
    journals = read_journals(store, sizes)
    if not journals:
        raise MergeError(f"no build-shards journal in {store}: nothing to merge (run the parts first: "
                         "build-shards SOURCE OUT --num-parts N --part I)")
    unreadable = [name for name, (header, _) in journals.items() if header is None]
    if unreadable:
        raise MergeError(f"{store}/{unreadable[0]} is not a build-shards journal (its first line is damaged)")
    headers = {name: header for name, (header, _) in journals.items()}
    first_name, first = next(iter(headers.items()))
    for name, header in headers.items():
        if header["fingerprint"] != first["fingerprint"]:
            raise MergeError(f"{store} holds parts of different builds: {first_name} and {name} differ in "
                             f"{_differences(first, header)}; rebuild the odd part(s) with the same command and "
                             "--overwrite")
    if build_id is not None and first["fingerprint"] != build_id:
        raise MergeError(f"{store} holds the journals of another build")
    plan_sizes, base = first["splits"], first["manifest"]
    done: dict[tuple[str, int], dict] = {}
    for _, records in journals.values():
        for rec in records:
            key = (rec["split"], rec["range"])
            if key not in done and intact(rec, sizes):
                done[key] = rec
    counts = {h.get("num_parts", 1) for h in headers.values()}
    num_parts = counts.pop() if len(counts) == 1 else max(counts)
    missing = _missing_parts(num_parts, journals, sizes, plan_sizes, base["shard_size"], set(done))
    if missing:
        raise MergeError(f"cannot merge {store}: {'; '.join(missing)}. Run the missing part(s) (the same command "
                         "with their --part), then merge again")
    listing = _listing_failures(store, headers)
    records = {name: [] for name in plan_sizes}
    for (split, _), rec in sorted(done.items(), key=lambda kv: (list(plan_sizes).index(kv[0][0]), kv[0][1])):
        records[split].append(rec)
    failures = listing + [f for recs in records.values() for r in recs for f in r["failures"]]
    reasons = dict(sorted(collections.Counter(f["reason"] for f in failures).items()))
    entries = {name: split_entry(name, recs) for name, recs in records.items()}
    info = manifest(base, entries, len(failures), reasons, first["fingerprint"])
    store.write_text(FAILURES_NAME, "".join(json.dumps(f) + "\n" for f in failures))
    write_manifest_url(store.url, info)  # the commit point: a build without it is incomplete
    return info


def _listing_failures(store: LocalStore | RemoteStore, headers: dict[str, dict]) -> list[dict]:
    """The inputs met while listing and not used, as part 0 recorded them (checked against its journal)."""
    expected = next((h["listing_failures"] for h in headers.values() if h.get("part") == 0), None)
    text = store.read_text(LISTING_FAILURES_NAME)
    if expected is None or text is None or hashlib.sha256(text.encode()).hexdigest() != expected["sha256"]:
        raise MergeError(f"{store}/{LISTING_FAILURES_NAME} is missing or damaged: re-run part 0 (or the "
                         "one-machine build) to write it again")
    return [json.loads(line) for line in text.splitlines()]


def summary(info: dict, out: str) -> str:
    """The closing line of a build: inputs seen, written and failed, per split, by reason."""
    written = sum(e["num_samples"] for e in info["splits"].values())
    shards = sum(len(e["filenames"]) for e in info["splits"].values())
    per_split = ", ".join(f"{k}: {v['num_samples']:,}" for k, v in info["splits"].items())
    failed = info["num_failures"]
    reasons = ", ".join(f"{k} {v:,}" for k, v in info["failure_reasons"].items())
    return (f"inputs: {written + failed:,} seen, {written:,} written, {failed:,} failed"
            f"{f' ({reasons}; see {FAILURES_NAME})' if failed else ''}; {shards:,} shards in {out} ({per_split})")
