"""Where a shard set's samples come from, for telling two sets apart. `build-shards subset` records in its manifest
the set and split it drew from (the record's `of` and `split`) and copies the samples with their keys, so sets drawn
from the same split (a subset and its source, two subsets of one source, a subset of a subset) can be compared by
key. Sets of unrelated origins are not compared: keys such as `000123` repeat across sources.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, NamedTuple

from vit_mpp.data import urls
from vit_mpp.data.manifest import ManifestError, load_split, read_manifest
from vit_mpp.data.tar_scan import TarDamaged, TarReader, describe, samples
from vit_mpp.data.urls import ReadPolicy
from vit_mpp.processes.rank_lifecycle import process_rank
from vit_mpp.progress import progress

MAX_DEPTH = 16  # subsets of subsets followed at most this far (a loop of records cannot hang the check)


class SplitOf(NamedTuple):
    """One split of a shard set: its location, the split's name and the set's manifest."""

    location: str
    split: str
    info: dict[str, Any]


def same_place(a: str, b: str) -> bool:
    """Whether two locations name the same set (`sh`, `./sh`; a URL only as written)."""
    return a == b or (urls.is_local(a) and urls.is_local(b)
                      and Path(urls.local_path(a)).resolve() == Path(urls.local_path(b)).resolve())


def drawn_from(info: dict[str, Any]) -> tuple[str, str] | None:
    """(set, split) a `build-shards subset` was drawn from, as its manifest records; None for any other set."""
    drawn = info.get("subset") if isinstance(info, dict) else None
    if not isinstance(drawn, dict) or not isinstance(drawn.get("of"), str):
        return None
    return drawn["of"], str(drawn.get("split", "train"))


def origin(of: SplitOf) -> tuple[str, str]:
    """The split whose samples these are: a subset's own images (its train split) are samples of the split it was
    drawn from, followed through subsets of subsets; any other split is its own origin (a subset's other splits
    name the source's shards, which a shard comparison already tells)."""
    location, split, info = of
    for _ in range(MAX_DEPTH):
        source = drawn_from(info) if split == "train" else None
        if source is None:
            break
        location, split = source
        try:
            info = read_manifest(location)
        except (ManifestError, OSError):
            break  # the source is gone: its samples can still be compared by key with another subset of it
    return location, split


def split_keys(of: SplitOf, read: ReadPolicy = ReadPolicy()) -> set[str]:
    """The keys of every sample of the split (tar headers only, each shard under `read`'s deadline and retries), with
    progress on the first process (a large subset's hundred shards over a network take a while)."""
    keys: set[str] = set()
    shards = load_split(of.location, of.split)[0].urls
    shown = progress(f"reading the keys of {of.location}:{of.split}", len(shards), "shards") if process_rank() == 0 \
        else contextlib.nullcontext(lambda n: None)
    with shown as advance:
        for url in shards:
            try:
                keys.update(urls.read_stream(url, lambda s: [x.key for x in samples(TarReader(s))], read.timeout,
                                              read.retries, read.wait_s))
            except (TarDamaged, OSError) as e:
                raise ManifestError(f"cannot read the keys of {url}: {describe(e)}") from None
            advance(1)
    return keys


Keys = dict[tuple[str, str], set[str]]  # split_keys already read, by (location, split): one read per check


def _keys(of: SplitOf, read: ReadPolicy, known: Keys | None) -> set[str]:
    if known is None:
        return split_keys(of, read)
    place = (of.location, of.split)
    if place not in known:
        known[place] = split_keys(of, read)
    return known[place]


def shared_samples(a: SplitOf, b: SplitOf, read: ReadPolicy = ReadPolicy(), known: Keys | None = None) -> int:
    """How many samples the two splits have in common, as far as the subset records tell (0 for unrelated origins):
    all of one set's when it was drawn from the other, else the keys the two hold both (read once per `known`, a
    dict the caller keeps for the checks of one set against many)."""
    root, other = origin(a), origin(b)
    if not (same_place(other[0], root[0]) and other[1] == root[1]):
        return 0
    if same_place(a.location, root[0]) and a.split == root[1]:
        return load_split(b.location, b.split)[0].num_samples  # b was drawn from a
    if same_place(b.location, root[0]) and b.split == root[1]:
        return load_split(a.location, a.split)[0].num_samples  # a was drawn from b
    return len(_keys(a, read, known) & _keys(b, read, known))
