"""Counting a shard for `build-shards index` with a compiled header walker (numba, the `fast-index` extra), so
indexing keeps up with a read from the page cache or a fast disk.

The Python reader (vit_mpp/data/tar_scan.py) costs about 2-4 us per tar member, which on shards of small images is
several times slower than reading them from memory. Here the same walk runs as machine code over each 1 MiB chunk
as it arrives, with the reader's state (a header split across chunks, data still to skip, the open sample) kept
in small arrays between chunks, so Python runs once per chunk, not once per member.

It covers what shards are made of: plain files with names in the header's name field, directories and other
non-file members, webdataset's key/suffix split (`base_plus_ext`), `.cls` labels in plain decimal, and pax headers
whose records do not rename or resize the next member (webdataset's TarWriter writes one before every member, for a
float mtime). Anything else (a pax `path` or `size`, GNU long-name headers, a ustar prefix, base-256 numbers, a
damaged or truncated tar, an odd label, webdataset's `__` names) stops it with `NotSimple`, and the caller reads the
shard again with the Python reader, which gives the exact answer or the exact error. So both readers give one
result: whatever this counter accepts, it counts as the Python reader does (tests/data_tools/test_tar_count.py
compares them on every kind of member).

This module imports numba: data_tools/indexer/count_shard.py imports it only where the walker is used. The compiled code
is cached on disk by numba (beside this file, or in the user's cache folder where that is read-only), so only the
first run anywhere compiles (a few seconds); later processes load it.
"""

from __future__ import annotations

import functools
import io
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numba
import numpy as np

from data_tools.decode_check import EXAMPLES  # keys of samples without an image kept, as KeyTally keeps them
from vit_mpp.data.image_formats import IMAGE_EXTENSIONS
from vit_mpp.data.labels import MAX_CLASSES
from vit_mpp.data.tar_scan import CHUNK, KIND_EXTENDED, KIND_NO_DATA, KIND_OLD_FILE, KIND_SKIP_DATA, kind_rules

MAX_SUFFIXES = 16  # fields per sample the walker tracks; a sample with more goes to the Python reader
MAX_LABEL = 64  # bytes of a `.cls` the walker parses
MAX_PAX = 4096  # bytes of a pax extended header the walker parses (webdataset's own: 30 bytes, an mtime)

# The walker's state, one int64 array: what the next bytes are, the open sample, and the running counts
(SKIP, HEADER_BYTES, KEY_LEN, SUFFIXES, IMAGE_RANK, DATA_WANTED, DATA_BYTES, DATA_PAD, DATA_KIND, DONE, FIRST,
 SAMPLES, LABELLED, LABEL_MIN, LABEL_MAX, NO_IMAGE, STOP, STATE_SIZE) = range(18)
LABEL_DATA, PAX_DATA = 1, 2  # DATA_KIND: a member's data the walker reads (into one buffer): a `.cls`, pax records
_PAX_TYPES = (ord("x"), ord("X"), ord("g"))  # pax extended headers: for the next member, Solaris's, global

# Why the walker stopped (its STOP state): each means "read this shard with the Python reader"
(NOT_OCTAL, BAD_CHECKSUM, EXTENDED, PAX_RECORDS, PREFIX, META_NAME, OTHER_SPLIT, NON_ASCII_SUFFIX, FIELD_TWICE,
 MANY_FIELDS, ODD_LABEL, EMPTY, TRUNCATED) = range(1, 14)
STOP_REASONS = {
    NOT_OCTAL: "a header that is not plain octal", BAD_CHECKSUM: "a checksum that does not match",
    EXTENDED: "an extended header (GNU long name or link, sparse)",
    PAX_RECORDS: "pax records naming or sizing a member (path, size), long or not plain",
    PREFIX: "a ustar name prefix",
    META_NAME: "a name with a newline or webdataset's __ prefix", OTHER_SPLIT: "a name webdataset splits otherwise",
    NON_ASCII_SUFFIX: "a non-ASCII suffix", FIELD_TWICE: "a field twice in one sample",
    MANY_FIELDS: "more fields in a sample than tracked", ODD_LABEL: "a label that is not plain decimal",
    EMPTY: "an empty archive", TRUNCATED: "truncated",
}


