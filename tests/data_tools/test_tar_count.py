"""The compiled walker of `build-shards index` (data_tools/indexer/tar_walker.py) gives what the Python reader gives, on
every kind of member, label and damage, however the stream is cut into pieces; it leaves to the Python reader
only what it does not cover, and reads the common shards itself. Also the read-ahead stream it reads through
(vit_mpp/data/urls.py): the same bytes, the same deadline, and a close that does not wait for a stalled read."""

from __future__ import annotations

import dataclasses
import gzip
import io
import random
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from data_tools.cli import main as build_main
from data_tools.indexer import count_shard as shard_index
from data_tools.indexer import index_tars as index_shards
from data_tools.indexer.count_shard import ShardIndex, _scan, index_shard
from data_tools.indexer.find_tars import ShardRef
from data_tools.indexer.index_tars import AUTO_COMPILED_BYTES, IndexOptions, check_reader, chosen_reader
from tests.helpers.servers import FaultyHandler, serve_faulty
from tests.helpers.shards import make_tar
from vit_mpp.data import urls

pytest.importorskip("numba")
from data_tools.indexer import tar_walker as tar_count  # noqa: E402  (after the skip: it is only usable with numba)


def tar_of(members: list[tuple[str, bytes] | tarfile.TarInfo], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    """A tar of (name, data) files and ready-made TarInfos (directories, links)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
                continue
            name, data = m
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def img2dataset(samples: int = 20, labels: bool = False, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    members: list = []
    for i in range(samples):
        key = f"{seed:05d}{i:04d}"
        members += [(f"{key}.jpg", rng.bytes(int(rng.integers(1, 3000)))), (f"{key}.txt", b"a caption"),
                    (f"{key}.json", b'{"key": "%s"}' % key.encode())]
        if labels:
            members.append((f"{key}.cls", b"%d" % (i % 7)))
    return tar_of(members)


def webdataset_writer(samples: int = 20, seed: int = 0) -> bytes:
    """Shards as webdataset's TarWriter (and so img2dataset) writes them: a pax header before every member, for
    its float mtime."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with wds.TarWriter(out) as sink:
        for i in range(samples):
            sink.write({"__key__": f"{seed:05d}{i:04d}", "jpg": rng.bytes(int(rng.integers(1, 3000))),
                        "txt": b"a caption", "json": b"{}", "cls": b"%d" % (i % 5)})
    return out.getvalue()


def pax_tar(members: list[tuple[str, bytes, dict[str, str]]], global_records: dict[str, str] | None = None) -> bytes:
    """A pax tar of (name, data, records) files (a name ending in / is a folder); `global_records`: a global header
    first."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers=global_records) as tar:
        for name, data, records in members:
            info = tarfile.TarInfo(name.rstrip("/"))
            info.size, info.pax_headers = len(data), dict(records)
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


TIMES = {"mtime": "1795598757.2230012", "atime": "1795598757.5", "ctime": "1795598757.25"}  # tar --format=posix's


def directory(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


def symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def by_python(path: Path) -> ShardIndex:
    return index_shard(str(path), reader="python")


def by_compiled(path: Path) -> ShardIndex:
    return index_shard(str(path), reader="compiled")


def same(path: Path) -> ShardIndex:
    """Both readers' results for one file, asserted equal (but for the note of a shard read again); the
    compiled reader's."""
    python, compiled = by_python(path), by_compiled(path)
    assert dataclasses.replace(compiled, read_again="") == python
    return compiled


# Shards the walker reads itself: what img2dataset, webdataset's TarWriter, timm's shards and tar(1) write
WALKED = {
    "img2dataset": img2dataset(30),
    "labelled": img2dataset(30, labels=True),
    "gnu": tar_of([("k1.jpg", b"x" * 700), ("k1.cls", b"4"), ("k2.png", b"y")], tarfile.GNU_FORMAT),
    "pax, short names": tar_of([("k1.jpg", b"x" * 700), ("k1.cls", b"4")], tarfile.PAX_FORMAT),
    "folders and links": tar_of([directory("a"), ("a/k1.jpg", b"1"), ("a/k1.txt", b"t"), symlink("a/k1.lnk", "x"),
                                 ("a.b/c/k2.webp", b"2"), ("a.b/c/k2.cls", b"2")]),
    "upper case, two images, dotted suffix": tar_of([("k1.PNG", b"1"), ("k1.JpG", b"1"), ("k1.seg.png", b"s"),
                                                     ("k2.Cls", b"3"), ("k2.jpeg", b"j")]),
    "members passed over": tar_of([("README", b"r"), (".hidden.jpg", b"h"), ("k1.jpg", b"1"), ("noext", b"n")]),
    "no image": tar_of([(f"k{i}.txt", b"t") for i in range(8)] + [("k9.jpg", b"9")]),
    "non-ASCII key": tar_of([("ключ.png", b"1"), ("ключ.json", b"{}"), ("k\xe9y.jpg", b"2")]),
    "labels as int() reads them": tar_of([
        item for i, text in enumerate([b"3", b" 7\n", b"+2", b"-1", b"-0", b"0012", b"\x0b5\x0c", b"9999999"])
        for item in ((f"k{i}.jpg", b"i"), (f"k{i}.cls", text))]),
    "no end blocks": tar_of([("k1.jpg", b"1" * 600)])[:1536],
    "webdataset's TarWriter (pax mtimes)": webdataset_writer(30),
    "tar --format=posix (pax times, a global header)": pax_tar(
        [("k1.jpg", b"1" * 700, TIMES), ("k1.cls", b"3", TIMES), ("k2.png", b"2", {"uname": "ü" * 40}),
         ("k2.txt", b"t", {"SCHILY.xattr.user.x": "v", "comment": "a=b c\n"})], {"comment": "made by tar"}),
    "pax records before a folder and at the end": pax_tar([("k1.jpg", b"1", TIMES), ("d/", b"", TIMES)]),
    "padding after the end": tar_of([("k1.jpg", b"1")]) + b"\x00" * 10240 + b"garbage",
}

# Shards the walker leaves to the Python reader, with why
LEFT = {
    "long names (GNU)": (tar_of([("k1.jpg", b"1"), ("x" * 120 + ".jpg", b"2")], tarfile.GNU_FORMAT),
                         "an extended header"),
    "long names (pax)": (tar_of([("k1.jpg", b"1"), ("x" * 120 + ".jpg", b"2")], tarfile.PAX_FORMAT),
                         "pax records"),
    "a pax path": (pax_tar([("k1.jpg", b"1", {}), ("k2.jpg", b"2", {"path": "k3.jpg"})]), "pax records"),
    "a global pax path": (pax_tar([("k1.jpg", b"1", {})], {"path": "k3.jpg"}), "pax records"),
    "a pax size": (pax_tar([("k1.jpg", b"1", {"size": "1"})]), "pax records"),
    "pax records too long to parse": (pax_tar([("k1.jpg", b"1", {"comment": "c" * tar_count.MAX_PAX})]),
                                      "pax records"),
    "a pax record longer than the header": (pax_tar([("k1.jpg", b"1", {"comment": "abc"})]).replace(
        b"15 comment=abc\n", b"99 comment=abc\n"), "pax records"),
    "the reader's own dialect tests": (make_tar(tarfile.GNU_FORMAT), "label"),
    "a ustar prefix": (tar_of([("deep/" * 25 + "k1.jpg", b"1")]), "a ustar name prefix"),
    "webdataset's __ names": (tar_of([("k1.jpg", b"1"), ("__meta__", b"m")]), "__ prefix"),
    "a newline in a name": (tar_of([("k\n1.jpg", b"1")]), "newline"),
    "a folder starting with a dot": (tar_of([("dir/.x.jpg", b"1")]), "otherwise"),
    "a non-ASCII suffix": (tar_of([("k1.jpé", b"1")]), "non-ASCII suffix"),
    "a label with an underscore": (tar_of([("k1.jpg", b"1"), ("k1.cls", b"1_0")]), "label"),
    "a label that is text": (tar_of([("k1.jpg", b"1"), ("k1.cls", b"cat")]), "label"),
    "an empty label": (tar_of([("k1.jpg", b"1"), ("k1.cls", b"")]), "label"),
    "a label too large": (tar_of([("k1.jpg", b"1"), ("k1.cls", b"10000000")]), "label"),
    "many fields": (tar_of([(f"k1.f{i}", b"1") for i in range(tar_count.MAX_SUFFIXES + 1)]), "more fields"),
}

RANDOM = random.Random(0).randbytes(4000)
# Not tars, or damaged ones: the Python reader names the damage, the same way whichever reader started
DAMAGED = {
    "empty file": b"",
    "zero blocks": bytes(1024),
    "gzip": gzip.compress(RANDOM, mtime=0),
    "text": b"myhost\n",
    "garbage": RANDOM,
    "truncated in a header": img2dataset(3)[:1536 + 100],
    "truncated in the data": img2dataset(3)[:700],
    "truncated in the padding": tar_of([("k1.jpg", b"1" * 600)])[:512 + 600],
    "a field twice": tar_of([("k1.jpg", b"1"), ("k1.jpg", b"2")]),
    "a reserved field": tar_of([("k1.jpg", b"1"), ("k1.__key__", b"2")]),
    "a pax record without '='": pax_tar([("k1.jpg", b"1", {"comment": "abc"})]).replace(b"comment=", b"comment#"),
    "a pax record without a length": pax_tar([("k1.jpg", b"1", {"comment": "abc"})]).replace(b"15 c", b"1x c"),
}


@pytest.mark.parametrize("name", list(WALKED))
def test_the_walker_reads_common_shards_itself_and_counts_as_python_does(tmp_path, name):
    path = tmp_path / "s.tar"
    path.write_bytes(WALKED[name])
    result = same(path)
    assert result.read_again == "" and not result.problem
    assert result.samples > 0


def test_what_the_walker_counts(tmp_path):
    path = tmp_path / "s.tar"
    path.write_bytes(WALKED["upper case, two images, dotted suffix"])
    result = same(path)
    assert (result.samples, dict(result.images), result.labelled, result.label_min) == (2, {"jpg": 1, "jpeg": 1}, 1, 3)
    path.write_bytes(WALKED["no image"])
    result = same(path)
    assert result.no_image.count == 8 and result.no_image.keys == ["k0", "k1", "k2", "k3", "k4"]
    path.write_bytes(WALKED["labels as int() reads them"])
    result = same(path)  # "-1" is no label; the others are 3, 7, 2, 0, 12, 5 and 9999999
    assert (result.labelled, result.label_min, result.label_max) == (7, 0, 9999999)


@pytest.mark.parametrize("name", list(LEFT))
def test_what_the_walker_does_not_cover_is_read_again_in_python_with_the_same_result(tmp_path, name):
    data, why = LEFT[name]
    path = tmp_path / "s.tar"
    path.write_bytes(data)
    result = same(path)
    assert why in result.read_again, result.read_again


@pytest.mark.parametrize("name", list(DAMAGED))
def test_damage_is_named_as_the_python_reader_names_it(tmp_path, name):
    path = tmp_path / "s.tar"
    path.write_bytes(DAMAGED[name])
    result = same(path)
    assert result.problem == "damaged" and result.reason


class Trickle(io.RawIOBase):
    """A stream that returns pieces of random sizes, so headers, labels and data fall across every boundary."""

    def __init__(self, data: bytes, seed: int) -> None:
        self.data, self.pos, self.rng = data, 0, random.Random(seed)

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        size = self.rng.choice([1, 7, 511, 512, 513, 1000, 4096, 70000])
        piece = self.data[self.pos:self.pos + min(size, n if n >= 0 else size)]
        self.pos += len(piece)
        return piece


@pytest.mark.parametrize("seed", range(6))
def test_the_walk_is_the_same_however_the_stream_is_cut(seed):
    for data in (WALKED["labelled"], WALKED["folders and links"], WALKED["no end blocks"], img2dataset(200, True, 3),
                 webdataset_writer(100, 2)):
        python = _scan(io.BytesIO(data), "s", False)
        counts = tar_count.count_stream(Trickle(data, seed), lambda n: None)
        assert (counts.samples, counts.images, counts.labelled, counts.label_min, counts.label_max, counts.no_image,
                counts.no_image_keys, counts.bytes) == (
            python.samples, dict(python.images), python.labelled, python.label_min, python.label_max,
            python.no_image.count, python.no_image.keys, python.bytes)


@pytest.mark.parametrize("pax", [False, True])
def test_any_damage_to_a_shard_gets_one_answer_from_both_readers(tmp_path, pax):
    """Bytes changed at random in headers, labels, pax records and data: both readers agree on every copy, counts
    or damage."""
    rng = random.Random(1)
    members = [("k1.jpg", b"1" * 700), ("k1.cls", b"12"), ("k2.png", b"2"), ("k2.cls", b" 3 "), ("k3.txt", b"t")]
    original = pax_tar([(n, d, TIMES) for n, d in members]) if pax else tar_of(members)
    path = tmp_path / "s.tar"
    walked = 0
    for _ in range(150):
        data = bytearray(original)
        for _ in range(rng.choice([1, 1, 2, 4])):
            at = rng.choice([rng.randrange(len(data)), rng.randrange(512), 1536 + rng.randrange(512),
                             512 + rng.randrange(100)])  # the first pax records, or the first member's data
            data[at] = rng.choice([0, 32, 46, 47, 48, 55, 56, 61, 65, 200, rng.randrange(256)])
        path.write_bytes(bytes(data))
        result = same(path)
        walked += not result.read_again and not result.problem
    assert walked > 20  # copies with a changed data byte are still walked, not all left to Python


def test_index_says_which_reader_counted(tmp_path, capsys):
    (tmp_path / "00000.tar").write_bytes(WALKED["img2dataset"])
    (tmp_path / "00001.tar").write_bytes(LEFT["long names (pax)"][0])
    build_main(["index", str(tmp_path), "--workers", "1", "--reader", "compiled"])
    out = capsys.readouterr().out
    assert "compiled reader; 1 shard(s) read again by the Python reader, the first for pax records" in out
    compiled = (tmp_path / "_info.json").read_bytes()
    build_main(["index", str(tmp_path), "--workers", "1"])  # auto: a few KB, not worth numba's start-up
    assert "1 process worker(s), Python reader)" in capsys.readouterr().out
    assert (tmp_path / "_info.json").read_bytes() == compiled


def test_auto_walks_compiled_where_it_pays():
    small, large = ShardRef("train", "a.tar", 1000), ShardRef("train", "b.tar", AUTO_COMPILED_BYTES)
    unknown = ShardRef("train", "s3://b/{0..9}.tar", None)  # a remote pattern: sizes are not listed
    auto = IndexOptions()
    assert [chosen_reader(auto, s) for s in ([small], [small, large], [unknown])] == ["python", "compiled", "compiled"]
    assert chosen_reader(IndexOptions(reader="compiled"), [small]) == "compiled"
    assert chosen_reader(IndexOptions(reader="python"), [large]) == "python"
    assert chosen_reader(IndexOptions(reader="compiled", verify=True), [large]) == "python"  # decoding is Python's


def test_pool_auto_runs_the_compiled_walker_in_threads_and_python_in_processes(tmp_path, capsys):
    large = ShardRef("train", "b.tar", AUTO_COMPILED_BYTES)
    pools = {(reader, verify): check_reader(IndexOptions(reader=reader, verify=verify), [large]).pool
             for reader in ("auto", "compiled", "python") for verify in (False, True)}
    assert pools == {("auto", False): "thread", ("compiled", False): "thread", ("python", False): "process",
                     ("auto", True): "process", ("compiled", True): "process", ("python", True): "process"}
    assert check_reader(IndexOptions(reader="compiled", pool="process"), [large]).pool == "process"  # as asked
    (tmp_path / "00000.tar").write_bytes(WALKED["webdataset's TarWriter (pax mtimes)"])
    build_main(["index", str(tmp_path), "--workers", "2", "--reader", "compiled"])
    assert " 1 thread worker(s), compiled reader)" in capsys.readouterr().out


def test_reading_ahead_gives_the_same_bytes_for_any_read_sizes(tmp_path):
    data = random.Random(2).randbytes(3 * urls.BUFFER + 12345)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    sizes = random.Random(3)
    with urls.open_url(str(path), read_ahead=True) as f:
        pieces = []
        while piece := f.read(sizes.choice([1, 100, urls.BUFFER, 2 * urls.BUFFER, 5000])):
            pieces.append(piece)
    assert b"".join(pieces) == data


def stalled_after_half(tmp_path: Path):
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 800)  # 204,800 bytes: 102,400 come, then silence
    return serve_faulty(tmp_path)


