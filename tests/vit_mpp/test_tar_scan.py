"""The streaming tar reader behind `build-shards index` (vit_mpp/data/tar_scan.py) sees the samples webdataset's own
iterators give the training stream, on the tar dialects and member names met in the wild, and names damage that
tarfile would pass over in silence."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import random
import tarfile

import pytest
import webdataset as wds

from tests.helpers.shards import TAR_NAMES, make_tar
from vit_mpp.data.tar_scan import CHUNK, TarDamaged, TarReader, samples


def webdataset_samples(data: bytes) -> list[tuple[str, list[str]]]:
    files = wds.tariterators.tar_file_expander([{"url": "t", "stream": io.BytesIO(data)}])
    return [(s["__key__"], sorted(k for k in s if not k.startswith("__")))
            for s in wds.tariterators.group_by_keys(files)]


def our_samples(data: bytes, wanted: frozenset[str] = frozenset()) -> list[tuple[str, list[str]]]:
    return [(s.key, sorted(s.suffixes)) for s in samples(TarReader(io.BytesIO(data)), wanted)]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_samples_are_webdatasets(fmt):
    names = TAR_NAMES
    if fmt == tarfile.USTAR_FORMAT:  # ustar cannot store a 120-character file name
        names = [n for n in TAR_NAMES if not n.startswith("x" * 120)]
    data = make_tar(fmt, big=3 * CHUNK, names=names)  # one member spans chunks
    expected = webdataset_samples(data)
    assert our_samples(data) == expected
    assert our_samples(data, frozenset({"jpg", "cls"})) == expected
    assert any(k.startswith("x" * 120) for k, _ in expected) or fmt == tarfile.USTAR_FORMAT


def test_the_bytes_asked_for_are_whole_and_the_size_is_the_files():
    data = make_tar(tarfile.PAX_FORMAT, big=2 * CHUNK + 5)
    reader = TarReader(io.BytesIO(data))
    got = {s.key: s.data for s in samples(reader, frozenset({"jpg"}))}
    reader.drain()
    assert reader.bytes_read == len(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert got["000007"]["jpg"] == tar.extractfile("000007.jpg").read()
        assert got["000001"] == {"jpg": tar.extractfile("000001.jpg").read()}


def test_a_pax_global_header_and_the_end_of_an_archive_without_end_blocks():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "global"}) as tar:
        for name in ("k1.jpg", "k1.cls", "k2.jpg"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    data = out.getvalue()
    assert our_samples(data) == webdataset_samples(data) == [("k1", ["cls", "jpg"]), ("k2", ["jpg"])]
    end = data.rindex(b"abc") + 512  # cut just after the last member: no end-of-archive blocks
    assert our_samples(data[:end]) == [("k1", ["cls", "jpg"]), ("k2", ["jpg"])]


def test_a_field_twice_in_a_sample_is_damage_as_webdataset_refuses_it():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name in ("k1.jpg", "k1.JPG"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="duplicate file name"):
        webdataset_samples(out.getvalue())
    with pytest.raises(TarDamaged, match="a second 'jpg' in sample k1"):
        our_samples(out.getvalue())


RANDOM = random.Random(0).randbytes(4000)


@pytest.mark.parametrize("data, reason", [
    (b"", "empty file"),
    (b"PK\x03\x04" + bytes(2000), "not a tar"),
    (bytes(1024), "no members: an empty tar, or not a tar (it starts with a zero block)"),  # tarfile: "empty file"
    (b"x" * 700, "not a tar"),
    (b"myhost\n", "not a tar (7 bytes, less than one 512-byte tar header)"),
    # a .tar.gz named .tar: tarfile's "r|*" read it, this reader says why it does not
    (gzip.compress(RANDOM, mtime=0), "not a tar: gzip-compressed (shards are read as plain tars; decompress it)"),
    (bz2.compress(RANDOM), "not a tar: bzip2-compressed"), (lzma.compress(RANDOM), "not a tar: xz-compressed"),
    (gzip.compress(b"x", mtime=0), "not a tar: gzip-compressed"),  # shorter than a header
])
def test_what_is_not_a_tar(data, reason):
    with pytest.raises(TarDamaged, match=reason.replace("(", r"\(").replace(")", r"\)")):
        our_samples(data)


def test_a_damaged_header_after_the_first_is_reported_where_tarfile_stops_quietly():
    data = bytearray(make_tar(tarfile.GNU_FORMAT))
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        offset = tar.getmember("000003.jpg").offset
    data[offset + 130] ^= 0x01  # one bit of the size field: the checksum no longer matches
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        assert len(tar.getmembers()) < len(TAR_NAMES)  # tarfile (so webdataset) ends the archive there, no error
    with pytest.raises(TarDamaged, match=f"damaged tar header at byte {offset} \\(bad checksum\\)"):
        our_samples(bytes(data))
