"""The on-disk sample index of webdataset shards, written once and memory-mapped.

Beside each shard ``NAME.tar`` lie two small files (format ``cvl.index/1``):

- ``NAME.idx.npy``: a numpy structured array, one row per usable sample in file order:
  ``image``, ``text``, ``meta`` = (offset, size) of the members' data in the tar (``meta`` =
  (-1, 0) without KEY.json) and ``key`` (the sample key, bytes). 32 + len(key) bytes a sample.
- ``NAME.idx.json``: ``{"schema", "count", "skipped": [[key, reason], ...], "tar_bytes"}``:
  the usable samples, those left out (no image, no caption, an empty caption) and the tar's
  size when indexed (an index whose tar changed size is rebuilt).

`ShardSink` writes both as it writes the tar (the offsets tarfile reports, nothing re-read).
Shards cvl did not write (img2dataset's, a downloaded webdataset, streams built before
indexes existed) are indexed on first use: one process per folder takes a lock, indexes every
missing shard in parallel (`index_processes`) and the others wait and reuse its files. When a
shard's folder is not writable the files go to ``$CVL_INDEX_CACHE`` (default
``~/.cache/cvl/index``), named by a hash of the shard's path.

What a process holds (`Entries`): per shard its path and count (O(shards)); per sample
nothing: a sample is a position in a list of shard runs, located by binary search, and its
row is read from the shard's memory-mapped ``.idx.npy`` (page cache, shared by every rank and
loader worker of a node; nothing is copied on read). Subsets (replay buffers, subsampled
evaluation sets) are int64 arrays of packed (shard id, row).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tarfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cvl.errors import CvlError

SCHEMA = "cvl.index/1"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
_ROW = 1 << 32  # packed sample id: shard id * 2**32 + row


def _dtype(keylen: int) -> np.dtype:
    return np.dtype(
        [("image", "<i8", 2), ("text", "<i8", 2), ("meta", "<i8", 2), ("key", f"S{max(1, keylen)}")]
    )


def is_remote(path: str) -> bool:
    """A shard addressed by URL (fsspec: http(s)://, s3://, gs://, ...), not a local path."""
    return "://" in str(path) and not str(path).startswith("file://")


def _stem(shard: str) -> str:
    return shard[:-4] if shard.endswith(".tar") else shard


_PREFIXES: dict[str, str] = {}  # a collection's root -> where its index files are


def use_index_prefix(root: str, prefix: str) -> None:
    """The index files of the shards under `root` (a folder or URL) lie under `prefix` (a
    folder or URL) at each shard's path relative to `root` (`cvl index --index-prefix`: the
    index of a read-only collection)."""
    _PREFIXES[root.rstrip("/")] = prefix.rstrip("/")


def index_files(shard: str) -> tuple[str, str]:
    """(rows, summary) paths of a shard's index: under its collection's index prefix
    (`use_index_prefix`), else beside the tar, or in the cache folder when the tar's folder is
    not writable and no index lies beside it."""
    stem = _stem(str(shard))
    for root, prefix in _PREFIXES.items():
        if stem.startswith(root + "/"):
            base = prefix + stem[len(root) :]
            return base + ".idx.npy", base + ".idx.json"
    beside = (stem + ".idx.npy", stem + ".idx.json")
    if is_remote(shard) or os.path.exists(beside[1]) or os.access(os.path.dirname(stem), os.W_OK):
        return beside
    cache = Path(os.environ.get("CVL_INDEX_CACHE") or Path.home() / ".cache" / "cvl" / "index")
    h = hashlib.sha256(os.path.abspath(stem).encode()).hexdigest()[:24]
    base = str(cache / f"{h}-{os.path.basename(stem)}")
    return base + ".idx.npy", base + ".idx.json"


# -- writing ----------------------------------------------------------------------------------
def _classify(members: dict[str, dict[str, tuple[int, int]]], order: list[str]) -> tuple:
    rows, skipped = [], []
    for key in order:
        m = members[key]
        img = next((m[e] for e in IMAGE_EXTS if e in m), None)
        if img is None:
            skipped.append((key, "missing_image"))
        elif "txt" not in m:
            skipped.append((key, "missing_caption"))
        elif m["txt"][1] == 0:
            skipped.append((key, "empty_caption"))
        else:
            rows.append((img, m["txt"], m.get("json", (-1, 0)), key.encode("utf-8")))
    keylen = max((len(r[3]) for r in rows), default=1)
    arr = np.array(rows, dtype=_dtype(keylen)) if rows else np.zeros(0, _dtype(1))
    return arr, skipped


class MemberLog:
    """Collects (member name, data offset, size) as a tar is written, in order; `index()`
    classifies them into the index rows (the reader's rules)."""

    def __init__(self) -> None:
        self.members: dict[str, dict[str, tuple[int, int]]] = {}
        self.order: list[str] = []

    def add(self, name: str, offset: int, size: int) -> None:
        base = name.rsplit("/", 1)[-1]
        if "." not in base:
            return
        key, ext = base.split(".", 1)
        key = name[: len(name) - len(base)] + key
        if key not in self.members:
            self.members[key] = {}
            self.order.append(key)
        self.members[key][ext.lower()] = (offset, size)

    def index(self) -> tuple[np.ndarray, list[tuple[str, str]]]:
        return _classify(self.members, self.order)


def scan_tar(path: str) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Index a tar by reading its headers (once per shard cvl did not write); a shard at a URL
    is read through once, in order (a tar has no table of contents)."""
    import contextlib

    log = MemberLog()
    try:
        with contextlib.ExitStack() as stack:
            if is_remote(path):
                import fsspec

                f = stack.enter_context(fsspec.open(path, "rb"))
                tf = stack.enter_context(tarfile.open(fileobj=f, mode="r|"))
            else:
                tf = stack.enter_context(tarfile.open(path, mode="r:"))
            for ti in tf:
                if ti.isfile():
                    log.add(ti.name, ti.offset_data, ti.size)
    except (tarfile.TarError, OSError) as e:
        raise CvlError(f"{path}: not a readable tar shard ({e})") from None
    return log.index()


def write_index(shard: str, rows: np.ndarray, skipped: list, tar_bytes: int) -> None:
    """Write a shard's two index files atomically (rows first: the summary marks it done)."""
    npy, js = index_files(shard)
    summary = {
        "schema": SCHEMA,
        "count": len(rows),
        "skipped": [list(s) for s in skipped],
        "tar_bytes": tar_bytes,
    }
    if is_remote(npy):  # an index prefix in an object store (one PUT each: atomic there)
        import io

        import fsspec

        buf = io.BytesIO()
        np.save(buf, rows, allow_pickle=False)
        for path, data in ((npy, buf.getvalue()), (js, json.dumps(summary).encode())):
            with fsspec.open(path, "wb") as f:
                f.write(data)
        return
    os.makedirs(os.path.dirname(npy) or ".", exist_ok=True)
    tmp = f"{npy}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, rows, allow_pickle=False)
    os.replace(tmp, npy)
    tmp = f"{js}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f)
    os.replace(tmp, js)


def _index_one(shard: str) -> int:
    rows, skipped = scan_tar(shard)
    if is_remote(shard):
        from cvl.data.remote import size

        tar_bytes = size(shard)
    else:
        tar_bytes = os.path.getsize(shard)
    write_index(shard, rows, skipped, tar_bytes)
    return len(rows)


# -- reading summaries; building what is missing -----------------------------------------------
def _summary(shard: str, check: bool = True) -> dict[str, Any] | None:
    """A shard's index summary, or None when it is missing or stale (tar size changed)."""
    js = index_files(shard)[1]
    try:
        if is_remote(js):
            from cvl.data.remote import read_bytes

            try:
                d = json.loads(read_bytes(js))
            except CvlError as e:
                if "not found" in str(e):
                    return None
                raise
        else:
            with open(js, encoding="utf-8") as f:
                d = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        if is_remote(js):
            raise
        return None if isinstance(e, ValueError) else _raise(shard, e)
    if d.get("schema") != SCHEMA:
        return None
    if check and not is_remote(shard):
        try:
            if os.path.getsize(shard) != d.get("tar_bytes"):
                return None
        except OSError as e:
            _raise(shard, e)
    return d


def _raise(shard: str, e: OSError) -> None:
    raise CvlError(f"{shard}: cannot read the shard or its index ({e.strerror or e})") from None


def index_processes() -> int:
    """Processes that index shards cvl did not write (`CVL_INDEX_PROCESSES`, default: cores)."""
    env = os.environ.get("CVL_INDEX_PROCESSES")
    if env:
        return max(1, int(env))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def ensure_indexed(
    shards: Sequence[str], remote: bool = False, done: Callable[[int], None] | None = None
) -> list[dict[str, Any]]:
    """Every shard's summary, indexing the shards that have none (module doc); in order.
    Shards at URLs are indexed only with `remote` (each is read through once: `cvl index`,
    `cvl build-stream shards`), else their index must exist. `done(samples)` is called as
    each shard is indexed (progress)."""
    out: list[dict[str, Any] | None] = [_summary(s) for s in shards]
    missing = [s for s, d in zip(shards, out) if d is None]
    if not missing:
        return out  # type: ignore[return-value]
    far = [s for s in missing if is_remote(s)]
    if far and not remote:
        raise CvlError(
            f"{far[0]}: no index beside the shard ({index_files(far[0])[1]}); remote shards "
            "need their index files beside them: run `cvl index STREAM` on the stream before "
            "copying it (streams built by this cvl have them), or `cvl index URL --index-prefix "
            "DIR` for a read-only collection"
        )
    by_folder: dict[str, list[str]] = {}
    for s in missing:
        if not is_remote(s) and not os.path.isfile(s):
            raise CvlError(f"{s}: shard not found")
        by_folder.setdefault(os.path.dirname(index_files(s)[1]), []).append(s)
    for folder, group in by_folder.items():
        if is_remote(folder):  # an object store has no locks: `cvl index --part` splits work
            _build([s for s in group if _summary(s) is None], done)
            continue
        with _folder_lock(folder):  # one process per node indexes; the others wait, then reuse
            _build([s for s in group if _summary(s) is None], done)
    return [d if d is not None else _summary(s) or _fail(s) for s, d in zip(shards, out)]


def _fail(shard: str) -> dict[str, Any]:
    raise CvlError(f"{shard}: indexing left no index (is its folder writable?)")


def _build(todo: list[str], done: Callable[[int], None] | None = None) -> None:
    """Index `todo`: local shards in processes (tar headers: CPU), shards at URLs in threads
    (waiting on the network)."""
    if not todo:
        return
    report = done or (lambda n: None)
    procs = min(index_processes(), len(todo))
    if procs <= 1 or len(todo) < 4:
        for s in todo:
            report(_index_one(s))
        return
    if is_remote(todo[0]):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(procs, 8)) as tx:
            for n in tx.map(_index_one, todo):
                report(n)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(procs, mp_context=ctx) as ex:
        for n in ex.map(_index_one, todo, chunksize=max(1, len(todo) // (procs * 8))):
            report(n)


class _folder_lock:
    """An exclusive advisory lock on `folder/.cvl-index.lock` (blocking; released on exit or
    when the process dies)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder or ".", ".cvl-index.lock")

    def __enter__(self) -> _folder_lock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


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
        self.skipped: list[tuple] = []
        self.maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self.pid = os.getpid()
        self.max_maps = 0

    def add(self, shards: Sequence[str]) -> np.ndarray:
        """Shard ids of `shards`, indexing what is new; a local shard whose size changed
        since it was met gets a new id (and index), so no dataset mixes two versions."""
        new = [s for s in dict.fromkeys(shards) if not self._known(s)]
        for s, d in zip(new, ensure_indexed(new)):
            self.ids[s] = len(self.paths)
            self.paths.append(s)
            self.counts.append(int(d["count"]))
            self.sizes.append(d.get("tar_bytes"))
            self.skipped.append(tuple(tuple(x) for x in d.get("skipped", ())))
        return np.array([self.ids[s] for s in shards], dtype=np.int64)

    def _known(self, shard: str) -> bool:
        sid = self.ids.get(shard)
        if sid is None:
            return False
        if is_remote(shard):
            return True
        try:
            return os.path.getsize(shard) == self.sizes[sid]
        except OSError:
            return False

    def rows(self, sid: int) -> np.ndarray:
        if self.pid != os.getpid():  # a forked loader worker: maps are per process
            self.maps, self.pid = OrderedDict(), os.getpid()
        m = self.maps.get(sid)
        if m is not None:
            self.maps.move_to_end(sid)
            return m
        path = self.paths[sid]
        npy = index_files(path)[0]
        if self.counts[sid] == 0:
            return np.zeros(0, _dtype(1))  # (numpy cannot map an empty array)
        if is_remote(npy):
            import io

            from cvl.data.remote import read_bytes

            m = np.load(io.BytesIO(read_bytes(npy)), allow_pickle=False)
        else:
            try:
                m = np.load(npy, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise CvlError(f"{path}: cannot read its index {npy} ({e})") from None
        if len(m) != self.counts[sid]:
            raise CvlError(f"{path}: its index {npy} changed while in use (rebuild it)")
        self.maps[sid] = m
        if not self.max_maps:
            from cvl.data.remote import _open_limit

            self.max_maps = _open_limit()
        if len(self.maps) > self.max_maps:
            self.maps.popitem(last=False)
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
        return int(self.bounds[-1])

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
        """(shard id, row) of sample i."""
        v = int(self.ids([i])[0])
        return v // _ROW, v % _ROW

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
