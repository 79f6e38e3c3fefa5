"""Finishing a build (`build-shards merge OUT`; a one-machine build does it itself): check that every range of every
split is journaled and in OUT, then write failures.jsonl and, last, `_info.json`, the commit point (`finalize`).
What it writes depends only on the journals. See docs/build_shards.md#parts-on-any-scheduler.
"""

from __future__ import annotations

import collections
import hashlib
import json

from data_tools.builder.journal import intact, read_journals
from data_tools.builder.shard_layout import iter_ranges
from data_tools.store import LocalStore, RemoteStore
from vit_mpp.data.manifest import write_manifest_url
from vit_mpp.errors import UserError

FAILURES_NAME = "failures.jsonl"
LISTING_FAILURES_NAME = "_listing_failures.jsonl"  # inputs met while listing and not used; written by part 0
LISTING_FAILURES_PREFIX = "_listing_failures-p"  # with plan parts: one file per plan part, `..-p00003.jsonl`


class MergeError(UserError):
    """OUT cannot be merged (no journal, parts of different builds, a part missing or unfinished); one line."""


class NothingWritten(UserError):
    """Every input of a build failed, so its shards hold no sample: most often a mistaken option (`--min-side`) or a
    SOURCE of no images. The output and its failures.jsonl are kept, for the reasons."""


def split_entry(name: str, records: list[dict]) -> dict:
    """The manifest's entry for one split (timm's schema plus shard_bytes and shard_sha256, and `num_unlabelled`
    where samples were written without a label, so fine-tuning can refuse the split before it starts)."""
    shards = [s for r in records for s in r["shards"]]
    entry = {"name": name, "num_samples": sum(s["count"] for s in shards),
             "filenames": [s["filename"] for s in shards], "shard_lengths": [s["count"] for s in shards],
             "shard_bytes": [s["bytes"] for s in shards], "shard_sha256": [s["sha256"] for s in shards]}
    unlabelled = [r.get("unlabelled") for r in records]
    if all(isinstance(n, int) for n in unlabelled) and sum(unlabelled):  # ranges of older builds do not say
        entry["num_unlabelled"] = sum(unlabelled)
    return entry


def manifest(base: dict, entries: dict, num_failures: int, reasons: dict, build_id: str) -> dict:
    """The manifest: timm's `wds/` info (name, splits) extended; the same fields in the same order on every path
    (`plan_parts` only in builds with plan parts)."""
    return {"name": base["name"], "splits": entries, "num_classes": base["num_classes"],
            "class_names": base["class_names"], "source": base["source"],
            **{k: base[k] for k in ("seed", "val_fraction", "existing_splits", "shard_size", "shard_bytes",
                                    "plan_parts") if k in base},
            "encoder": base["encoder"], "num_unlabelled": base["num_unlabelled"], "num_failures": num_failures,
            "failure_reasons": reasons, "tool_version": base["tool_version"], "fingerprint": build_id}


def _differences(a: dict, b: dict) -> str:
    """What differs between two journals' manifest fields, for the error message."""
    base_a, base_b = a.get("manifest", {}), b.get("manifest", {})
    keys = [k for k in ("seed", "val_fraction", "existing_splits", "shard_size", "shard_bytes", "plan_parts",
                        "encoder", "source", "tool_version") if base_a.get(k) != base_b.get(k)]
    return ", ".join(f"{k} {base_a.get(k)!r} vs {base_b.get(k)!r}" for k in keys[:3]) or "the inputs listed"


def _missing_phrases(num_parts: int, ran: set[int], todo: dict[int, list], total: dict[int, int],
                     unlisted: frozenset[int] = frozenset()) -> list[str]:
    """One phrase per part that has not run (not in `ran`, or with plan parts nobody listed: `unlisted`) or has
    ranges `todo` (of `total`) left."""
    phrases = []
    for part in sorted(set(todo) | unlisted):
        name = f"part {part} of {num_parts}" if num_parts > 1 else "the build"
        if part not in ran or part in unlisted:
            phrases.append(f"{name} has not run")
        else:
            first = todo[part][0]
            where = f"plan part {first.group} " if first.group is not None else ""
            phrases.append(f"{name} is incomplete ({total[part] - len(todo[part])} of {total[part]} ranges done; "
                           f"first missing: {where}{first.split} range {first.index})")
    return phrases


def _ran(journals: dict[str, tuple], num_parts: int) -> set[int]:
    """The parts of `num_parts` that have a journal."""
    return {h["part"] for h, _ in journals.values() if h is not None and h.get("num_parts") == num_parts}


