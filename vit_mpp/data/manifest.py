"""The shard manifest (`_info.json`): what `build-shards` writes and what training reads instead of scanning tars,
timm's `wds/` info file extended with what a user needs to trust the shards. `read_manifest`, `load_split`,
`write_manifest`, and `check_manifest`, the one check of a whole manifest that training, evaluation and
`build-shards inspect` share. See docs/build_shards.md#manifest-_infojson.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vit_mpp.data.labels import MAX_CLASSES
from vit_mpp.data.urls import is_local, join, local_path, read_url
from vit_mpp.durable import write_atomic
from vit_mpp.errors import UserError

MANIFEST_NAME = "_info.json"


class ManifestError(UserError):
    """The shard directory or its manifest is missing or unusable; the message is one line."""


@dataclass(frozen=True)
class Split:
    """One split of a shard set: shard URLs (in manifest order) and their sample counts."""

    name: str
    urls: list[str]
    lengths: list[int]

    @property
    def num_samples(self) -> int:
        return sum(self.lengths)


def manifest_file(location: str | Path) -> str:
    """Where the manifest of a shard set is: `location` itself when it names a `.json` file (a manifest written
    elsewhere, e.g. by `build-shards index --out` for read-only shards), else `location/_info.json`."""
    location = str(location)
    return location if location.endswith(".json") else join(location, MANIFEST_NAME)


def check_location(location: str | Path) -> None:
    """A local shard set (its folder, or its manifest file) must exist: a ManifestError, one line, otherwise. A URL
    is not checked here (reading it is: vit_mpp/data/urls.py). Imports no torch: the stages check their config's
    sets with it before torch is imported."""
    location = str(location)
    if is_local(location) and not os.path.exists(local_path(location)):
        what = "manifest" if location.endswith(".json") else "shard directory"
        raise ManifestError(f"{what} not found: {location} (build shards with `build-shards SOURCE OUT_DIR`, or "
                            "index shards you have with `build-shards index LOCATION`)")


def read_manifest(location: str | Path) -> dict[str, Any]:
    """Read the manifest of the shard set at `location` (a folder or URL, or the manifest file itself; local, or
    http(s), s3://, ... see vit_mpp/data/urls.py)."""
    location = str(location)
    path = manifest_file(location)
    check_location(location)
    try:
        info = json.loads(read_url(path))
    except urllib.error.HTTPError as e:
        raise ManifestError(f"cannot read {path}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise ManifestError(f"cannot reach {path}: {e.reason}") from None
    except (FileNotFoundError, NotADirectoryError):
        raise ManifestError(f"no {MANIFEST_NAME} in {location}: not a complete build-shards output (shards made "
                            "by another tool need `build-shards index` first)") from None
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(info, dict):
        raise ManifestError(f"{path} is not a build-shards manifest (a JSON object)")
    return info


def shard_base(location: str | Path, info: dict[str, Any]) -> str:
    """The folder or URL a manifest's shard filenames are relative to: its `location` field when it has one (a
    manifest written away from its shards), else the folder that holds it."""
    base = info.get("location")
    if isinstance(base, str) and base:
        return base
    location = str(location)
    if location.endswith(".json"):
        return location.rsplit("/", 1)[0] if not is_local(location) else (os.path.dirname(location) or ".")
    return location


def shard_url(base: str, name: str) -> str:
    """Where the manifest's shard `name` is: as it is when absolute (a path or a URL), else inside `base`."""
    return name if not is_local(name) or os.path.isabs(name) else join(base, name)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_manifest(info: dict[str, Any], where: str) -> None:
    """The manifest's structure, checked before anything relies on it: a damaged or hand-edited one is a one-line
    ManifestError naming what is wrong, never a traceback or a silently wrong run (the one check training,
    evaluation and `build-shards inspect` share)."""
    def bad(why: str) -> ManifestError:
        return ManifestError(f"{where} is not a usable build-shards manifest: {why}")

    splits = info.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise bad("no 'splits'")
    for name, split in splits.items():
        if not isinstance(split, dict):
            raise bad(f"split '{name}' is not an object")
        files, lengths = split.get("filenames"), split.get("shard_lengths")
        if not isinstance(files, list) or not isinstance(lengths, list) or len(files) != len(lengths):
            raise bad(f"split '{name}': 'filenames' and 'shard_lengths' must be lists of the same length")
        # a shard is named as build-shards and index write it: a name in the manifest's folder, or absolute
        if not all(isinstance(f, str) and f and ("/" not in f or os.path.isabs(f) or not is_local(f)) for f in files):
            raise bad(f"split '{name}': a file name is not a plain name, an absolute path or a URL")
        if len(set(files)) != len(files):
            twice = next(f for i, f in enumerate(files) if f in files[:i])
            raise bad(f"split '{name}': shard {twice} is listed twice (its samples would be read twice as often)")
        if not all(_is_count(n) for n in lengths):
            raise bad(f"split '{name}': 'shard_lengths' must be counts")
        if split.get("num_samples") != sum(lengths):
            raise bad(f"split '{name}': 'num_samples' ({split.get('num_samples')}) is not the sum of "
                      f"'shard_lengths' ({sum(lengths)})")
        for key in ("shard_bytes", "shard_sha256"):
            if key in split and (not isinstance(split[key], list) or len(split[key]) != len(files)):
                raise bad(f"split '{name}': '{key}' must be a list as long as 'filenames'")
    if not _is_count(info.get("num_classes", 0)) or info.get("num_classes", 0) > MAX_CLASSES:
        raise bad(f"'num_classes' must be a count up to {MAX_CLASSES}, not {info.get('num_classes')!r}")
    names = info.get("class_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad("'class_names' must be a list of names")
    if names and info.get("num_classes") and len(names) != info["num_classes"]:
        raise bad(f"'class_names' names {len(names)} classes but 'num_classes' is {info['num_classes']}")


def manifest_digest(info: dict[str, Any]) -> str:
    """A manifest's contents as one hash (sha256 of its canonical JSON): what tells a set changed, or another set,
    in a fingerprint or a record of it."""
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()


def manifest_classes(info: dict[str, Any]) -> int:
    """How many classes a (checked) manifest counts: its `num_classes`, or the length of its `class_names`."""
    return info.get("num_classes") or len(info.get("class_names") or [])


def check_every_sample_labelled(location: str | Path, info: dict[str, Any], split: str) -> None:
    """Refuse a split of a set whose manifest says it is unlabelled, or counts samples without a usable label
    (`build-shards index` counts them per split, and so does a build with `--unlabelled-rows keep`), before anything
    starts: a classifier's stream would stop at the first of them (for an evaluation split, after an epoch)."""
    # A set the manifest says is unlabelled: a build with no labels (num_classes 0), or shards `index` found no
    # label in (it writes num_classes only where labels exist). Other manifests (timm's) may not say.
    if info.get("num_classes") == 0 or (info.get("indexed") is True and "num_classes" not in info):
        raise ManifestError(f"split '{split}' of {location} carries no labels (its manifest counts no classes): a "
                            "classifier needs a label on every sample; pretraining accepts them")
    entry = info["splits"][split]
    missing, bad = (n if _is_count(n) else 0 for n in (entry.get("num_unlabelled"), entry.get("num_bad_labels")))
    if missing or bad:
        which = (f" ({bad:,} of them with a .cls that is not a class index; the manifest lists their keys)" if bad
                 else "")
        raise ManifestError(f"split '{split}' of {location} has {max(missing, bad):,} sample(s) without a usable "
                            f"label{which}: a classifier needs a label on every sample; pretraining accepts them")


def load_split(location: str | Path, split: str) -> tuple[Split, dict[str, Any]]:
    """The named split of the shard set at `location`, with shard URLs resolved, plus the whole manifest."""
    if not str(location).strip():
        raise ManifestError("data.shards is not set: give the folder or URL of a build-shards output")
    info = read_manifest(location)
    where = manifest_file(location)
    check_manifest(info, where)
    if split not in info["splits"]:
        raise ManifestError(f"split '{split}' not in {where} (has: {', '.join(info['splits'])})")
    s = info["splits"][split]
    base = shard_base(location, info)
    urls = [shard_url(base, f) for f in s["filenames"]]
    return Split(name=split, urls=urls, lengths=s["shard_lengths"]), info


def manifest_text(info: dict[str, Any]) -> str:
    """The manifest as written, the same text wherever it goes (a one-machine build and a merge compare equal)."""
    return json.dumps(info, indent=1, sort_keys=False) + "\n"


def write_manifest(out_dir: str | Path, info: dict[str, Any]) -> None:
    """Write the manifest atomically and durably (synced before it appears under its name): it is the commit point
    of a build, so it must never be half-written, nor named before its bytes are on disk."""
    write_atomic(Path(out_dir) / MANIFEST_NAME, manifest_text(info))


# The loaders build-shards records for a dataset read from the Hugging Face Hub by name (not from a local copy).
HUB_LOADERS = ("hub", "hub-stream")


def data_record(location: str | Path, info: dict[str, Any]) -> dict[str, Any]:
    """What an export records about the shards it was trained on (for model cards, and for predict, which prepares
    images with the same encoder settings). `hf_dataset` is the Hub dataset the shards were built from, if any."""
    source = info.get("source") if isinstance(info.get("source"), dict) else {}
    hub = source.get("kind") == "hf" and source.get("loader") in HUB_LOADERS
    return {"shards": str(location), "name": info.get("name"), "source": source.get("kind"),
            "hf_dataset": source.get("path") if hub else None,
            "splits": {k: v.get("num_samples") for k, v in (info.get("splits") or {}).items()},
            "encoder": info.get("encoder"), "tool_version": info.get("tool_version")}


def write_manifest_url(location: str, info: dict[str, Any]) -> None:
    """Write the manifest into a local folder (as `write_manifest`) or to a URL through fsspec, as one upload that
    appears whole or not at all (vit_mpp/data/uploads.py `upload_file`); the bytes are the same either way.
    `location` may also name the `.json` file itself (see `manifest_file`)."""
    target = manifest_file(location)
    if is_local(location):
        write_atomic(local_path(target), manifest_text(info))
        return
    import tempfile

    from vit_mpp.data.uploads import upload_file

    with tempfile.TemporaryDirectory(prefix="manifest-") as tmp:
        path = Path(tmp) / MANIFEST_NAME
        path.write_text(manifest_text(info))
        upload_file(str(path), target)
