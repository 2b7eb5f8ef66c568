"""The on-disk index of each webdataset shard: where its files lie, writing them, proving an
index still belongs to its tar, building what is missing or stale, and the stream-level
summary that lets a stream served at a URL start with one request.

Beside each shard ``NAME.tar`` lie two small files (format ``cvl.index/1``, docs/formats.md):

- ``NAME.idx.npy``: a numpy structured array, one row per usable sample in file order:
  ``image``, ``text``, ``meta`` = (offset, size) of the members' data in the tar (``meta`` =
  (-1, 0) without KEY.json) and ``key`` (bytes). 48 B + key a sample.
- ``NAME.idx.json``: the summary: ``count``, ``skipped`` ([key, reason] of the samples left
  out), ``unused_members`` and ``duplicate_keys`` (`cvl.data.tarfmt`), and what the index
  belongs to: ``tar_bytes`` / ``tar_mtime_ns`` (the tar when indexed) and ``rows_bytes`` /
  ``rows_mtime_ns`` / ``rows_sha1`` (the ``.idx.npy`` written with it).

An index is trusted only while it provably belongs to its tar. Locally, a start compares the
recorded sizes and modification times with the files' (one `stat` each); when anything differs
(a tar replaced, even by one of the same size; a shard rewritten in place; an ``.idx.npy``
copied over; a stream copied without its times) the index is proved again: the rows file's
SHA-1 against the summary's, and the tar headers of up to `PROVE_ROWS` rows spread over the
shard against the rows' keys and sizes. A proved index gets its new times recorded; a failed
one is rebuilt (and said). Every read then checks each member's header again
(`cvl.data.tarfmt.header_mismatch`), so a shard changed during a run stops it, naming the
shard, instead of returning other samples' bytes. Remote shards are proved by those per-read
checks and, when their rows are fetched into the node's cache, by the rows' SHA-1.

A stream folder also holds ``shards.idx.json`` (``cvl.stream-index/1``): every shard's
summary, keyed as stream.json lists it, written by the builders and `cvl index STREAM`. A
stream served at a URL is started from it (one request, whatever the number of shards); without
it the shards' summaries are fetched in parallel (`cvl.data.remote.fetch_whole`).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from cvl.data.tarfmt import HEADER, header_mismatch, scan_tar
from cvl.errors import CvlError

SCHEMA = "cvl.index/1"
STREAM_SUMMARY = "shards.idx.json"
STREAM_SCHEMA = "cvl.stream-index/1"
PROVE_ROWS = 16  # rows whose tar headers are checked when an index must be proved again
_IDENTITY = ("tar_bytes", "tar_mtime_ns", "rows_bytes", "rows_mtime_ns")


def is_remote(path: str) -> bool:
    """A shard addressed by URL (fsspec: http(s)://, s3://, gs://, ...), not a local path."""
    return "://" in str(path) and not str(path).startswith("file://")


def fix_command(shard: str) -> str:
    """The command that rebuilds a shard's index (named by every error about an index)."""
    return f"`cvl index --force {shard}`"


def _stem(shard: str) -> str:
    return shard[:-4] if shard.endswith(".tar") else shard


def cache_root() -> Path:
    """The node's index cache (`CVL_INDEX_CACHE`, default ~/.cache/cvl/index)."""
    return Path(os.environ.get("CVL_INDEX_CACHE") or Path.home() / ".cache" / "cvl" / "index")


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
    h = hashlib.sha256(os.path.abspath(stem).encode()).hexdigest()[:24]
    base = str(cache_root() / f"{h}-{os.path.basename(stem)}")
    return base + ".idx.npy", base + ".idx.json"


# -- writing ----------------------------------------------------------------------------------
def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_index(
    shard: str,
    rows: np.ndarray,
    skipped: Sequence[tuple[str, str]],
    tar_bytes: int,
    unused: dict[str, int] | None = None,
    duplicate_keys: int = 0,
) -> dict[str, Any]:
    """Write a shard's two index files atomically (rows first: the summary marks it done);
    the summary records what the index belongs to (module doc). Returns the summary."""
    npy, js = index_files(shard)
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    data = buf.getvalue()
    if is_remote(npy):  # an index prefix in an object store (one PUT each: atomic there)
        st = rst = None
        _put(npy, data)
    else:
        os.makedirs(os.path.dirname(npy) or ".", exist_ok=True)
        _atomic_write(npy, data)
        rst = os.stat(npy)
        st = None if is_remote(shard) else os.stat(shard)
    summary = {
        "schema": SCHEMA,
        "count": len(rows),
        "skipped": [list(s) for s in skipped],
        "unused_members": dict(unused or {}),
        "duplicate_keys": int(duplicate_keys),
        "tar_bytes": tar_bytes,
        "tar_mtime_ns": st.st_mtime_ns if st else None,
        "rows_bytes": len(data),
        "rows_mtime_ns": rst.st_mtime_ns if rst else None,
        "rows_sha1": hashlib.sha1(data).hexdigest(),
    }
    if is_remote(js):
        _put(js, json.dumps(summary).encode("utf-8"))
    else:
        _atomic_write(js, json.dumps(summary).encode("utf-8"))
    return summary


def _put(url: str, data: bytes) -> None:
    import fsspec

    with fsspec.open(url, "wb") as f:
        f.write(data)


def index_one(shard: str) -> dict[str, Any]:
    """Index one shard by a scan of its headers (a shard at a URL is read through once); its
    summary."""
    rows, skipped, unused, dups = scan_tar(shard)
    if is_remote(shard):
        from cvl.data.remote import size

        tar_bytes = size(shard)
    else:
        tar_bytes = os.path.getsize(shard)
    return write_index(shard, rows, skipped, tar_bytes, unused, dups)


# -- reading and proving summaries ---------------------------------------------------------------
_PRELOADED: dict[str, dict[str, Any]] = {}  # remote shard URL -> summary (a stream's summary)
REBUILT: dict[str, str] = {}  # shard -> why its index was rebuilt (this process)


def _parse(raw: bytes | str, where: str) -> dict[str, Any] | None:
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return d if isinstance(d, dict) and d.get("schema") == SCHEMA and "count" in d else None


def read_summary(shard: str) -> dict[str, Any] | None:
    """A local shard's summary as written (None: missing or unreadable), unproved."""
    js = index_files(shard)[1]
    try:
        with open(js, "rb") as f:
            return _parse(f.read(), js)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CvlError(f"{shard}: cannot read its index {js} ({e.strerror or e})") from None


def _sha1(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prove(shard: str, d: dict[str, Any]) -> str | None:
    """Why the index summarised by `d` does not belong to the local tar `shard` (None: it
    does): sizes, the rows' count and SHA-1, and the headers of up to `PROVE_ROWS` rows."""
    npy = index_files(shard)[0]
    try:
        size = os.path.getsize(shard)
    except OSError as e:
        raise CvlError(f"{shard}: cannot read the shard ({e.strerror or e})") from None
    if d.get("tar_bytes") is not None and d["tar_bytes"] != size:
        return f"the tar has {size} bytes, {d['tar_bytes']} when indexed"
    if d["count"] == 0:
        return None
    if d.get("rows_sha1") and os.path.exists(npy) and _sha1(npy) != d["rows_sha1"]:
        return f"{os.path.basename(npy)} is not the rows file written with its summary"
    try:
        rows = np.load(npy, mmap_mode="r", allow_pickle=False)
        if len(rows) != d["count"] or rows.dtype.names != ("image", "text", "meta", "key"):
            return f"{os.path.basename(npy)} holds {len(rows)} rows, the summary {d['count']}"
    except (OSError, ValueError) as e:
        return f"{os.path.basename(npy)} is unreadable ({e})"
    picks = np.unique(np.linspace(0, len(rows) - 1, min(PROVE_ROWS, len(rows))).astype(np.int64))
    with open(shard, "rb") as f:
        for r in picks:
            row = rows[int(r)]
            key = bytes(row["key"]).decode("utf-8", "replace")
            for field in ("image", "text", "meta"):
                off, n = int(row[field][0]), int(row[field][1])
                if off < 0 and field == "meta":
                    continue
                if off < HEADER or off + n > size:
                    return f"row {int(r)} ({key}) lies outside the tar"
                f.seek(off - HEADER)
                why = header_mismatch(f.read(HEADER), key, n)
                if why:
                    return f"at row {int(r)} the tar holds {why}, not {key}'s {field}"
    return None


def _identity(shard: str) -> dict[str, int] | None:
    npy = index_files(shard)[0]
    try:
        st, rst = os.stat(shard), os.stat(npy)
    except FileNotFoundError:
        return None
    return {
        "tar_bytes": st.st_size,
        "tar_mtime_ns": st.st_mtime_ns,
        "rows_bytes": rst.st_size,
        "rows_mtime_ns": rst.st_mtime_ns,
    }


def local_summary(shard: str, full: bool = False) -> dict[str, Any] | None:
    """A local shard's summary when its index belongs to the tar; None when it is missing or
    stale (rebuild it: the reason is kept in `REBUILT`). Cheap when nothing changed (two
    stats); otherwise, or with `full`, the index is proved (`prove`) and, when it passes, the
    new times are recorded."""
    d = read_summary(shard)
    if d is None:
        if os.path.exists(index_files(shard)[1]):
            REBUILT[shard] = "its summary is unreadable"
        return None
    ident = _identity(shard)
    if ident is None:
        if not os.path.exists(shard):
            raise CvlError(f"{shard}: shard not found")
        REBUILT[shard] = "its rows file is missing"
        return None
    if not full and all(d.get(k) == ident[k] for k in _IDENTITY):
        return d
    why = prove(shard, d)
    if why is not None:
        REBUILT[shard] = why
        return None
    if any(d.get(k) != ident[k] for k in _IDENTITY):  # proved: the new times are the index's
        d.update(ident)
        if not d.get("rows_sha1"):
            d["rows_sha1"] = _sha1(index_files(shard)[0])
        try:
            _atomic_write(index_files(shard)[1], json.dumps(d).encode("utf-8"))
        except OSError:
            pass  # a read-only copy: proved again at the next start
    return d


def remote_summaries(shards: Sequence[str]) -> list[dict[str, Any] | None]:
    """Summaries of shards whose index lies at a URL: from their stream's summary when it was loaded
    (`preload`), the rest fetched in parallel; None where a shard has none."""
    out: list[dict[str, Any] | None] = [_PRELOADED.get(s) for s in shards]
    todo = [i for i, d in enumerate(out) if d is None]
    if todo:
        from cvl.data.remote import fetch_whole

        blobs = fetch_whole([index_files(shards[i])[1] for i in todo], missing_ok=True)
        for i, raw in zip(todo, blobs):
            out[i] = None if raw is None else _parse(raw, shards[i])
            if raw is not None and out[i] is None:
                raise CvlError(
                    f"{index_files(shards[i])[1]}: not a cvl index summary: rebuild it where the "
                    f"stream is written ({fix_command('SHARD')}) and upload it again"
                )
    return out


# -- building what is missing or stale -----------------------------------------------------------
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
    shards: Sequence[str],
    full: bool = False,
    force: bool = False,
    remote: bool = False,
    done: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every shard's summary, in order, indexing the shards whose index is missing or stale
    (module doc; `full`: prove every kept local index, as `cvl index` does; `force`: rebuild
    all). A shard at a URL is indexed only with `remote` (read through once: `cvl index`,
    `cvl build-stream shards`); otherwise its index must exist. `done(summary)` is called as
    each shard is indexed (progress)."""
    shards = list(shards)
    out: list[dict[str, Any] | None] = [None] * len(shards)
    far = [i for i, s in enumerate(shards) if is_remote(index_files(s)[1])]
    if not force:
        for i, d in zip(far, remote_summaries([shards[i] for i in far])):
            out[i] = d
    for i, s in enumerate(shards):
        if i in far or force:
            continue
        out[i] = read_summary(s) if is_remote(s) else local_summary(s, full)
    stale = [i for i, d in enumerate(out) if d is None]
    if not stale:
        return out  # type: ignore[return-value]
    urls = [shards[i] for i in stale if is_remote(shards[i])]
    if urls and not remote:
        raise CvlError(
            f"{urls[0]}: no index beside the shard ({index_files(urls[0])[1]}); remote shards "
            "need their index files beside them: run `cvl index STREAM` on the stream before "
            "copying it (streams built by this cvl have them), or `cvl index URL --index-prefix "
            "DIR` for a read-only collection"
        )
    by_folder: dict[str, list[int]] = {}
    for i in stale:
        if not is_remote(shards[i]) and not os.path.isfile(shards[i]):
            raise CvlError(f"{shards[i]}: shard not found")
        by_folder.setdefault(os.path.dirname(index_files(shards[i])[1]), []).append(i)
    for folder, group in by_folder.items():
        if is_remote(folder):  # an object store has no locks: `cvl index --part` splits work
            for i, d in zip(group, _build([shards[i] for i in group], done)):
                out[i] = d
            continue
        with _folder_lock(folder):  # one process per node indexes; the others wait, then reuse
            todo = [i for i in group if force or _recheck(shards[i], full) is None]
            for i, d in zip(todo, _build([shards[i] for i in todo], done)):
                out[i] = d
            for i in group:
                out[i] = out[i] or _recheck(shards[i], full) or _fail(shards[i])
    said = [shards[i] for i in stale if shards[i] in REBUILT]
    if said and not (force or full):  # (`cvl index` names them itself)
        print(
            f"note: re-indexed {len(said)} shard(s) whose index no longer matched the tar "
            f"(first: {said[0]}: {REBUILT[said[0]]})",
            file=sys.stderr,
        )
    return out  # type: ignore[return-value]


def _recheck(shard: str, full: bool) -> dict[str, Any] | None:
    return read_summary(shard) if is_remote(shard) else local_summary(shard, full)


def _fail(shard: str) -> dict[str, Any]:
    raise CvlError(f"{shard}: indexing left no index (is its folder writable?)")


def _build(
    todo: list[str], done: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Index `todo`, in order: local shards in processes (tar headers: CPU), shards at URLs
    in threads (waiting on the network)."""
    report = done or (lambda d: None)
    out: list[dict[str, Any]] = []
    procs = min(index_processes(), len(todo))
    if procs <= 1 or len(todo) < 4:
        for s in todo:
            out.append(index_one(s))
            report(out[-1])
        return out
    if is_remote(todo[0]):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(procs, 8)) as tx:
            for d in tx.map(index_one, todo):
                out.append(d)
                report(d)
        return out
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(procs, mp_context=ctx) as ex:
        for d in ex.map(index_one, todo, chunksize=max(1, len(todo) // (procs * 8))):
            out.append(d)
            report(d)
    return out


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


# -- a stream's summary of every shard ----------------------------------------------------------
def write_stream_summary(folder: str | os.PathLike, shards: dict[str, str]) -> Path | None:
    """Write ``folder/shards.idx.json`` from the summaries of `shards` ({name as stream.json
    lists it: local path}); nothing when a shard has no index yet (`cvl index` writes it)."""
    summaries = {}
    out = Path(folder) / STREAM_SUMMARY
    for name, path in shards.items():
        d = None if is_remote(path) else read_summary(path)
        if d is None:
            out.unlink(missing_ok=True)  # never one that no longer describes the shards
            return None
        summaries[name] = {k: v for k, v in d.items() if k != "schema"}
    _atomic_write(
        str(out), json.dumps({"schema": STREAM_SCHEMA, "shards": summaries}).encode("utf-8")
    )
    return out


def preload(url_of: dict[str, str], raw: bytes) -> int:
    """Take a served stream's ``shards.idx.json`` (`raw`) as the summaries of its shards
    ({name as stream.json lists it: URL}); the number of shards it covered."""
    try:
        d = json.loads(raw)
        shards = d["shards"] if d.get("schema") == STREAM_SCHEMA else None
    except (ValueError, KeyError, AttributeError):
        shards = None
    if not isinstance(shards, dict):
        raise CvlError(
            f"{STREAM_SUMMARY}: not a cvl stream index; rebuild it with `cvl index STREAM` "
            "where the stream is written and upload it again"
        )
    n = 0
    for name, url in url_of.items():
        s = shards.get(name)
        if isinstance(s, dict) and "count" in s:
            _PRELOADED[url] = {"schema": SCHEMA, **s}
            n += 1
    return n


# -- remote rows, once per node -----------------------------------------------------------------
def _rows_cache_path(shard: str, summary: dict[str, Any]) -> Path:
    npy_url = index_files(shard)[0]
    tag = summary.get("rows_sha1") or f"{summary.get('tar_bytes')}-{summary['count']}"
    h = hashlib.sha256(npy_url.encode()).hexdigest()[:24]
    return cache_root() / "remote" / f"{h}-{tag}.idx.npy"


def cached_rows(shards: Sequence[str], summaries: Sequence[dict[str, Any]]) -> list[str]:
    """The local paths of remote shards' ``.idx.npy`` files: fetched once per node into the
    index cache (named by the URL and the rows' SHA-1, or size and count for an index written
    before SHA-1s were recorded), all missing ones of a batch in parallel, each checked against
    its summary; then memory-mapped like local ones."""
    paths = [_rows_cache_path(s, d) for s, d in zip(shards, summaries)]
    todo = [i for i, p in enumerate(paths) if not p.is_file()]
    if not todo:
        return [str(p) for p in paths]
    folder = cache_root() / "remote"
    folder.mkdir(parents=True, exist_ok=True)
    with _folder_lock(str(folder)):  # one fetch per node; the others wait and reuse
        todo = [i for i in todo if not paths[i].is_file()]
        from cvl.data.remote import fetch_whole

        blobs = fetch_whole([index_files(shards[i])[0] for i in todo])
        for i, data in zip(todo, blobs):
            want = summaries[i].get("rows_sha1")
            if want and hashlib.sha1(data).hexdigest() != want:  # type: ignore[arg-type]
                raise CvlError(
                    f"{shards[i]}: its index {index_files(shards[i])[0]} is not the one its "
                    "summary describes (rebuilt or replaced since the summary was written): "
                    "re-index the stream where it is written (`cvl index --force STREAM`) and "
                    "upload its index files again"
                )
            _atomic_write(str(paths[i]), data)  # type: ignore[arg-type]
    return [str(p) for p in paths]