def _missing_parts(num_parts: int, journals: dict[str, tuple], plan_sizes: dict[str, int], shard_size: int,
                   done: set) -> list[str]:
    """One phrase per part that has not run or has not finished its ranges."""
    todo: dict[int, list] = collections.defaultdict(list)
    total: collections.Counter[int] = collections.Counter()
    for r in iter_ranges(plan_sizes, shard_size):
        part = r.number % num_parts
        total[part] += 1
        if r.key not in done:
            todo[part].append(r)
    return _missing_phrases(num_parts, _ran(journals, num_parts), todo, total)


def _num_parts(headers: dict[str, dict]) -> int:
    """The number of parts the build was run as (the largest, if runs used several)."""
    counts = {h.get("num_parts", 1) for h in headers.values()}
    return counts.pop() if len(counts) == 1 else max(counts)


def _done_ranges(journals: dict[str, tuple], sizes: dict[str, int], counts=lambda header, record: True) -> dict:
    """(plan part, split, range) -> the first journaled record of it whose shards are all in OUT (and that
    `counts`)."""
    done: dict[tuple, dict] = {}
    for header, records in journals.values():
        for rec in records:
            key = (rec.get("group"), rec["split"], rec["range"])
            if key not in done and intact(rec, sizes) and counts(header, rec):
                done[key] = rec
    return done


def _classic(store: LocalStore | RemoteStore, journals: dict[str, tuple], headers: dict[str, dict],
             sizes: dict[str, int]) -> tuple[dict[str, list[dict]], list[dict], dict]:
    """(records of each split in manifest order, listing failures, manifest fields) of a build without plan parts."""
    first = next(iter(headers.values()))
    plan_sizes, base = first["splits"], first["manifest"]
    done = _done_ranges(journals, sizes)
    missing = _missing_parts(_num_parts(headers), journals, plan_sizes, base["shard_size"], set(done))
    if missing:
        raise MergeError(f"cannot merge {store}: {'; '.join(missing)}. Run the missing part(s) (the same command "
                         "with their --part), then merge again")
    expected = next((h["listing_failures"] for h in headers.values() if h.get("part") == 0), None)
    listing = _read_listing_failures(store, LISTING_FAILURES_NAME, expected, "part 0 (or the one-machine build)")
    records: dict[str, list[dict]] = {name: [] for name in plan_sizes}
    for (_, split, _), rec in sorted(done.items(), key=lambda kv: (list(plan_sizes).index(kv[0][1]), kv[0][2])):
        records[split].append(rec)
    return records, listing, base


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
    collect = _planned if "plan_parts" in first else _classic
    records, listing, base = collect(store, journals, headers, sizes)
    failures = listing + [f for recs in records.values() for r in recs for f in r["failures"]]
    reasons = dict(sorted(collections.Counter(f["reason"] for f in failures).items()))
    entries = {name: split_entry(name, recs) for name, recs in records.items()}
    info = manifest(base, entries, len(failures), reasons, first["fingerprint"])
    store.write_text(FAILURES_NAME, "".join(json.dumps(f) + "\n" for f in failures))
    write_manifest_url(store.url, info)  # the commit point: a build without it is incomplete
    return info


def _read_listing_failures(store: LocalStore | RemoteStore, name: str, expected: dict | None, who: str,
                           ) -> list[dict]:
    """The inputs met while listing and not used, as recorded in `name` (checked against the journal's sha256)."""
    text = store.read_text(name)
    if expected is None or text is None or hashlib.sha256(text.encode()).hexdigest() != expected["sha256"]:
        raise MergeError(f"{store}/{name} is missing or damaged: re-run {who} to write it again")
    return [json.loads(line) for line in text.splitlines()]


# ------------------------------------------------------------ builds with plan parts (data_tools/builder/plan_parts.py)

def listing_failures_name(group: int) -> str:
    """The file in OUT with the inputs that plan part `group`'s listing met and did not use (its part writes it)."""
    return f"{LISTING_FAILURES_PREFIX}{group:05d}.jsonl"


def unlabelled_mix(infos: list[dict], mode: str, where: str) -> str | None:
    """Why plan parts with labels beside inputs without cannot be built (--unlabelled-rows error), or None."""
    labelled = sum(i["num_labelled"] for i in infos)
    inputs = sum(i["num_inputs"] for i in infos)
    if mode == "error" and 0 < labelled < inputs:
        return (f"{inputs - labelled:,} of {inputs:,} inputs of {where} have no label while the others have one; "
                "pass --unlabelled-rows skip to leave them out, or --unlabelled-rows keep to write them without a "
                "label (pretraining only)")
    return None


