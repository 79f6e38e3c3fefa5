"""`build-shards subset SOURCE OUT --per-class K --seed S`: K labelled samples of each class, drawn with a seed from
one split of a shard set, written as a shard set of their own (the samples' bytes as they are, their manifest made
by `build-shards index`), for fine-tuning on few labels and for `compare --labels-per-class`. The set's other splits
are not copied: the new manifest names their shards where they are. Its fingerprint, made as a build's, lets an
identical rerun say "already complete" and write nothing. See docs/build_shards.md#subsets-a-few-labels-of-each-class.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_tools.builder.journal import fingerprint
from data_tools.builder.writer import ShardWriter
from data_tools.indexer import index_tars
from data_tools.indexer.index_tars import IndexOptions
from vit_mpp import __version__
from vit_mpp.data import urls
from vit_mpp.data.labels import BadLabel, cls_label
from vit_mpp.data.lineage import SplitOf, split_keys
from vit_mpp.data.manifest import (
    MANIFEST_NAME,
    ManifestError,
    check_manifest,
    load_split,
    manifest_classes,
    manifest_digest,
    manifest_file,
    read_manifest,
    shard_base,
    shard_url,
)
from vit_mpp.data.tar_scan import TarDamaged, TarReader, describe, samples
from vit_mpp.data.urls import ReadPolicy
from vit_mpp.durable import writing
from vit_mpp.errors import UserError
from vit_mpp.progress import progress
from vit_mpp.tools.args import check_writable_place, folder_role

SHARD_SIZE = 1000  # samples per written shard
# what a subset's manifest records of how it was drawn, and the flag that sets each: a rerun names those that differ
DRAWN_WITH = (("of", "SOURCE"), ("split", "--split"), ("per_class", "--per-class"), ("seed", "--seed"),
              ("shard_size", "--shard-size"), ("exclude", "--exclude"))


class SubsetError(UserError):
    """A subset that cannot be drawn (a split without labels, a class with fewer than K samples, an unreadable
    shard, an output that is not ours); one line, nothing written."""


@dataclass(frozen=True)
class Picked:
    """A labelled sample of the source split: where it is and its class."""

    shard: int  # index into the split's shard list
    key: str
    label: int


def _read_shard(url: str, wanted: frozenset[str] | None, keep: frozenset[str] | None, read: ReadPolicy,
                ) -> list[tuple[str, dict[str, bytes]]]:
    """(key, data) of each sample of one shard, with the bytes of the `wanted` suffixes (None: all of
    them) of the samples in `keep` (None: every sample); an unreadable shard is one SubsetError line."""
    def scan(stream: Any) -> list[tuple[str, dict[str, bytes]]]:
        reader = TarReader(stream)
        found = []
        for sample in samples(reader, wanted if wanted is not None else _ALL):
            if keep is None or sample.key in keep:
                found.append((sample.key, sample.data))
        return found

    try:
        return urls.read_stream(url, scan, read.timeout, read.retries, read.wait_s)
    except TarDamaged as e:
        raise SubsetError(f"{url}: {describe(e)}") from None
    except OSError as e:
        raise SubsetError(f"cannot read {url}: {describe(e)}") from None


class _Everything(frozenset):
    """A `wanted` set that holds every suffix: the copy keeps every member of a sample."""

    def __contains__(self, item: object) -> bool:
        return True


_ALL = _Everything()


def draw(labels: list[Picked], per_class: int, seed: int, where: str, classes: int = 0) -> list[Picked]:
    """`per_class` samples of each class, drawn with `seed` (numpy's default generator, a permutation per class in
    ascending class order), in the source's order; a class with fewer, or with none of the `classes` the manifest
    counts, is a SubsetError."""
    by_class: dict[int, list[Picked]] = {c: [] for c in range(classes)}
    for p in labels:
        by_class.setdefault(p.label, []).append(p)
    short = {c: len(v) for c, v in sorted(by_class.items()) if len(v) < per_class}
    if short:
        listed = ", ".join(f"class {c} has {n}" for c, n in list(short.items())[:5])
        advice = "give a smaller --per-class" if min(short.values()) else "each class needs samples there"
        raise SubsetError(f"--per-class {per_class}: {where} has fewer samples of {len(short)} class(es) ({listed}): "
                          + advice)
    rng = np.random.default_rng(seed)
    chosen = {id(v[i]) for _, v in sorted(by_class.items()) for i in rng.permutation(len(v))[:per_class]}
    return [p for p in labels if id(p) in chosen]


def number_problems(per_class: int, seed: int, shard_size: int) -> list[str]:
    """What is wrong with a draw's numbers, one line each (the command line's checks and `subset`'s are these)."""
    checks = [(per_class < 1, f"--per-class must be >= 1, got {per_class}"),
              # numpy's SeedSequence takes any integer >= 0, however large, and raises on a negative one
              (seed < 0, f"--seed must be >= 0 (numpy's generator takes no negative seed), got {seed}"),
              (shard_size < 1, f"--shard-size must be >= 1, got {shard_size}")]
    return [message for bad, message in checks if bad]


