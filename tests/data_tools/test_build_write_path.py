"""What the workers' fast path must keep: a shard is synced before it is renamed into place (by the process that
publishes it, no longer by the worker), the tar bytes survive short writes, and the metadata JSON written by hand
is byte for byte json.dumps's."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from data_tools.builder.shard_ranges import sample_files
from data_tools.builder.sources.base import Item
from data_tools.builder.writer import ShardWriter
from data_tools.cli import main as build_main
from data_tools.demo_images import generate

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names synced files through /proc")


def test_every_shard_is_synced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst) -> None:
        real_replace(src, dst)
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)  # in this process (forked workers record into their own copy)
    monkeypatch.setattr(os, "replace", replace)
    generate(tmp_path / "src", per_class=5, size=16)
    build_main([str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "2", "--shard-size", "3",
                "--min-side", "4"])
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.tar"))
    assert len(shards) > 3
    for name in shards:
        final = str(Path(os.path.realpath(tmp_path / "out")) / name)
        (renamed,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == final]
        assert ("fsync", events[renamed][1]) in events[:renamed], f"{name} was renamed before being synced"


def test_the_shard_writer_goes_on_after_short_writes(tmp_path, monkeypatch):
    real_writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, pieces: real_writev(fd, [bytes(b"".join(pieces)[:700])]))
    samples = [(f"train_{i:09d}", {"jpg": os.urandom(n), "cls": b"3", "json": b"{}"}) for i, n in
               enumerate([0, 1, 511, 512, 513, 5000, 70_000])]
    writer = ShardWriter(tmp_path / "ours.tar")
    for key, files in samples:
        writer.write(key, files)
    count, size, digest = writer.close()
    ref = io.BytesIO()
    with tarfile.open(fileobj=ref, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "", ""
                tar.addfile(info, io.BytesIO(data))
    ours = (tmp_path / "ours.tar").read_bytes()
    assert ours == ref.getvalue() and (count, size, digest) == (7, len(ours), hashlib.sha256(ours).hexdigest())


@pytest.mark.parametrize("source_id", ["a/b.jpg", 'quo"te\\back.jpg', "é/ünï/日本.png", "bad\udcff.jpg", "tab\t.jpg"])
@pytest.mark.parametrize("label", [-1, 0, 9_999_999])
def test_the_metadata_json_is_json_dumps_sorted(source_id, label):
    files = sample_files(("ok", b"x", "jpg", 640, 480), Item(source_id, source_id, label))
    meta = {"source": source_id, "label": label, "width": 640, "height": 480}
    assert files["json"] == json.dumps(meta, sort_keys=True).encode()
