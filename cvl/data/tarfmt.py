"""What cvl knows of the tar format: a webdataset tar's members grouped into samples (the
index's rows, `MemberLog` / `scan_tar`), and the check, at every read, that the header just
before a member's data still describes the member the index says (`header_mismatch`).

Grouping follows webdataset (a sample is the members that share a key, ``KEY.EXT``) with
two rules webdataset leaves implicit: members of one key that are not consecutive are one
sample as long as no extension repeats (``a.jpg b.jpg a.txt b.txt`` gives two samples), and a
repeated extension starts a second sample of the same key (``a.jpg a.txt b.jpg b.txt a.jpg
a.txt`` gives three, as webdataset yields them). Nothing is dropped without a count: samples
left out carry a reason (`skipped`), members that belong to no usable part of a sample are
counted by extension (`unused`), and repeated keys are counted (`duplicate_keys`).
"""

from __future__ import annotations

import contextlib
import tarfile
from collections import Counter

import numpy as np

from cvl.errors import CvlError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
# image formats PIL reads that webdataset writers emit, which cvl's index leaves out (named)
OTHER_IMAGE_EXTS = ("gif", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "pnm", "avif", "heic", "jxl")
HEADER = 512  # a member's ustar header: the 512 bytes just before its data
_REGULAR = (ord("0"), 0, ord("7"))  # typeflags of a regular file
_COMPRESSED = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)


def row_dtype(keylen: int) -> np.dtype:
    """An index row: (offset, size) of the image, text and meta members' data, and the key."""
    return np.dtype(
        [("image", "<i8", 2), ("text", "<i8", 2), ("meta", "<i8", 2), ("key", f"S{max(1, keylen)}")]
    )


class MemberLog:
    """Collects the members of a tar in file order (name, data offset, size, kind) and groups
    them into samples (module doc); `index()` gives the index rows and what was left out."""

    def __init__(self) -> None:
        self.samples: list[tuple[str, dict[str, tuple[int, int]], dict[str, str]]] = []
        self._open: dict[str, int] = {}  # key -> its latest sample
        self.duplicate_keys = 0

    def add(self, name: str, offset: int, size: int, kind: str = "file") -> None:
        """A member: `kind` is "file", or what else it is (symlink, hardlink, ...)."""
        base = name.rsplit("/", 1)[-1]
        if "." not in base:
            return
        stem, ext = base.split(".", 1)
        key, ext = name[: len(name) - len(base)] + stem, ext.lower()
        at = self._open.get(key)
        if at is not None:
            _, files, other = self.samples[at]
            if ext in files or ext in other:  # a repeated extension: a second sample of key
                self.duplicate_keys += 1
                at = None
        if at is None:
            at = self._open[key] = len(self.samples)
            self.samples.append((key, {}, {}))
        _, files, other = self.samples[at]
        if kind == "file":
            files[ext] = (offset, size)
        else:
            other[ext] = kind

    def index(self) -> tuple[np.ndarray, list[tuple[str, str]], dict[str, int]]:
        """(rows, skipped [(key, reason)], unused members by extension); reasons:
        missing_image, unsupported_image:EXT, link_member:KIND, missing_caption,
        empty_caption."""
        rows, skipped, unused = [], [], Counter()
        for key, files, other in self.samples:
            img_ext = next((e for e in IMAGE_EXTS if e in files), None)
            reason = None
            if img_ext is None:
                link = next((e for e in IMAGE_EXTS if e in other), None)
                odd = next((e for e in OTHER_IMAGE_EXTS if e in files), None)
                if link is not None:
                    reason = f"link_member:{other[link]}"
                elif odd is not None:
                    reason = f"unsupported_image:{odd}"
                else:
                    reason = "missing_image"
            elif "txt" not in files:
                reason = "link_member:" + other["txt"] if "txt" in other else "missing_caption"
            elif files["txt"][1] == 0:
                reason = "empty_caption"
            if reason is not None:
                skipped.append((key, reason))
                unused.update(list(files) + list(other))  # every member of a sample left out
                continue
            used = {img_ext, "txt", "json"}
            unused.update([e for e in files if e not in used] + list(other))
            rows.append((files[img_ext], files["txt"], files.get("json", (-1, 0)), key.encode()))
        keylen = max((len(r[3]) for r in rows), default=1)
        arr = np.array(rows, dtype=row_dtype(keylen)) if rows else np.zeros(0, row_dtype(1))
        return arr, skipped, dict(sorted(unused.items()))


