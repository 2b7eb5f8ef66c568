"""A batch of samples' bytes, read by the index: one range per sample (its members are
neighbours in the tar: from the first member's header to the last member's end), neighbouring
samples merged into one range, every range of the batch in flight together for shards at URLs
(`cvl.data.remote.fetch_ranges`), and each member's tar header checked against the index.

Local shards are read with one `pread` a range (`Files`). Shards at URLs are read by range;
with `window` > 1 (`cvl train --shuffle-block K`: a batch draws runs of neighbouring samples)
whole windows of `window` rows are fetched and kept in a small per-process cache
(`CVL_WINDOW_CACHE_MB`, default 128), so the next batches of the same run cost no request;
with a shard cache (`cvl.data.shardcache`) a shard at a URL is fetched whole once per node and
read locally.

What fails here is never a bad sample: a missing or unreadable shard, a transport error after
its retries, a short read, or a header that does not name the sample the index says (the
shard changed after it was indexed) is a `ShardError`: one line naming the shard and, for a
stale index, the command that rebuilds it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from cvl.data.index import _ROW, TABLE, Entry, fix_command, is_remote
from cvl.data.remote import Files, fetch_ranges
from cvl.data.tarfmt import HEADER, header_mismatch
from cvl.errors import CvlError

LOCAL_GAP = 4096  # bytes between two samples' ranges that one pread may span (local shards)
REMOTE_GAP = 64 * 1024  # ... that one request may span (shards at URLs)
MAX_RANGE = 64 << 20  # one request or pread holds at most this many bytes (merged ranges)
_BIG = np.int64(2**62)
WINDOW_ROWS = 256  # a window never holds more rows than this, whatever --shuffle-block says


class ShardError(CvlError):
    """A shard that cannot be read as its index says (transport, file, stale index): the run
    stops; never taken for a sample that fails to decode."""


class Sample(NamedTuple):
    """One sample's bytes: its shard and key, the image, caption and metadata members."""

    shard: str
    key: str
    image: bytes
    text: bytes
    meta: bytes | None


_FILES = Files()
_WINDOWS: OrderedDict[tuple[int, int], tuple[int, bytes]] = OrderedDict()
_WSTATE = {"pid": -1, "bytes": 0}


def _window_budget() -> int:
    try:
        return int(float(os.environ.get("CVL_WINDOW_CACHE_MB") or 128) * (1 << 20))
    except ValueError:
        raise CvlError("CVL_WINDOW_CACHE_MB: not a number of megabytes") from None


