"""The sample index in memory: every shard a process has met (`TABLE`: its path, usable
count and what was left out; rows memory-mapped on first read) and a dataset's samples as
integers (`Entries`).

What a process holds: per shard its path and count (O(shards)); per sample nothing: a sample is
a position in a list of shard runs, located by binary search, and its row is read from the
shard's memory-mapped ``.idx.npy`` (page cache, shared by every rank and loader worker of a
node; nothing is copied on read). Subsets (replay buffers, subsampled evaluation sets) are
int64 arrays of packed (shard id, row).

The index files themselves (format, writing, proving that an index belongs to its tar,
building what is missing, a stream's summary) are `cvl.data.shardindex`; the tar format is
`cvl.data.tarfmt`.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cvl.data.shardindex import (  # noqa: F401 (re-exported: the index's public names)
    SCHEMA,
    cached_rows,
    ensure_indexed,
    fix_command,
    index_files,
    is_remote,
    use_index_prefix,
    write_index,
)
from cvl.data.tarfmt import IMAGE_EXTS, MemberLog, row_dtype, scan_tar  # noqa: F401
from cvl.errors import CvlError

_ROW = 1 << 32  # packed sample id: shard id * 2**32 + row


class _Unpackers(dict):
    """Row size -> a struct unpacking a row's six int64 and its key bytes."""

    def __missing__(self, size: int) -> Any:
        self[size] = struct.Struct(f"<6q{size - 48}s").unpack_from
        return self[size]


_UNPACK = _Unpackers()


