"""What OUT holds before a build writes: the files of a build (ours), and whether OUT can take this one.

A build never touches files that are not its own (a user's tars beside ours), refuses an OUT that holds another
build unless told to replace it (--overwrite), and recognises an OUT that already holds this very build.
"""

from __future__ import annotations

import json
import re

from data_tools.builder.journal import is_journal, journal_name, read_journals
from data_tools.builder.merge import FAILURES_NAME, LISTING_FAILURES_NAME, LISTING_FAILURES_PREFIX
from data_tools.builder.shard_layout import Parts
from data_tools.store import LocalStore, OutputError, RemoteStore
from vit_mpp.data.manifest import MANIFEST_NAME

SHARD_NAME = re.compile(r"^[A-Za-z0-9_]+(-p\d{5,})?-\d{6,}(-\d{4,})?\.tar(\.tmp)?$")  # ours (-p: a plan part), or
# of build-shards 0.3
LISTING_FAILURES_PART = re.compile(rf"^{LISTING_FAILURES_PREFIX}\d{{5,}}\.jsonl(\.tmp)?$")


def our_files(sizes: dict[str, int]) -> list[str]:
    """Files of a build in OUT (what --overwrite deletes on one machine): shards and their temporaries, journals,
    reports. Other files (a user's own tars in the same folder) are never touched."""
    names = {MANIFEST_NAME, FAILURES_NAME, LISTING_FAILURES_NAME}
    return sorted(n for n in sizes if SHARD_NAME.match(n) or n.removesuffix(".tmp") in names
                  or is_journal(n.removesuffix(".tmp")) or LISTING_FAILURES_PART.match(n))


def prepare_out(store: LocalStore | RemoteStore, build_id: str, parts: Parts, overwrite: bool,
                ) -> tuple[dict | None, dict[str, int]]:
    """Check what OUT holds for the build whose fingerprint is `build_id`; with `overwrite`, delete what this run
    replaces. Returns (the manifest when OUT already holds this very build, the listing of OUT)."""
    sizes = store.list_sizes()
    journals = read_journals(store, sizes)
    foreign = [n for n, (h, _) in journals.items() if h is None or h["fingerprint"] != build_id]
    if overwrite:
        if parts.count == 1:
            store.delete(our_files(sizes))
        else:
            store.delete([n for n in (MANIFEST_NAME, FAILURES_NAME, journal_name(parts), *foreign) if n in sizes])
        return None, store.list_sizes()
    if MANIFEST_NAME in sizes:
        try:
            info = json.loads(store.read_text(MANIFEST_NAME) or "")
        except json.JSONDecodeError:
            info = {}
        if isinstance(info, dict) and info.get("fingerprint") == build_id:
            return info, sizes
        raise OutputError(f"{store} holds a finished build of other inputs or settings; pass --overwrite to "
                          "replace it")
    if foreign:
        raise OutputError(f"{store} holds (part of) a build of other inputs or settings ({foreign[0]}); pass "
                          "--overwrite to replace it")
    if not journals and [n for n in sizes if SHARD_NAME.match(n) or n == FAILURES_NAME]:
        raise OutputError(f"{store} holds files of another build; pass --overwrite to replace them")
    return None, sizes