def _plan_part_infos(headers: dict[str, dict]) -> dict[int, dict]:
    """Plan part -> its record, from the journals' headers; two journals that listed a plan part differently (its
    files changed in between, keeping their sizes) are refused."""
    infos: dict[int, tuple[dict, str]] = {}
    for name, header in headers.items():
        for key, info in header["groups"].items():
            seen = infos.setdefault(int(key), (info, name))
            if seen[0]["digest"] != info["digest"]:
                raise MergeError(f"plan part {key} was listed with other contents by {seen[1]} and {name} (its files "
                                 "changed in between): rebuild the part that owns it with --overwrite")
    return {g: info for g, (info, _) in infos.items()}


def _planned(store: LocalStore | RemoteStore, journals: dict[str, tuple], headers: dict[str, dict],
             sizes: dict[str, int]) -> tuple[dict[str, list[dict]], list[dict], dict]:
    """As `_classic`, for a build with plan parts: every plan part must be listed and all of its ranges done; the
    manifest's counts (classes, inputs, unlabelled) are summed over the plan parts."""
    first = next(iter(headers.values()))
    infos = _plan_part_infos(headers)
    done = _done_ranges(journals, sizes, lambda header, rec: header["groups"].get(str(rec.get("group")), {}).get(
        "digest") == infos[rec["group"]]["digest"])
    num_parts, base = _num_parts(headers), dict(first["manifest"])
    todo: dict[int, list] = collections.defaultdict(list)
    total: collections.Counter[int] = collections.Counter()
    for g in infos:
        for r in iter_ranges(infos[g]["splits"], base["shard_size"], g):
            total[g % num_parts] += 1
            if r.key not in done:
                todo[g % num_parts].append(r)
    unlisted = frozenset(g % num_parts for g in range(first["plan_parts"]) if g not in infos)
    missing = _missing_phrases(num_parts, _ran(journals, num_parts), todo, total, unlisted)
    problem = unlabelled_mix(list(infos.values()), first["unlabelled_rows"], base["source"]["path"])
    if missing or problem:
        raise MergeError(f"cannot merge {store}: {'; '.join(missing)}. Run the missing part(s) (the same command "
                         "with their --part), then merge again" if missing else f"cannot merge {store}: {problem}")
    listing = [f for g in sorted(infos) for f in _read_listing_failures(
        store, listing_failures_name(g), infos[g]["listing_failures"], f"the part that owns plan part {g}")]
    labelled = sum(i["num_labelled"] for i in infos.values())
    inputs = sum(i["num_inputs"] for i in infos.values())
    classes = max(i["max_label"] for i in infos.values()) + 1 if labelled else 0
    repeated = sum(i.get("num_repeated", 0) for i in infos.values())  # absent in journals from before the count
    base.update(num_classes=classes, class_names=[str(c) for c in range(classes)],
                source={**base["source"], "num_inputs": inputs, **({"num_repeated": repeated} if repeated else {})},
                num_unlabelled=inputs - labelled if labelled else 0)
    names = {n for i in infos.values() for n in i["splits"]}
    order = [n for n in ("train", "val") if n in names] if not base["existing_splits"] else sorted(names)
    records: dict[str, list[dict]] = {name: [] for name in order}
    for (_, split, _), rec in sorted(done.items(), key=lambda kv: (order.index(kv[0][1]), kv[0][0], kv[0][2])):
        records[split].append(rec)
    return records, listing, base


def _outcome(info: dict) -> tuple[int, int, str]:
    """(inputs written, inputs failed, the failures by reason as `reason N, ...`) of a finished build."""
    written = sum(e["num_samples"] for e in info["splits"].values())
    reasons = ", ".join(f"{k} {v:,}" for k, v in info["failure_reasons"].items())
    return written, info["num_failures"], reasons


def check_written(info: dict, out: str) -> None:
    """Raise NothingWritten when the finished build holds no sample although inputs were seen."""
    written, failed, reasons = _outcome(info)
    if failed and not written:
        raise NothingWritten(f"none of the {failed:,} inputs could be written ({reasons}): the reason of each is in "
                             f"{out.rstrip('/')}/{FAILURES_NAME}")


def summary(info: dict, out: str) -> str:
    """The closing line of a build: inputs seen, written and failed, per split, by reason."""
    written, failed, reasons = _outcome(info)
    shards = sum(len(e["filenames"]) for e in info["splits"].values())
    per_split = ", ".join(f"{k}: {v['num_samples']:,}" for k, v in info["splits"].items())
    return (f"inputs: {written + failed:,} seen, {written:,} written, {failed:,} failed"
            f"{f' ({reasons}; see {FAILURES_NAME})' if failed else ''}; {shards:,} shards in {out} ({per_split})")


def conclude(info: dict, out: str) -> None:
    """The end of a build (or a merge) that finished: its closing line, then NothingWritten if no input was
    written."""
    print(summary(info, out))
    check_written(info, out)
