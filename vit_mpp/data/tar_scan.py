"""Reading a webdataset tar once, as a stream, fast: its members' names (and the bytes of the few members asked
for), grouped into samples exactly as webdataset groups them, damage reported (`TarDamaged`), never a short shard.
The one tar reader of the project (`TarReader`, `samples`, `count_samples`): `build-shards index` counts with it and
the training and evaluation streams read with it (vit_mpp/data/shard_reader.py), so the stream meets the samples
the manifest counted. See docs/build_shards.md#indexing-shards-you-already-have.
"""

from __future__ import annotations

import functools
import inspect
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO

BLOCK = 512
CHUNK = 1 << 20  # bytes per read: few calls per shard, and the unit of progress and deadlines
_ZERO = bytes(BLOCK)
_REGULAR = frozenset(t[0] for t in tarfile.REGULAR_TYPES)  # typeflag bytes whose members are files
_SKIP_DATA = _REGULAR | frozenset(t for t in range(256) if bytes([t]) not in tarfile.SUPPORTED_TYPES)
_LONGNAME, _LONGLINK, _SPARSE = tarfile.GNUTYPE_LONGNAME[0], tarfile.GNUTYPE_LONGLINK[0], tarfile.GNUTYPE_SPARSE[0]
_PAX = frozenset((tarfile.XHDTYPE[0], tarfile.SOLARIS_XHDTYPE[0]))
_PAX_GLOBAL = tarfile.XGLTYPE[0]
_EXTENDED = _PAX | {_PAX_GLOBAL, _LONGNAME, _LONGLINK, _SPARSE}  # headers that describe the next member
_AREG, _REG = tarfile.AREGTYPE[0], tarfile.REGTYPE[0]
# The magic numbers of compressed archives, to say why such a file is not read (a .tar.gz named .tar)
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


@functools.cache
def _webdataset_rules() -> tuple[str, str, re.Pattern, Callable[[str], tuple[str | None, str | None]]]:
    """webdataset's own rules for which tar members become sample fields, read from its module and signatures so
    they follow it: (meta prefix, meta suffix, skip_meta pattern, base_plus_ext). Imported when first needed:
    importing webdataset imports torch (seconds), which the common names never need."""
    from webdataset import tariterators

    skip_meta = inspect.signature(tariterators.tar_file_iterator).parameters["skip_meta"].default
    return tariterators.meta_prefix, tariterators.meta_suffix, re.compile(skip_meta), tariterators.base_plus_ext


class TarDamaged(Exception):
    """The bytes are not a complete, readable tar (empty, not a tar, a damaged header, truncated). Not an OSError:
    reading again cannot help."""


def _number(field_: bytes) -> int:
    """A numeric header field, as tarfile reads it: octal text up to the first NUL, or GNU base-256."""
    if field_[0] in (0o200, 0o377):
        n = int.from_bytes(field_[1:], "big")
        return n - 256 ** (len(field_) - 1) if field_[0] == 0o377 else n
    end = field_.find(b"\0")
    text = (field_ if end < 0 else field_[:end]).strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise TarDamaged(f"a header field is not a number ({field_!r})") from None


def _checksum_ok(header: bytes, stored: int) -> bool:
    """Whether `stored` is the header's checksum (unsigned or signed sum, as tarfile accepts). The fast test uses
    adler32, whose low half is 1 + the byte sum modulo 65521: a pass leaves only a difference of exactly 65521,
    which damage does not produce by chance in practice; a failure is checked exactly before being reported."""
    field_sum = sum(header[148:156])
    if ((zlib.adler32(header) & 0xFFFF) - 1 - field_sum + 256 - stored) % 65521 == 0:
        return True
    unsigned = sum(header) - field_sum + 256
    signed = unsigned - 256 * sum(1 for b in header[:148] + header[156:] if b >= 128)
    return stored in (unsigned, signed)


def _pax_size(value: bytes | None, size: int) -> int:
    """The size of a member with pax records: their `size` when they have one (a file over 8 GiB)."""
    if value is None:
        return size
    try:
        return int(value)
    except ValueError:
        raise TarDamaged(f"a pax 'size' record is not a number ({value[:20]!r})") from None