def _spans(img: np.ndarray, txt: np.ndarray, meta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's [start, end): from its first member's header to its last member's end."""
    has_meta = meta[:, 0] >= 0
    big = _BIG
    first = np.minimum(np.minimum(img[:, 0], txt[:, 0]), np.where(has_meta, meta[:, 0], big))
    last = np.maximum(img.sum(1), txt.sum(1))
    last = np.maximum(last, np.where(has_meta, meta.sum(1), 0))
    return first - HEADER, last


def _merge(
    starts: list[int], ends: list[int], at: list[int], gap: int
) -> list[tuple[int, int, list[int]]]:
    """Requests covering the spans of samples `at` (positions into `starts` / `ends`):
    (start, end, the samples) with spans closer than `gap` bytes merged, up to `MAX_RANGE` a
    request (plain lists: a batch's few dozen spans cost less without numpy calls)."""
    out: list[tuple[int, int, list[int]]] = []
    for i in sorted(at, key=starts.__getitem__):
        a, b = starts[i], ends[i]
        if out and a - out[-1][1] <= gap and max(b, out[-1][1]) - out[-1][0] <= MAX_RANGE:
            s, e, members = out[-1]
            out[-1] = (s, max(e, b), members)
            members.append(i)
        else:
            out.append((a, b, [i]))
    return out


def _cut(
    shard: str, key: str, buf: bytes, base: int, off: int, size: int, name: bytes = b""
) -> bytes:
    """A member's data from `buf` (bytes from `base` on), its header checked first: the
    common case (the name and size fields as tarfile and GNU tar write them: a member of
    another name or size cannot match) compared in place, any other header by
    `header_mismatch`. `name`: `key` encoded with its dot (computed once a sample)."""
    h = off - HEADER - base
    if not (
        buf.startswith(b"%011o" % size, h + 124) and buf.startswith(name or key.encode() + b".", h)
    ):
        why = header_mismatch(buf[h : h + HEADER], key, size)
        if why is not None:
            raise ShardError(
                f"{shard}: changed since it was indexed (where the index puts {key}, the tar "
                f"holds {why}); rebuild its index with {fix_command(shard)} and start again"
            )
    return buf[off - base : off + size - base]


def _local_path(shard: str) -> str:
    if is_remote(shard):
        from cvl.data.shardcache import local_copy

        return local_copy(shard) or shard
    return shard


def read_located(
    shards: list[str],
    keys: list[str],
    img: np.ndarray,
    txt: np.ndarray,
    meta: np.ndarray,
    window_of: list[tuple[int, int, int, int] | None] | None = None,
) -> list[Sample]:
    """Samples given by shard, key and member spans ((offset, size) rows; meta (-1, 0) when
    absent). `window_of[i]` = (shard id, window, start, end) reads sample i through a cached
    window of its shard (remote shards under a block order)."""
    n = len(keys)
    first, last = _spans(img, txt, meta)
    starts, ends = first.tolist(), last.tolist()
    bufs: list[tuple[Any, int] | None] = [None] * n  # (bytes, offset of its first byte)
    by_shard: dict[str, list[int]] = {}
    for i, s in enumerate(shards):
        by_shard.setdefault(s, []).append(i)
    remote_jobs: list[tuple[str, int, int, list[int], Any]] = []
    for shard, at in by_shard.items():
        path = _local_path(shard)
        if not is_remote(path):
            for a, b, members in _merge(starts, ends, at, LOCAL_GAP):
                data = _read_local(shard, path, a, b)
                for m in members:
                    bufs[m] = (data, a)
            continue
        windowed = [i for i in at if window_of and window_of[i] is not None]
        for i in windowed:
            w = window_of[i]  # type: ignore[index]
            hit = _window_get((w[0], w[1]))
            if hit is not None:
                bufs[i] = (hit[1], hit[0])
        need = {}
        for i in windowed:
            if bufs[i] is None:
                w = window_of[i]  # type: ignore[index]
                need.setdefault((w[0], w[1]), (w[2], w[3], []))[2].append(i)
        for wkey, (a, b, members) in need.items():
            remote_jobs.append((path, a, b, members, wkey))
        waiting = _flat(need)
        plain = [i for i in at if bufs[i] is None and i not in waiting]
        for a, b, members in _merge(starts, ends, plain, REMOTE_GAP):
            remote_jobs.append((path, a, b, members, None))
    if remote_jobs:
        try:
            blobs = fetch_ranges([(u, a, b) for u, a, b, _, _ in remote_jobs])
        except CvlError as e:
            raise ShardError(str(e)) from None
        for (_, a, _, members, wkey), data in zip(remote_jobs, blobs):
            if wkey is not None:
                _window_put(wkey, a, data)
            for m in members:
                bufs[m] = (data, a)
    out = []
    for (buf, base), s, k, (io, isz), (to, tsz), (mo, msz) in zip(  # type: ignore[misc]
        bufs, shards, keys, img.tolist(), txt.tolist(), meta.tolist()
    ):
        nm = k.encode() + b"."
        m = _cut(s, k, buf, base, mo, msz, nm) if mo >= 0 else None
        i, t = _cut(s, k, buf, base, io, isz, nm), _cut(s, k, buf, base, to, tsz, nm)
        out.append(Sample(s, k, i, t, m))
    return out


def _flat(need: dict) -> set[int]:
    return {i for _, _, members in need.values() for i in members}


def _read_local(shard: str, path: str, a: int, b: int) -> bytes:
    try:
        return _FILES.read(path, (a, b - a))
    except CvlError as e:
        msg = str(e) if path == shard else f"{shard} (cached as {path}): {e}"
        raise ShardError(msg) from None


def _window_get(wkey: tuple[int, int]) -> tuple[int, bytes] | None:
    if _WSTATE["pid"] != os.getpid():
        _WINDOWS.clear()
        _WSTATE.update(pid=os.getpid(), bytes=0)
    hit = _WINDOWS.get(wkey)
    if hit is not None:
        _WINDOWS.move_to_end(wkey)
    return hit


def _window_put(wkey: tuple[int, int], base: int, data: bytes) -> None:
    _WINDOWS[wkey] = (base, data)
    _WSTATE["bytes"] += len(data)
    budget = _window_budget()
    while _WSTATE["bytes"] > budget and len(_WINDOWS) > 1:
        _, (_, old) = _WINDOWS.popitem(last=False)
        _WSTATE["bytes"] -= len(old)


def read_ids(ids: np.ndarray, window: int = 1) -> list[Sample]:
    """The samples with packed ids `ids` (`cvl.data.index`), in order (module doc)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    sids, rows = ids // _ROW, ids % _ROW
    img = np.empty((n, 2), np.int64)
    txt = np.empty((n, 2), np.int64)
    meta = np.empty((n, 2), np.int64)
    keys: list[str] = [""] * n
    shards: list[str] = [""] * n
    window_of: list[Any] | None = [None] * n if window > 1 else None
    unique = np.unique(sids).tolist()
    TABLE.fetch_rows(unique)  # a remote shard's rows: fetched together on a batch's first touch
    for sid in unique:
        sel = np.flatnonzero(sids == sid)
        table = TABLE.rows(sid)
        r = table[rows[sel]]
        img[sel], txt[sel], meta[sel] = r["image"], r["text"], r["meta"]
        path = TABLE.paths[sid]
        for j, k in zip(sel.tolist(), r["key"].tolist()):
            keys[j] = k.decode("utf-8")
            shards[j] = path
        if window_of is not None and is_remote(path):
            w = min(window, WINDOW_ROWS)
            wins = rows[sel] // w
            for wi in np.unique(wins).tolist():
                span = _window(sid, wi, w, table)
                for j in sel[wins == wi].tolist():
                    window_of[j] = span
    return read_located(shards, keys, img, txt, meta, window_of)


def _window(sid: int, w: int, size: int, table: np.ndarray) -> tuple[int, int, int, int] | None:
    """(shard id, window, start, end) of window `w` of a shard's rows (its byte span), or None
    when that span is too large to hold (then its samples are read one range each)."""
    lo, hi = w * size, min(len(table), (w + 1) * size)
    part = table[lo:hi]
    a, b = _spans(part["image"], part["text"], part["meta"])
    start, end = int(a.min()), int(b.max())
    return (sid, w, start, end) if end - start <= MAX_RANGE else None


def read_entries(entries: list[Entry]) -> list[Sample]:
    """The samples of hand-made `Entry` objects (or ones built from the index), in order."""
    n = len(entries)
    img = np.array([e.image for e in entries], dtype=np.int64).reshape(n, 2)
    txt = np.array([e.text for e in entries], dtype=np.int64).reshape(n, 2)
    meta = np.array([e.meta or (-1, 0) for e in entries], dtype=np.int64).reshape(n, 2)
    return read_located([e.shard for e in entries], [e.key for e in entries], img, txt, meta)


def read_member(e: Entry, field: str) -> bytes:
    """One member ("image", "text" or "meta") of a sample, its tar header checked first."""
    span = getattr(e, field)
    if span is None:
        raise ValueError(f"{e.key}: no {field} member")
    off, size = span
    path = _local_path(e.shard)
    if is_remote(path):
        try:
            data = fetch_ranges([(path, off - HEADER, off + size)])[0]
        except CvlError as err:
            raise ShardError(str(err)) from None
    else:
        data = _read_local(e.shard, path, off - HEADER, off + size)
    return _cut(e.shard, e.key, data, off - HEADER, off, size)


def read_one(sid: int, row: int, window: int = 1) -> Sample:
    """One sample by (shard id, row): a local shard's in one `pread` with no numpy call on the
    way (`PairDataset[i]`); a remote one through `read_ids` (windows, the shard cache)."""
    path = TABLE.paths[sid]
    if is_remote(path):
        return read_ids(np.array([sid * _ROW + row], dtype=np.int64), window)[0]
    io, isz, to, tsz, mo, msz, key = TABLE.row(sid, row)
    a = min(io, to, mo if mo >= 0 else io) - HEADER
    b = max(io + isz, to + tsz, mo + msz if mo >= 0 else 0)
    data = _read_local(path, path, a, b)
    nm = key.encode() + b"."
    m = _cut(path, key, data, a, mo, msz, nm) if mo >= 0 else None
    return Sample(
        path, key, _cut(path, key, data, a, io, isz, nm), _cut(path, key, data, a, to, tsz, nm), m
    )