class NotSimple(Exception):
    """The shard holds something the compiled walker leaves to the Python reader (see STOP_REASONS)."""


@dataclass
class Counts:
    """What the walker found in one shard (see data_tools/indexer/count_shard.py's ShardIndex)."""

    bytes: int = 0
    samples: int = 0
    images: dict[str, int] = field(default_factory=dict)
    labelled: int = 0
    label_min: int | None = None
    label_max: int | None = None
    no_image: int = 0
    no_image_keys: list[str] = field(default_factory=list)


_jit = numba.njit(cache=True, nogil=True)  # cached on disk: later processes load the machine code


@_jit
def _octal(h: Any, a: int, b: int) -> int:
    # plain octal as the Python reader's fast path reads it: spaces, digits, then NULs or spaces; else -1
    i = a
    while i < b and h[i] == 32:
        i += 1
    value, digits = 0, 0
    while i < b and 48 <= h[i] <= 55:
        value = value * 8 + (h[i] - 48)
        digits += 1
        i += 1
    while i < b and (h[i] == 0 or h[i] == 32):
        i += 1
    return value if i == b and digits > 0 else -1


@_jit
def _equal_prefix(a: Any, b: Any, n: int) -> bool:
    for i in range(n):
        if a[i] != b[i]:
            return False
    return True


@_jit
def _signed_sum(h: Any) -> int:
    # the header's sum with bytes read as signed and the checksum field as spaces, as old tars computed it
    total = 0
    for i in range(512):
        if i < 148 or i >= 156:
            c = h[i]
            total += c - 256 if c >= 128 else c
    return total


@_jit
def _close_sample(st: Any, key: Any, exts: Any, no_keys: Any, no_key_lens: Any) -> None:
    if st[KEY_LEN] < 0:
        return
    if st[IMAGE_RANK] < len(exts):
        exts[st[IMAGE_RANK]] += 1
    else:
        if st[NO_IMAGE] < EXAMPLES:
            for i in range(st[KEY_LEN]):
                no_keys[st[NO_IMAGE], i] = key[i]
            no_key_lens[st[NO_IMAGE]] = st[KEY_LEN]
        st[NO_IMAGE] += 1
    st[KEY_LEN] = -1


@_jit
def _label(st: Any, buf: Any, n: int, max_classes: int) -> int:
    # a .cls as int() reads plain decimal text with ASCII spaces around it; 0 when counted, else why the walk stops
    i = 0
    while i < n and (buf[i] == 32 or 9 <= buf[i] <= 13):
        i += 1
    negative = i < n and buf[i] == 45
    if i < n and (buf[i] == 43 or buf[i] == 45):
        i += 1
    value, digits = 0, 0
    while i < n and 48 <= buf[i] <= 57 and digits < 18:
        value = value * 10 + (buf[i] - 48)
        digits += 1
        i += 1
    while i < n and (buf[i] == 32 or 9 <= buf[i] <= 13):
        i += 1
    if i != n or digits == 0:
        return ODD_LABEL
    if negative:
        value = -value
    if value >= max_classes:
        return ODD_LABEL
    if value >= 0:
        st[LABELLED] += 1
        if st[LABEL_MIN] < 0 or value < st[LABEL_MIN]:
            st[LABEL_MIN] = value
        if value > st[LABEL_MAX]:
            st[LABEL_MAX] = value
    return 0


