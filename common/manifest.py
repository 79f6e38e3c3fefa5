"""The shard manifest (`_info.json`): what `build-shards` writes and what training reads instead of scanning tars.

The schema is timm's `wds/` info file (so `timm.data.create_dataset("wds/...")` trains on our shards):

    {"name": ..., "splits": {"train": {"name": "train", "num_samples": N, "filenames": [...],
                                        "shard_lengths": [...]}, ...}}

extended with what a user needs to trust the shards: per-shard bytes and sha256 (`shard_bytes`, `shard_sha256`),
`class_names`, `num_classes`, `source`, `seed`, `encoder` settings and `tool_version`.
"""

from __future__ import annotations

import json
import os
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import UserError
from common.urls import is_local, join, local_path, read_url

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


def read_manifest(location: str | Path) -> dict[str, Any]:
    """Read `_info.json` from a shard directory (local path, or a URL: http(s), s3://, ... see common/urls.py)."""
    location = str(location)
    path = join(location, MANIFEST_NAME)
    if is_local(location) and not os.path.isdir(local_path(location)):
        raise ManifestError(f"shard directory not found: {location} (build it with `build-shards SOURCE OUT_DIR`)")
    try:
        info = json.loads(read_url(path))
    except urllib.error.HTTPError as e:
        raise ManifestError(f"cannot read {path}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise ManifestError(f"cannot reach {path}: {e.reason}") from None
    except FileNotFoundError:
        raise ManifestError(f"no {MANIFEST_NAME} in {location}: not a complete build-shards output") from None
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(info, dict):
        raise ManifestError(f"{path} is not a build-shards manifest (a JSON object)")
    return info


def load_split(location: str | Path, split: str) -> tuple[Split, dict[str, Any]]:
    """The named split of the shard set at `location`, with shard URLs resolved, plus the whole manifest."""
    info = read_manifest(location)
    splits = info.get("splits", {})
    if split not in splits:
        raise ManifestError(f"split '{split}' not in {join(str(location), MANIFEST_NAME)} (has: {', '.join(splits)})")
    s = splits[split]
    urls = [join(str(location), f) for f in s["filenames"]]
    lengths = [int(n) for n in s["shard_lengths"]]
    if len(urls) != len(lengths) or sum(lengths) != int(s["num_samples"]):
        raise ManifestError(f"manifest split '{split}' is inconsistent: filenames, shard_lengths, num_samples differ")
    return Split(name=split, urls=urls, lengths=lengths), info


def write_manifest(out_dir: str | Path, info: dict[str, Any]) -> None:
    """Write the manifest atomically: it is the commit point of a build, so it must never be half-written."""
    out_dir = Path(out_dir)
    tmp = out_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(info, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, out_dir / MANIFEST_NAME)


def write_manifest_url(location: str, info: dict[str, Any]) -> None:
    """Write the manifest into a local folder (as `write_manifest`) or to a URL through fsspec, as one upload that
    appears whole or not at all (common/urls.py `upload_file`); the bytes are the same either way."""
    if is_local(location):
        write_manifest(local_path(location), info)
        return
    import tempfile

    from common.urls import upload_file

    with tempfile.TemporaryDirectory(prefix="manifest-") as tmp:
        path = Path(tmp) / MANIFEST_NAME
        path.write_text(json.dumps(info, indent=1, sort_keys=False) + "\n")
        upload_file(str(path), join(location, MANIFEST_NAME))
