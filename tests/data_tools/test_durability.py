"""The commit point of a build is durable: `_info.json` is on disk before it appears under its name.

A crash (power loss) right after the rename must not leave a manifest that names shards but reads empty or torn:
its bytes are synced before the rename, and the folder after it (vit_mpp/durable.py). What the manifest depends on
(failures.jsonl) is in place before it. Checked by recording every `os.fsync` and `os.replace` of the main process,
for a one-machine build and for a merge of parts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from data_tools.cli import main as build_main
from data_tools.demo_images import generate
from vit_mpp.data.manifest import MANIFEST_NAME

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names synced files through /proc")


@pytest.fixture
def disk_events(monkeypatch) -> list[tuple]:
    """("fsync", path, bytes of a synced manifest or None) and ("replace", src, dst), in the order they happen."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        path = os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))
        data = Path(path).read_bytes() if MANIFEST_NAME in os.path.basename(path) else None
        events.append(("fsync", path, data))
        real_fsync(fd)

    def replace(src, dst) -> None:
        real_replace(src, dst)
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def check_committed_durably(events: list[tuple], out: Path) -> None:
    """The manifest's final bytes were synced under the temporary name, then renamed, then the folder synced; and
    failures.jsonl was in place (synced, renamed, folder synced) before the manifest was renamed."""
    out = Path(os.path.realpath(out))
    manifest, failures = str(out / MANIFEST_NAME), str(out / "failures.jsonl")
    final = (out / MANIFEST_NAME).read_bytes()
    renamed = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == manifest]
    assert len(renamed) == 1, events
    commit = renamed[0]
    src = events[commit][1]
    assert any(e == ("fsync", src, final) for e in events[:commit]), "the manifest was renamed before being synced"
    assert ("fsync", str(out), None) in events[commit + 1:], "the folder was not synced after the manifest's rename"
    before = events[:commit]
    moved = [i for i, e in enumerate(before) if e[0] == "replace" and e[2] == failures]
    assert moved, "failures.jsonl was not in place before the manifest"
    assert any(e[0] == "fsync" and e[1] == events[moved[-1]][1] for e in before[:moved[-1]])
    assert ("fsync", str(out), None) in before[moved[-1] + 1:]


def test_a_one_machine_build_syncs_the_manifest_before_naming_it(tmp_path, disk_events):
    generate(tmp_path / "src", per_class=3, size=16)
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "1", "--shard-size", "4",
                "--min-side", "4"])
    check_committed_durably(disk_events, tmp_path / "out")


def test_a_merge_syncs_the_manifest_before_naming_it(tmp_path, disk_events):
    generate(tmp_path / "src", per_class=3, size=16)
    for part in ("0", "1"):
        build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "1", "--shard-size", "4",
                    "--min-side", "4", "--num-parts", "2", "--part", part])
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    disk_events.clear()
    build_main(["merge", str(tmp_path / "out")])
    check_committed_durably(disk_events, tmp_path / "out")