def draw_fingerprint(info: dict[str, Any], drawn: dict[str, Any]) -> str:
    """A subset's fingerprint, made as a build's (data_tools/builder/journal.py `fingerprint`): how it is drawn
    (`drawn`, the source where it is), the tool's version and the source's manifest (its shards, their sizes and
    sums, its classes): an identical rerun finds it in OUT's manifest and writes nothing."""
    return fingerprint(manifest_digest(info), {**drawn, "of": _absolute(drawn["of"]), "tool_version": __version__})


def check_out(out: Path, source: str, overwrite: bool) -> None:
    """OUT may be new, empty, an unfinished subset (tars, no manifest) or, with --overwrite, a finished one; never
    the source itself, nor a folder that holds anything else. A finished one without --overwrite is left to `finished`
    (this very draw, or refused)."""
    check_writable_place("OUT", out, out)
    if urls.is_local(source) and Path(urls.local_path(source)).resolve() == out.resolve():
        raise SubsetError(f"OUT {out} is the source set: write the subset into a folder of its own")
    if not out.is_dir():
        return
    if role := folder_role(out, shards=False):
        raise SubsetError(f"OUT {out} is {role}: give the subset a folder of its own")
    ours = [p for p in out.iterdir() if p.suffix in (".tar", ".tmp") or p.name == MANIFEST_NAME]
    others = sorted(p.name for p in out.iterdir() if p not in ours)
    if others:
        raise SubsetError(f"OUT {out} holds files that are not a subset's ({', '.join(others[:3])}): give an empty "
                          "or new folder")


def finished(out: Path, drawn: dict[str, Any], fp: str) -> dict[str, Any] | None:
    """The manifest of the finished subset in OUT when it is this very draw (its fingerprint is `fp`); None when OUT
    holds none (an interrupted draw: drawn again whole); a SubsetError naming what differs otherwise."""
    try:
        info = json.loads((out / MANIFEST_NAME).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):  # unreadable or torn: not this draw, and --overwrite replaces it
        info = None
    if isinstance(info, dict) and info.get("fingerprint") == fp:
        if damaged := _damaged_shards(out, info, drawn["split"]):
            print(f"warning: {out} is this draw, but {damaged}: drawn again", file=sys.stderr, flush=True)
            return None
        return info
    raise SubsetError(f"OUT {out} already holds a subset drawn otherwise ({_differences(info, drawn)}): give "
                      "--overwrite to draw it again")


def _damaged_shards(out: Path, info: dict[str, Any], split: str) -> str | None:
    """What is wrong with the shards a finished subset's manifest names (missing, or not the size it wrote), or None:
    a rerun that answered "already complete" over them would hand the next stage a set it cannot read."""
    entry = (info.get("splits") or {}).get(split) or {}
    names, sizes = entry.get("filenames") or [], entry.get("shard_bytes") or []
    for i, name in enumerate(names):
        path = out / name
        if not path.is_file():
            return f"its shard {name} is missing"
        if i < len(sizes) and path.stat().st_size != sizes[i]:
            return f"its shard {name} is {path.stat().st_size:,} bytes, not the {sizes[i]:,} it was written with"
    return None