def _text(raw: bytes) -> str:
    end = raw.find(b"\0")
    return (raw if end < 0 else raw[:end]).decode("utf-8", "surrogateescape")


def _pax_records(data: bytes) -> dict[str, bytes]:
    """The records (`"%d %s=%s\\n"`) of a pax extended header."""
    records: dict[str, bytes] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise TarDamaged("a pax header record has no length") from None
        if space < 0 or length <= 0:
            raise TarDamaged("a pax header record has no length")
        key, eq, value = data[space + 1:pos + length - 1].partition(b"=")
        if not eq:
            raise TarDamaged("a pax header record has no '='")
        records[key.decode("utf-8", "surrogateescape")] = value
        pos += length
    return records


def _not_a_tar(head: bytes, why: str) -> TarDamaged:
    """The error for a file that is no tar from its first byte: a compressed archive says so."""
    packed = next((kind for magic, kind in _COMPRESSED if head.startswith(magic)), None)
    return TarDamaged(f"not a tar: {packed}-compressed (shards are read as plain tars; decompress it)" if packed
                      else f"not a tar ({why})")


class TarReader:
    """The regular-file members of a tar stream, in order, as (name, data); data is None unless `wanted(name)`.

    `bytes_read` counts every byte consumed, the end-of-archive padding included once `drain()` has run; `progress`
    is called with each chunk's size as it is read.
    """

    def __init__(self, stream: BinaryIO, progress: Callable[[int], None] | None = None) -> None:
        self.stream, self.progress = stream, progress
        self.buf, self.off, self.bytes_read = b"", 0, 0
        self.pax: dict[str, bytes] = {}  # pax records for the next member
        self.pax_global: dict[str, bytes] = {}  # pax records for every later member
        self.longname: str | None = None  # a GNU long name for the next member

    def _fill(self, n: int) -> bool:
        """At least `n` bytes buffered after `off`, unless the stream ends first (then False)."""
        have = len(self.buf) - self.off
        if have >= n:
            return True
        parts = [self.buf[self.off:]] if have else []
        while have < n:
            chunk = self.stream.read(max(CHUNK, n - have))  # a large member in one read: no quadratic copying
            if not chunk:
                break
            self.bytes_read += len(chunk)
            if self.progress is not None:
                self.progress(len(chunk))
            parts.append(chunk)
            have += len(chunk)
        self.buf, self.off = (parts[0] if len(parts) == 1 else b"".join(parts)), 0  # one part: no copy
        return have >= n

    def _take(self, n: int, what: str) -> bytes:
        if not self._fill(n):
            raise TarDamaged(f"truncated: the file ends inside {what}")
        data = self.buf[self.off:self.off + n]
        self.off += n
        return data

    def _skip(self, n: int, what: str) -> None:
        left = len(self.buf) - self.off
        while n > left:  # skipped data is read, never sought: one access pattern for disks and streams
            n -= left
            self.buf, self.off = b"", 0
            if not self._fill(1):
                raise TarDamaged(f"truncated: the file ends inside {what}")
            left = len(self.buf)
        self.off += n

    def drain(self) -> None:
        """Read the rest of the stream (the archive's padding), so `bytes_read` is the file's size."""
        self.buf, self.off = b"", 0
        while self._fill(1):
            self.buf, self.off = b"", 0

    def fields(self, wanted: frozenset[str]) -> Iterator[tuple[str, str, bytes | None]]:
        """(key, suffix, data or None) of each regular file that webdataset makes a sample field (see
        `sample_field`); data only for the suffixes in `wanted`. The archive ends at its first zero block, or at the
        end of the stream on a block boundary.

        This is the hot loop, about 2 us per member: the buffer and offset live in locals (written back before
        any helper runs), and only a plain file (`0`) with a short name and nothing pending takes the inline path;
        everything else goes through `_resolve`."""
        first, pending = True, False
        adler32, buf, off = zlib.adler32, self.buf, self.off
        while True:
            if len(buf) - off < BLOCK:
                self.buf, self.off = buf, off
                if not self._fill(BLOCK):
                    self._end(first)
                    return
                buf, off = self.buf, self.off
            header = buf[off:off + BLOCK]
            start, off = off, off + BLOCK
            try:  # the usual octal checksum and size; anything else goes the exact way
                stored, size = int(header[148:156].rstrip(b"\0 "), 8), int(header[124:136].rstrip(b"\0 "), 8)
            except ValueError:
                self.buf, self.off = buf, off
                if header == _ZERO:
                    if first:
                        raise TarDamaged("no members: an empty tar, or not a tar (it starts with a zero "
                                         "block)") from None
                    return
                stored, size = self._numbers(header, start, first)
            if ((adler32(header) & 0xFFFF) - 1 - sum(header[148:156]) + 256 - stored) % 65521 and (
                    stored < 0 or not _checksum_ok(header, stored)):
                self.buf, self.off = buf, off
                raise self._bad_header(start, first, "bad checksum")
            first = False
            if header[156] == _REG and not pending and not header[345]:
                end = header.find(b"\0", 0, 100)
                name = header[:end if end >= 0 else 100].decode("utf-8", "surrogateescape")
            else:
                self.buf, self.off = buf, off
                resolved = self._resolve(header, size, start)
                buf, off = self.buf, self.off
                pending = bool(self.pax or self.longname is not None or self.pax_global)
                if resolved is None:
                    continue
                name, size = resolved
            padded = (size + BLOCK - 1) & ~(BLOCK - 1)
            dot = name.find(".")
            if dot > 0 and name[:2] != "__" and "/" not in name and "\n" not in name:
                key, suffix = name[:dot], name[dot + 1:].lower()  # what base_plus_ext gives such a name
            else:
                fields = sample_field(name)
                if fields is None:
                    self.buf, self.off = buf, off
                    self._skip(padded, name)
                    buf, off = self.buf, self.off
                    continue
                key, suffix = fields
            if suffix in wanted:
                self.buf, self.off = buf, off
                data = self._take(padded, name)[:size]
                buf, off = self.buf, self.off
                yield key, suffix, data
            elif len(buf) - off >= padded:
                off += padded
                yield key, suffix, None
            else:
                self.buf, self.off = buf, off
                self._skip(padded, name)
                buf, off = self.buf, self.off
                yield key, suffix, None

    def _end(self, first: bool) -> None:
        """The stream ended where a header would start: the end of the archive, unless nothing or half a header
        came."""
        if len(self.buf) > self.off:
            if first:
                raise _not_a_tar(self.buf[self.off:], f"{self.bytes_read} bytes, less than one 512-byte tar header")
            raise TarDamaged(f"truncated: the file ends inside a header at byte {self.bytes_read}")
        if first:
            raise TarDamaged("empty file")

    def _bad_header(self, off: int, first: bool, why: str) -> TarDamaged:
        if first:
            return _not_a_tar(self.buf[off:], "no tar header at the start")
        at = self.bytes_read - (len(self.buf) - off)
        return TarDamaged(f"damaged tar header at byte {at} ({why})")

    def _numbers(self, header: bytes, off: int, first: bool) -> tuple[int, int]:
        """(checksum, size) of a header whose fields are not plain octal (base-256, or damaged)."""
        try:
            return (_number(header[148:156]) if header[148] else -1), _number(header[124:136])
        except TarDamaged as e:
            raise self._bad_header(off, first, str(e)) from None

    def _resolve(self, header: bytes, size: int, start: int) -> tuple[str, int] | None:
        """Any header but a plain file with a short name: read an extended header (GNU long name or link, pax
        records) for the next member, pass over a non-file, or give a file's full name and size; None when there is
        no file to yield."""
        kind = header[156]
        if kind in _EXTENDED:
            self._extended(kind, size)
            return None
        pax, longname = self.pax, self.longname
        name = self._name(header, longname, pax)
        if pax or self.pax_global:
            size = _pax_size(pax.get("size", self.pax_global.get("size")), size)
        self.pax, self.longname = {}, None
        if size < 0:
            raise self._bad_header(start, False, "negative size")
        padded = (size + BLOCK - 1) & ~(BLOCK - 1)
        if kind == _AREG and name.endswith("/"):  # a V7 directory: no data
            return None
        if kind not in _REGULAR:
            if kind in _SKIP_DATA:  # an unknown type: tarfile skips its data as a file's
                self._skip(padded, name)
            return None
        return name, size

    def _extended(self, kind: int, size: int) -> None:
        """Read a GNU long name/link or pax header that applies to the next member."""
        if kind == _SPARSE:
            raise TarDamaged(f"a GNU sparse member at byte {self.bytes_read}: not supported")
        if size < 0:
            raise TarDamaged(f"a negative size at byte {self.bytes_read}")
        padded = (size + BLOCK - 1) & ~(BLOCK - 1)
        if kind in (_LONGNAME, _LONGLINK):
            data = self._take(padded, "a long name")[:size]
            if kind == _LONGNAME:
                self.longname = _text(data)
            return
        records = _pax_records(self._take(padded, "a pax header")[:size])
        (self.pax_global if kind == _PAX_GLOBAL else self.pax).update(records)

    def _name(self, header: bytes, longname: str | None, pax: dict[str, bytes]) -> str:
        """A member's name: pax `path`, else a GNU long name, else the ustar prefix and name fields."""
        path = pax.get("path", self.pax_global.get("path"))
        if path is not None:
            return path.decode("utf-8", "surrogateescape")
        if longname is not None:
            return longname
        name = _text(header[:100])
        if header[345]:
            name = _text(header[345:500]) + "/" + name
        return name