def test_a_read_ahead_that_stalls_is_the_usual_stall_and_close_does_not_wait_for_it(tmp_path):
    with stalled_after_half(tmp_path) as base:
        FaultyHandler.faults["/f.bin"] = ("stall", 1)
        f = urls.open_url(f"{base}/f.bin", timeout=2, read_ahead=True)
        assert len(f.read(102400)) == 102400  # what came; the read ahead now waits on a silent server
        start = time.monotonic()
        with pytest.raises(urls.StreamStalled, match="no data for 2 s while reading"):
            f.read(1)
        assert 1.5 < time.monotonic() - start < 10
        f.close()
    with stalled_after_half(tmp_path) as base:
        FaultyHandler.faults["/f.bin"] = ("stall", 1)
        f = urls.open_url(f"{base}/f.bin", timeout=30, read_ahead=True)
        assert len(f.read(102400)) == 102400
        start = time.monotonic()
        f.close()  # the pending read is aborted, not waited for (30 s)
        assert time.monotonic() - start < 5


def test_asking_for_the_compiled_reader_without_numba_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(shard_index, "compiled_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        build_main(["index", "somewhere", "--reader", "compiled"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "needs numba" in err[-1] and "fast-index" in err[-1], err


def test_a_numba_that_cannot_run_is_one_line_or_the_python_reader(tmp_path, capsys, monkeypatch):
    """numba installed beside a numpy it does not support refuses to import: named, never a traceback."""
    def broken() -> None:
        raise ImportError("Numba needs NumPy 2.3 or less. Got NumPy 2.4.")

    monkeypatch.setattr(tar_count, "compile_walker", broken)
    (tmp_path / "00000.tar").write_bytes(WALKED["img2dataset"])
    with pytest.raises(SystemExit) as stop:
        build_main(["index", str(tmp_path), "--reader", "compiled"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --reader compiled: the compiled walker cannot run here (ImportError: Numba "
                              "needs NumPy 2.3 or less. Got NumPy 2.4.); --reader python counts without it"), err
    assert not (tmp_path / "_info.json").exists()
    monkeypatch.setattr(index_shards, "AUTO_COMPILED_BYTES", 0)  # auto would walk compiled
    build_main(["index", str(tmp_path)])
    out = capsys.readouterr().out
    assert "warning: the compiled walker cannot run here (ImportError: Numba needs NumPy" in out
    assert "Python reader)" in out and (tmp_path / "_info.json").exists()