def _differences(info: Any, drawn: dict[str, Any]) -> str:
    """How the subset `info` was drawn otherwise than `drawn`, for the refusal's line."""
    then = info.get("subset") if isinstance(info, dict) else None
    if not isinstance(then, dict) or "fingerprint" not in info:
        return f"its {MANIFEST_NAME} has no fingerprint: an older build-shards subset's, or unreadable"
    differ = []
    for key, flag in DRAWN_WITH:
        old, new = then.get(key), drawn.get(key)
        if key == "of":
            old, new = _absolute(str(old)), _absolute(new)
        elif key == "exclude":  # the sets' places; the same places holding other samples differ by their manifests
            old, new = (" ".join(e.get("of", "?") for e in v) if isinstance(v, list) else "none" for v in (old, new))
            if old == new and then.get(key) != drawn.get(key):
                differ.append(f"--exclude {new} holds other samples than when OUT was drawn")
                continue
        if old != new:
            differ.append(f"{flag} {old} there, {new} now")
    if differ:
        return "; ".join(differ)
    if info.get("tool_version") != __version__:
        return f"build-shards {info.get('tool_version')} there, {__version__} now"
    return f"SOURCE's {MANIFEST_NAME} changed since"


def excluded_keys(exclude: tuple[str, ...], split: str, out: Path, read: ReadPolicy,
                  ) -> tuple[set[str], list[dict[str, str]]]:
    """The keys of the samples of split `split` of the `exclude` sets (subsets drawn before, or any set of samples
    of the source), and what the fingerprint records of each: its place and its manifest's hash, so that a redrawn
    excluded set makes this one another draw. That every key is the source's is checked as the source is read."""
    keys: set[str] = set()
    recorded = []
    for other in exclude:
        if urls.is_local(other) and Path(urls.local_path(other)).resolve() == out.resolve():
            raise SubsetError(f"--exclude {other} is OUT itself: exclude the subsets drawn before this one")
        try:
            info = read_manifest(other)
        except ManifestError as e:
            raise SubsetError(f"--exclude {other}: {e}") from None
        if split not in info.get("splits", {}):
            raise SubsetError(f"--exclude {other} has no split '{split}' (it has: {', '.join(info.get('splits', {}))})"
                              ": exclude a subset of the split drawn from")
        try:
            keys.update(split_keys(SplitOf(other, split, info), read))
        except ManifestError as e:
            raise SubsetError(f"--exclude {other}: {e}") from None
        recorded.append({"of": _absolute(other), "manifest_sha256": manifest_digest(info)})
    return keys, recorded


@dataclass(frozen=True)
class SubsetOptions:
    """The options of `build-shards subset` other than what is drawn."""

    split: str = "train"
    overwrite: bool = False
    shard_size: int = SHARD_SIZE
    read: ReadPolicy = ReadPolicy()
    exclude: tuple[str, ...] = ()  # sets of the source's samples (subsets drawn before) not drawn again