@_jit
def _pax(buf: Any, n: int) -> int:
    # pax records ("%d %s=%s\n") as the Python reader parses them (tar_scan._pax_records): 0 when none is `path` or
    # `size` (the only records that reader applies: the next member keeps its own header's name and size), else
    # PAX_RECORDS, also for anything not plainly well-formed (the Python reader then says what it makes of it)
    pos = 0
    while pos < n and buf[pos] != 0:
        i, length, digits = pos, 0, 0
        while i < n and 48 <= buf[i] <= 57 and digits < 9:
            length = length * 10 + (buf[i] - 48)
            digits += 1
            i += 1
        if digits == 0 or i >= n or buf[i] != 32 or length <= 0 or pos + length > n:
            return PAX_RECORDS
        key, eq = i + 1, -1
        for j in range(i + 1, pos + length - 1):
            if buf[j] == 61:
                eq = j
                break
        if eq < 0:
            return PAX_RECORDS
        if eq - key == 4 and ((buf[key] == 112 and buf[key + 1] == 97 and buf[key + 2] == 116 and buf[key + 3] == 104)
                              or (buf[key] == 115 and buf[key + 1] == 105 and buf[key + 2] == 122
                                  and buf[key + 3] == 101)):  # "path", "size"
            return PAX_RECORDS
        pos += length
    return 0


@numba.njit(cache=True, nogil=True, inline="always")
def _header(h: Any, st: Any, kinds: Any, key: Any, sufs: Any, suf_lens: Any, img: Any, img_lens: Any,
            exts: Any, no_keys: Any, no_key_lens: Any) -> int:
    # one 512-byte header, h (a view: indexed from 0, the sum compiles to vector adds; with a variable offset numba's
    # negative-index check kept it scalar, 4x slower): 0, or why the walk stops
    total = 0
    for i in range(512):  # no branch in this loop: it compiles to vector adds
        total += h[i]
    if total == 0:  # a zero block: the end of the archive
        if st[FIRST]:
            return EMPTY
        st[DONE] = 1
        return 0
    field_total = 0
    for i in range(148, 156):
        field_total += h[i]
    stored, size = _octal(h, 148, 156), _octal(h, 124, 136)
    if stored < 0 or size < 0:
        return NOT_OCTAL
    if stored != total - field_total + 256 and stored != _signed_sum(h) + 256:
        return BAD_CHECKSUM
    st[FIRST] = 0
    padded = (size + 511) & ~511
    kind = kinds[h[156]]
    if kind == KIND_EXTENDED:
        if h[156] != _PAX_TYPES[0] and h[156] != _PAX_TYPES[1] and h[156] != _PAX_TYPES[2]:
            return EXTENDED
        if size > MAX_PAX:
            return PAX_RECORDS
        st[DATA_WANTED], st[DATA_BYTES], st[DATA_PAD], st[DATA_KIND] = size, 0, padded - size, PAX_DATA
        return 0
    if kind == KIND_SKIP_DATA:
        st[SKIP] = padded
        return 0
    if kind == KIND_NO_DATA:
        return 0
    if h[345]:
        return PREFIX
    length = 0
    while length < 100 and h[length]:
        length += 1
    if kind == KIND_OLD_FILE and length > 0 and h[length - 1] == 47:  # an old-style directory: no data follows
        return 0
    if length >= 2 and h[0] == 95 and h[1] == 95:
        return META_NAME
    slash, dot = -1, -1
    for i in range(length):
        c = h[i]
        if c == 10:
            return META_NAME
        if c == 47:
            slash, dot = i, -1
        elif c == 46 and dot < 0:
            dot = i
    if dot < 0 or dot == 0:  # no key: webdataset passes the member over
        if slash >= 0:
            return OTHER_SPLIT
        st[SKIP] = padded
        return 0
    if dot == slash + 1:
        return OTHER_SPLIT
    suffix_len = length - dot - 1
    if st[KEY_LEN] != dot or not _equal_prefix(key, h[:dot], dot):
        _close_sample(st, key, exts, no_keys, no_key_lens)
        for i in range(dot):
            key[i] = h[i]
        st[KEY_LEN], st[SUFFIXES], st[IMAGE_RANK] = dot, 0, len(exts)
        st[SAMPLES] += 1
    n = st[SUFFIXES]
    if n >= sufs.shape[0]:
        return MANY_FIELDS
    for i in range(suffix_len):
        c = h[dot + 1 + i]
        if c >= 128:
            return NON_ASCII_SUFFIX
        sufs[n, i] = c + 32 if 65 <= c <= 90 else c
    if suffix_len == 7 and sufs[n, 0] == 95 and sufs[n, 1] == 95 and sufs[n, 5] == 95 and sufs[n, 6] == 95:
        return FIELD_TWICE  # webdataset's reserved __key__ and __url__ (and other __x__ names, to be safe)
    for j in range(n):
        if suf_lens[j] == suffix_len and _equal_prefix(sufs[j], sufs[n], suffix_len):
            return FIELD_TWICE
    suf_lens[n] = suffix_len
    st[SUFFIXES] = n + 1
    for r in range(min(len(img_lens), st[IMAGE_RANK])):
        if img_lens[r] == suffix_len and _equal_prefix(img[r], sufs[n], suffix_len):
            st[IMAGE_RANK] = r
            break
    if suffix_len == 3 and sufs[n, 0] == 99 and sufs[n, 1] == 108 and sufs[n, 2] == 115:  # cls
        if size == 0 or size > MAX_LABEL:
            return ODD_LABEL
        st[DATA_WANTED], st[DATA_BYTES], st[DATA_PAD], st[DATA_KIND] = size, 0, padded - size, LABEL_DATA
        return 0
    st[SKIP] = padded
    return 0