def sample_field(name: str) -> tuple[str, str] | None:
    """(key, suffix) of a regular member as webdataset's `tar_file_iterator` and `group_by_keys` see it, or None
    for a member they pass over (metadata, a name without a suffix)."""
    meta_prefix, meta_suffix, skip_meta, base_plus_ext = _webdataset_rules()
    if "/" not in name and name.startswith(meta_prefix) and name.endswith(meta_suffix):
        return None
    if skip_meta.match(name):
        return None
    key, suffix = base_plus_ext(name)
    if key is None:
        return None
    return key, suffix.lower()


class Sample:
    """One sample: its key, its fields' suffixes, and the bytes of the fields asked for."""

    __slots__ = ("key", "suffixes", "data")

    def __init__(self, key: str) -> None:
        self.key, self.suffixes, self.data = key, set(), {}

    def __contains__(self, suffix: object) -> bool:  # so vit_mpp.data.image_formats.image_member works on it
        return suffix in self.suffixes


def samples(reader: TarReader, wanted: frozenset[str] = frozenset()) -> Iterator[Sample]:
    """The samples of a tar, grouped as webdataset groups them (consecutive fields with the same key); a field
    that appears twice in one sample, which webdataset refuses with a ValueError, is `TarDamaged`. `wanted` names
    the suffixes whose bytes are kept."""
    current: Sample | None = None
    for key, suffix, data in reader.fields(wanted):
        if current is None or key != current.key:
            if current is not None:
                yield current
            current = Sample(key)
        if suffix in current.suffixes or suffix in ("__key__", "__url__"):
            raise TarDamaged(f"a second '{suffix}' in sample {key} (webdataset refuses the shard)")
        current.suffixes.add(suffix)
        if data is not None:
            current.data[suffix] = data
    if current is not None:
        yield current


def count_samples(stream: BinaryIO) -> int:
    """How many samples a tar stream holds (a convenience for tests and tools)."""
    return sum(1 for _ in samples(TarReader(stream)))


def describe(error: BaseException) -> str:
    """One line for any error met while reading a shard: a TarDamaged's reason as it is, others with their type."""
    text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
    return " ".join((text if isinstance(error, TarDamaged) else f"{type(error).__name__}: {text}").split())