def scan_tar(path: str) -> tuple[np.ndarray, list[tuple[str, str]], dict[str, int], int]:
    """Index a tar by reading its headers (once per shard cvl did not write): rows, skipped,
    unused members by extension, duplicate keys. Compressed shards are refused by name."""
    remote = "://" in path and not path.startswith("file://")
    try:
        if remote:
            from cvl.data.remote import read_range

            head = read_range(path, 0, 8)
        else:
            with open(path, "rb") as f:
                head = f.read(8)
    except OSError as e:
        raise CvlError(f"{path}: cannot read the shard ({e.strerror or e})") from None
    for magic, kind in _COMPRESSED:
        if head.startswith(magic):
            raise CvlError(
                f"{path}: a {kind}-compressed tar; cvl reads shards by byte offset and needs "
                "them uncompressed (decompress each shard, e.g. `gunzip -c x.tar.gz > x.tar`, "
                "and point the stream at the .tar files)"
            )
    log = MemberLog()
    try:
        with contextlib.ExitStack() as stack:
            if remote:  # read through once, in order (a tar has no table of contents)
                import fsspec

                f = stack.enter_context(fsspec.open(path, "rb"))
                tf = stack.enter_context(tarfile.open(fileobj=f, mode="r|"))
            else:
                tf = stack.enter_context(tarfile.open(path, mode="r:"))
            for ti in tf:
                if ti.isfile():
                    log.add(ti.name, ti.offset_data, ti.size)
                elif ti.issym() or ti.islnk():
                    log.add(ti.name, ti.offset_data, 0, "symlink" if ti.issym() else "hardlink")
    except (tarfile.TarError, OSError) as e:
        raise CvlError(
            f"{path}: not a readable tar shard ({e}); rebuild or replace the file"
        ) from None
    rows, skipped, unused = log.index()
    return rows, skipped, unused, log.duplicate_keys


def header_mismatch(block: bytes | memoryview, key: str, size: int) -> str | None:
    """Why `block` (the 512 bytes before a member's data) is not the header of a regular
    member of sample `key` holding `size` bytes; None when it is.

    The name is compared as far as the header holds it (ustar prefix + name; a long name is
    cut at 100 bytes and a non-ASCII one may be re-encoded in a pax header, so a truncated
    name is checked as a prefix and a non-ASCII key by size only). A few µs: every sample read
    checks each of its members, so an index that no longer belongs to its tar is caught at
    the first sample it would have misread. A ustar / GNU header is recognised by its magic;
    an old (v7) one by its checksum."""
    b = bytes(block)
    if (  # the common case in one pass: the name and size as tarfile and GNU tar write them
        b[124:135] == b"%011o" % size
        and b[257:262] == b"ustar"
        and b[156] in _REGULAR
        and b.startswith(key.encode("utf-8") + b".")
    ):
        return None
    if len(b) != HEADER:
        return f"a short read ({len(b)} of {HEADER} header bytes)"
    if b[257:262] != b"ustar":  # v7: no magic, only the checksum tells a header
        try:
            stored = int(b[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
        except ValueError:
            stored = -1
        if stored != sum(b) - sum(b[148:156]) + 256:
            return "no member header there"
    if b[156] not in _REGULAR:
        return "no regular member there"
    raw = b[124:136]
    if raw[0] & 0x80:  # base-256 (members of 8 GiB and more)
        have = int.from_bytes(raw[1:], "big")
    else:
        try:
            have = int(raw.split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            return "no member header there"
    if have != size:
        return f"a member of {have} bytes where the index says {size}"
    name = b[:100].split(b"\0", 1)[0]
    if b[257:263] == b"ustar\x00" and b[345] != 0:  # POSIX ustar: prefix/name
        name = b[345:500].split(b"\0", 1)[0] + b"/" + name
    if not key.isascii():
        return None
    k = key.encode("ascii") + b"."
    if name.startswith(k) or (len(name) >= 99 and k.startswith(name)):
        return None
    return f"member '{name.decode('utf-8', 'replace')}'"