@_jit
def _feed(chunk: Any, st: Any, held: Any, data: Any, kinds: Any, key: Any, sufs: Any, suf_lens: Any,
          img: Any, img_lens: Any, exts: Any, no_keys: Any, no_key_lens: Any, max_classes: int) -> None:
    # walk one chunk; on return st[STOP] says whether the walk must go to the Python reader
    pos, n = 0, len(chunk)
    while pos < n and not st[DONE] and not st[STOP]:
        if st[DATA_WANTED]:
            take = min(st[DATA_WANTED], n - pos)
            for i in range(take):
                data[st[DATA_BYTES] + i] = chunk[pos + i]
            pos += take
            st[DATA_BYTES] += take
            st[DATA_WANTED] -= take
            if not st[DATA_WANTED]:
                if st[DATA_KIND] == LABEL_DATA:
                    st[STOP] = _label(st, data, st[DATA_BYTES], max_classes)
                else:
                    st[STOP] = _pax(data, st[DATA_BYTES])
                st[SKIP] = st[DATA_PAD]
            continue
        if st[SKIP]:
            take = min(st[SKIP], n - pos)
            pos += take
            st[SKIP] -= take
            continue
        if st[HEADER_BYTES] or n - pos < 512:
            take = min(512 - st[HEADER_BYTES], n - pos)
            for i in range(take):
                held[st[HEADER_BYTES] + i] = chunk[pos + i]
            pos += take
            st[HEADER_BYTES] += take
            if st[HEADER_BYTES] < 512:
                continue
            st[HEADER_BYTES] = 0
            st[STOP] = _header(held, st, kinds, key, sufs, suf_lens, img, img_lens, exts, no_keys, no_key_lens)
        else:
            st[STOP] = _header(chunk[pos:pos + 512], st, kinds, key, sufs, suf_lens, img, img_lens, exts, no_keys,
                               no_key_lens)
            pos += 512


@_jit
def _finish(st: Any, key: Any, exts: Any, no_keys: Any, no_key_lens: Any) -> None:
    # the stream ended: the end of the archive only on a block boundary after at least one header
    if not st[DONE] and not st[STOP]:
        if st[HEADER_BYTES] or st[SKIP] or st[DATA_WANTED]:
            st[STOP] = TRUNCATED
        elif st[FIRST]:
            st[STOP] = EMPTY
    if not st[STOP]:
        _close_sample(st, key, exts, no_keys, no_key_lens)