def subset(source: str, out: Path, per_class: int, seed: int, options: SubsetOptions = SubsetOptions(),
           ) -> dict[str, Any]:
    """Draw the subset and write it (shards, then the manifest, the commit point); returns its manifest."""
    start = time.perf_counter()
    split, overwrite, shard_size, read = options.split, options.overwrite, options.shard_size, options.read
    if problems := number_problems(per_class, seed, shard_size):
        raise SubsetError(problems[0])
    info = read_manifest(source)
    check_manifest(info, manifest_file(source))
    if split not in info["splits"]:
        raise SubsetError(f"{source} has no split '{split}' (it has: {', '.join(info['splits'])})")
    if not manifest_classes(info):
        raise SubsetError(f"{source} carries no labels (its manifest counts no classes): a subset is drawn per class")
    check_out(out, source, overwrite)
    where = f"{source}:{split}"
    drawn: dict[str, Any] = {"of": source, "split": split, "per_class": per_class, "seed": seed,
                             "shard_size": shard_size}
    leave_out: set[str] = set()
    if options.exclude:  # only then in the record: the fingerprints of subsets drawn without it stay as they were
        leave_out, drawn["exclude"] = excluded_keys(options.exclude, split, out, read)
    fp = draw_fingerprint(info, drawn)
    done = None if overwrite else finished(out, drawn, fp)
    if done is not None:  # as a rerun of a complete build: one line, status 0, nothing written
        print(f"{out} is already complete ({MANIFEST_NAME}: {per_class} of each class of {where}, seed {seed}); pass "
              "--overwrite to draw it again", flush=True)
        return done
    shards, _ = load_split(source, split)
    labels: list[Picked] = []
    unlabelled = excluded = 0
    found: set[str] = set()  # the keys of leave_out met in the source
    with progress(f"reading the labels of {where}", len(shards.urls), "shards") as shown:
        for i, url in enumerate(shards.urls):
            for key, data in _read_shard(url, frozenset({"cls"}), None, read):
                if key in leave_out:
                    found.add(key)
                try:
                    label = cls_label(data.get("cls"))
                except BadLabel:
                    label = -1
                if label < 0:
                    unlabelled += 1
                elif key in leave_out:
                    excluded += 1
                else:
                    labels.append(Picked(i, key, label))
            shown(1)
    if len(found) < len(leave_out):
        raise SubsetError(f"--exclude {' '.join(options.exclude)}: {len(leave_out) - len(found):,} of its "
                          f"{len(leave_out):,} samples are not in {where}: exclude sets drawn from that split")
    if excluded and not labels:  # e.g. --exclude SRC itself, or a subset's val split, which is the source's
        raise SubsetError(f"--exclude {' '.join(options.exclude)} holds every labelled sample of {where}: nothing is "
                          "left to draw (a subset's own images are its train split; its val names the source's)")
    chosen = draw(labels, per_class, seed, where + (" less --exclude" if options.exclude else ""),
                  manifest_classes(info))

    holding: dict[int, set[str]] = {}  # the shards read again, for the drawn samples' bytes: shard -> keys
    for p in chosen:
        holding.setdefault(p.shard, set()).add(p.key)
    with writing(out), progress(f"copying {len(chosen):,} samples", len(holding), "shards") as shown:
        out.mkdir(parents=True, exist_ok=True)
        for stale in [p for p in out.iterdir() if p.suffix in (".tar", ".tmp") or p.name == MANIFEST_NAME]:
            stale.unlink()  # an earlier draw (--overwrite) or an interrupted one: replaced whole
        writer, written = None, 0
        for i, keep in sorted(holding.items()):
            for key, data in _read_shard(shards.urls[i], None, frozenset(keep), read):
                if writer is None:
                    writer = ShardWriter(out / f"{split}-{written // shard_size:06d}.tar")
                try:
                    writer.write_members([(f"{key}.{suffix}", data[suffix]) for suffix in data])
                except ValueError as e:  # a member name longer than a tar header holds
                    raise SubsetError(f"{shards.urls[i]}: sample {key}: {e}") from None
                written += 1
                if written % shard_size == 0:
                    writer.close()
                    writer = None
            shown(1)
        if writer is not None:
            writer.close()

    def record(made: dict[str, Any]) -> None:
        """The source's other splits (where they are), its classes and encoder, and how the subset was drawn."""
        base = shard_base(source, info)
        for name, entry in info["splits"].items():
            if name != split:
                made["splits"][name] = {**entry, "filenames": [_absolute(shard_url(base, f))
                                                               for f in entry["filenames"]]}
        for field in ("num_classes", "class_names", "encoder"):
            if field in info:
                made[field] = info[field]
        made["subset"] = {**drawn, "samples": len(chosen), "of_samples": len(labels),
                          "unlabelled_left_out": unlabelled, **({"excluded": excluded} if options.exclude else {})}
        made["fingerprint"] = fp

    made = index_tars.index([str(out)], [split], str(out), IndexOptions(workers=1, pool="thread", overwrite=True,
                                                                         read=read), amend=record)
    print(f"subset: {len(chosen):,} of the {len(labels):,} labelled samples of {where} ({per_class} of each of "
          f"{len({p.label for p in chosen})} classes, seed {seed}) in {out}, {time.perf_counter() - start:.1f} s"
          + (f"; {unlabelled:,} sample(s) without a label left out" if unlabelled else "")
          + (f"; {excluded:,} sample(s) of --exclude left out" if options.exclude else ""), flush=True)
    return made


def _absolute(name: str) -> str:
    return os.path.abspath(name) if urls.is_local(name) else name