# -- the process-wide shard table ------------------------------------------------------------
class _Table:
    """Every shard this process has met: path, usable count, skipped reasons; rows are
    memory-mapped on first read (an LRU of as many maps as open shards, `cvl.data.remote`:
    each map holds a descriptor)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.ids: dict[str, int] = {}
        self.counts: list[int] = []
        self.sizes: list[int | None] = []  # the tar's bytes when indexed
        self.stamps: list[Any] = []  # local: the tar's (size, mtime) when met; remote: summary
        self.skipped: list[tuple] = []
        self.maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self.raw: dict[int, tuple[memoryview, int]] = {}  # sid -> (the map's bytes, row size)
        self.pid = os.getpid()
        self.max_maps = 0

    def add(self, shards: Sequence[str]) -> np.ndarray:
        """Shard ids of `shards`, indexing what is new; a local shard that changed since it
        was met (size or time) gets a new id (and index), so no dataset mixes two versions."""
        new = [s for s in dict.fromkeys(shards) if not self._known(s)]
        for s, d in zip(new, ensure_indexed(new)):
            self.ids[s] = len(self.paths)
            self.paths.append(s)
            self.counts.append(int(d["count"]))
            self.sizes.append(d.get("tar_bytes"))
            self.stamps.append(d if is_remote(s) else _stamp(s))
            self.skipped.append(tuple(tuple(x) for x in d.get("skipped", ())))
        return np.array([self.ids[s] for s in shards], dtype=np.int64)

    def _known(self, shard: str) -> bool:
        sid = self.ids.get(shard)
        if sid is None:
            return False
        if is_remote(shard):
            return True
        return _stamp(shard) == self.stamps[sid]

    def fetch_rows(self, sids: Iterable[int]) -> None:
        """Bring the rows of the remote shards among `sids` not met yet into the node's index
        cache together (a batch's first touch of many shards costs one round trip)."""
        todo = [
            s
            for s in dict.fromkeys(int(x) for x in sids)
            if s not in self.maps and self.counts[s] and is_remote(index_files(self.paths[s])[0])
        ]
        if len(todo) > 1:
            cached_rows([self.paths[s] for s in todo], [self.stamps[s] for s in todo])

    def row(self, sid: int, row: int) -> tuple[int, int, int, int, int, int, str]:
        """One row as Python values (image offset, size, text offset, size, meta offset, size,
        key), unpacked from the map's bytes: no numpy call (a single item's read)."""
        raw = self.raw.get(sid) if self.pid == os.getpid() else None
        if raw is None or sid not in self.maps:
            m = self.rows(sid)
            raw = self.raw[sid] = (memoryview(m.view(np.uint8).reshape(-1)), m.dtype.itemsize)
        buf, size = raw
        *spans, key = _UNPACK[size](buf, row * size)
        return (*spans, key.rstrip(b"\0").decode("utf-8"))

    def rows(self, sid: int) -> np.ndarray:
        if self.pid != os.getpid():  # a forked loader worker: maps are per process
            self.maps, self.raw, self.pid = OrderedDict(), {}, os.getpid()
        m = self.maps.get(sid)
        if m is not None:
            self.maps.move_to_end(sid)
            return m
        path = self.paths[sid]
        npy = index_files(path)[0]
        if self.counts[sid] == 0:
            return np.zeros(0, row_dtype(1))  # (numpy cannot map an empty array)
        if is_remote(npy):  # fetched once per node into the index cache, then mapped
            npy = cached_rows([path], [self.stamps[sid]])[0]
        try:  # a plain view of the map (np.memmap's indexing costs µs a call)
            m = np.load(npy, mmap_mode="r", allow_pickle=False).view(np.ndarray)
        except (OSError, ValueError) as e:
            raise CvlError(
                f"{path}: cannot read its index {npy} ({e}); rebuild it: {fix_command(path)}"
            ) from None
        if len(m) != self.counts[sid]:
            raise CvlError(
                f"{path}: its index {npy} changed while in use; rebuild it ({fix_command(path)}) "
                "and start the command again"
            )
        self.maps[sid] = m
        if not self.max_maps:
            from cvl.data.remote import _open_limit

            self.max_maps = _open_limit()
        if len(self.maps) > self.max_maps:
            self.raw.pop(self.maps.popitem(last=False)[0], None)
        return m


TABLE = _Table()


@dataclass(frozen=True)
class Entry:
    """Where one sample lives: shard file, key, and (offset, size) of its members."""

    shard: str
    key: str
    image: tuple[int, int]
    text: tuple[int, int]
    meta: tuple[int, int] | None

    @property
    def ref(self) -> tuple[str, str]:
        return (self.shard, self.key)


def _entry(sid: int, row: int) -> Entry:
    r = TABLE.rows(sid)[row]
    meta = (int(r["meta"][0]), int(r["meta"][1]))
    return Entry(
        TABLE.paths[sid],
        bytes(r["key"]).decode("utf-8"),
        (int(r["image"][0]), int(r["image"][1])),
        (int(r["text"][0]), int(r["text"][1])),
        None if meta[0] < 0 else meta,
    )


class Entries(Sequence):
    """The samples of a dataset as integers (module doc): a list of parts, each all usable
    samples of a run of shards (in file order) or an array of packed (shard id, row).

    Behaves as a read-only sequence of `Entry` (built on demand, one at a time); `take`,
    `+` and slices give other `Entries` without touching samples."""

    def __init__(self, parts: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        self.parts = list(parts)  # empty parts too: their skipped samples count
        lens = [int(p[2][-1]) for p in self.parts]
        self.bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.n = int(self.bounds[-1])

    @classmethod
    def of_shards(cls, shards: Iterable[str | os.PathLike]) -> Entries:
        """Every usable sample of the shards, in shard then file order."""
        paths = [str(s) if is_remote(str(s)) else os.path.abspath(s) for s in shards]
        sids = TABLE.add(paths)
        counts = np.array([TABLE.counts[i] for i in sids], dtype=np.int64)
        return cls([("shards", sids, np.concatenate([[0], np.cumsum(counts)]))])

    @classmethod
    def concat(cls, parts: Iterable[Entries]) -> Entries:
        """One dataset of several, in order."""
        return cls([p for e in parts for p in e.parts])

    @classmethod
    def of_ids(cls, ids: np.ndarray) -> Entries:
        ids = np.asarray(ids, dtype=np.int64)
        return cls([("ids", ids, np.array([0, len(ids)], dtype=np.int64))])

    def skipped(self) -> Counter:
        """Samples the shards of this dataset's shard runs left out, by reason."""
        c: Counter = Counter()
        for kind, ids, _ in self.parts:
            if kind == "shards":
                for sid in ids:
                    c.update(reason for _, reason in TABLE.skipped[int(sid)])
        return c

    def __len__(self) -> int:
        return self.n

    def ids(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Packed (shard id, row) of the samples at `positions` (vectorised)."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < -len(self) or pos.max() >= len(self)):
            raise IndexError("Entries index out of range")
        pos = np.where(pos < 0, pos + len(self), pos)
        part = np.searchsorted(self.bounds, pos, side="right") - 1
        out = np.empty(len(pos), dtype=np.int64)
        for k in np.unique(part):
            sel = part == k
            kind, arr, cum = self.parts[k]
            off = pos[sel] - self.bounds[k]
            if kind == "ids":
                out[sel] = arr[off]
            else:
                j = np.searchsorted(cum, off, side="right") - 1
                out[sel] = arr[j] * _ROW + (off - cum[j])
        return out

    def all_ids(self) -> np.ndarray:
        """Packed ids of every sample (8 B each: for subsets, not whole streams)."""
        return self.ids(np.arange(len(self)))

    def locate(self, i: int) -> tuple[int, int]:
        """(shard id, row) of sample i (bisection on Python lists: a single item costs no
        numpy call; the lists are made on first use, O(parts + shards))."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError("Entries index out of range")
        i = i + n if i < 0 else i
        if not hasattr(self, "_lists"):
            self._lists = (self.bounds.tolist(), {})
        bounds, per = self._lists
        k = bisect.bisect_right(bounds, i) - 1
        kind, arr, cum = self.parts[k]
        off = i - bounds[k]
        if kind == "ids":
            v = int(arr[off])
            return v // _ROW, v % _ROW
        if k not in per:
            per[k] = (cum.tolist(), arr.tolist())
        cl, sids = per[k]
        j = bisect.bisect_right(cl, off) - 1
        return sids[j], off - cl[j]

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        return _entry(*self.locate(int(i)))

    def __iter__(self) -> Iterator[Entry]:
        for i in range(len(self)):
            yield self[i]

    def take(self, positions: np.ndarray | Sequence[int]) -> Entries:
        """The samples at `positions`, in that order (an id array)."""
        return Entries.of_ids(self.ids(positions))

    def __add__(self, other: Any) -> Entries:
        if isinstance(other, Entries):
            return Entries(self.parts + other.parts)
        if not other:
            return self
        return NotImplemented

    def __radd__(self, other: Any) -> Entries:
        if not other:
            return self
        return NotImplemented

    def shard_paths(self) -> list[str]:
        """The distinct shards holding these samples, in first-seen order."""
        seen: dict[int, None] = {}
        for kind, arr, _ in self.parts:
            for sid in arr if kind == "shards" else np.unique(arr // _ROW):
                seen.setdefault(int(sid), None)
        return [TABLE.paths[s] for s in seen]

    def shard_of(self, i: int) -> str:
        return TABLE.paths[self.locate(i)[0]]


def path_of(sid: int) -> str:
    return TABLE.paths[sid]


def _stamp(shard: str) -> tuple[int, int] | None:
    try:
        st = os.stat(shard)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def ids_of_refs(refs: Sequence[tuple[str, str]]) -> np.ndarray:
    """Packed ids of samples given by (shard path, key), each shard's index read once; -1 for
    a key its shard does not hold."""
    by_shard: dict[str, list[int]] = {}
    for i, (shard, _) in enumerate(refs):
        by_shard.setdefault(str(shard), []).append(i)
    ids = np.empty(len(refs), dtype=np.int64)
    for shard, at in by_shard.items():
        ids[at] = ids_of_keys(shard, [refs[i][1] for i in at])
    return ids


def ids_of_keys(shard: str, keys: Sequence[str]) -> np.ndarray:
    """Packed ids of samples given by (shard, key), e.g. an old run's replay buffer; -1 for a
    key the shard does not hold."""
    sid = int(TABLE.add([shard])[0])
    rows = TABLE.rows(sid)
    where = {bytes(k).decode("utf-8"): i for i, k in enumerate(rows["key"])}
    return np.array([sid * _ROW + where[k] if k in where else -1 for k in keys], dtype=np.int64)