@functools.cache
def compile_walker() -> None:
    """Compile (or load from numba's cache) the walker now, by walking a one-member tar: a process pool forked
    after this inherits the machine code instead of loading it again in every worker (about 0.7 s each, numba's
    import included)."""
    member = tarfile.TarInfo("k.cls")
    member.size = 1
    count_stream(io.BytesIO(member.tobuf(tarfile.USTAR_FORMAT) + b"1".ljust(512, b"\0") + bytes(1024)),
                 lambda n: None)


class _Walk:
    """The walker's arrays for one shard."""

    def __init__(self) -> None:
        self.st = np.zeros(STATE_SIZE, np.int64)
        self.st[KEY_LEN], self.st[FIRST], self.st[LABEL_MIN], self.st[LABEL_MAX] = -1, 1, -1, -1
        self.held = np.zeros(512, np.uint8)
        self.data = np.zeros(max(MAX_LABEL, MAX_PAX), np.uint8)  # a `.cls` or pax records being read
        self.kinds = _kind_table()
        self.key = np.zeros(100, np.uint8)
        self.sufs = np.zeros((MAX_SUFFIXES, 100), np.uint8)
        self.suf_lens = np.zeros(MAX_SUFFIXES, np.int64)
        self.img, self.img_lens = _image_table()
        self.exts = np.zeros(len(IMAGE_EXTENSIONS), np.int64)
        self.no_keys = np.zeros((EXAMPLES, 100), np.uint8)
        self.no_key_lens = np.zeros(EXAMPLES, np.int64)

    def check(self) -> None:
        if self.st[STOP]:
            raise NotSimple(STOP_REASONS[int(self.st[STOP])])

    def counts(self, size: int) -> Counts:
        st = self.st
        return Counts(
            bytes=size, samples=int(st[SAMPLES]), labelled=int(st[LABELLED]),
            images={e: int(n) for e, n in zip(IMAGE_EXTENSIONS, self.exts) if n},
            label_min=int(st[LABEL_MIN]) if st[LABELLED] else None,
            label_max=int(st[LABEL_MAX]) if st[LABELLED] else None, no_image=int(st[NO_IMAGE]),
            no_image_keys=[bytes(self.no_keys[i, :self.no_key_lens[i]]).decode("utf-8", "surrogateescape")
                           for i in range(min(EXAMPLES, int(st[NO_IMAGE])))])


@functools.cache
def _kind_table() -> np.ndarray:
    # each typeflag's KIND_* (vit_mpp/data/tar_scan.py), looked up by the walker
    return np.array(kind_rules(), np.int8)


@functools.cache
def _image_table() -> tuple[np.ndarray, np.ndarray]:
    table = np.zeros((len(IMAGE_EXTENSIONS), 100), np.uint8)
    for r, ext in enumerate(IMAGE_EXTENSIONS):
        table[r, :len(ext)] = np.frombuffer(ext.encode(), np.uint8)
    return table, np.array([len(e) for e in IMAGE_EXTENSIONS], np.int64)


def count_stream(stream: BinaryIO, progress: Callable[[int], None]) -> Counts:
    """Count one tar stream's samples, image extensions and labels as the Python reader would; `progress` gets
    each chunk's size. Raises NotSimple where the shard needs the Python reader (read it again with that)."""
    w = _Walk()
    size = 0
    # open_url's fresh stream (nothing buffered yet): its pieces as they come, without another copy
    raw = getattr(stream, "raw", None)
    pieces = (lambda: raw.read_piece(CHUNK)) if hasattr(raw, "read_piece") else (lambda: stream.read(CHUNK))
    while chunk := pieces():
        size += len(chunk)
        progress(len(chunk))
        if not w.st[DONE]:  # after the end of the archive only its padding is read, to count the bytes
            _feed(np.frombuffer(chunk, np.uint8), w.st, w.held, w.data, w.kinds, w.key, w.sufs, w.suf_lens,
                 w.img, w.img_lens, w.exts, w.no_keys, w.no_key_lens, MAX_CLASSES)
            w.check()
    _finish(w.st, w.key, w.exts, w.no_keys, w.no_key_lens)
    w.check()
    return w.counts(size)
