"""An optional local cache of whole shards for streams at URLs (`cvl train --shard-cache DIR
--shard-cache-gb N`; `CVL_SHARD_CACHE` / `CVL_SHARD_CACHE_GB` for every command): a shard is
fetched whole (one streamed request) the first time any process of the node needs it, then
read from the local disk by `pread` like a local shard. The trainer prefetches the shards of
the batches ahead from its batch plan (`Prefetcher`), so a worker seldom waits; when the cache
holds more than its bound, the shards used longest ago are removed.

The same batches, resume and 2 × B = 1 × 2B hold: the cache changes where bytes are read, not
which. Each cached shard is checked against its index's recorded size; every sample read is
then checked against its tar headers as for any shard. A removed shard that a process still
holds open stays readable to it (the disk space is freed when it closes): the bound is a target,
exceeded by at most the open shards. It pays off when it holds a task's shards, or with
`--shuffle-block` (a batch then touches few shards); with the default order and a cache much
smaller than the task, every batch touches ~B shards and each would be fetched whole.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cvl.errors import CvlError

DEFAULT_GB = 64.0


def cache_dir() -> Path | None:
    """The shard cache folder (`CVL_SHARD_CACHE`), None when there is none."""
    d = os.environ.get("CVL_SHARD_CACHE")
    return Path(d) if d else None


def budget_bytes() -> int:
    try:
        return int(float(os.environ.get("CVL_SHARD_CACHE_GB") or DEFAULT_GB) * (1 << 30))
    except ValueError:
        raise CvlError("CVL_SHARD_CACHE_GB: not a number of gigabytes") from None


def configure(folder: str | None, gb: float | None) -> None:
    """Set the cache for this process and the processes it starts (loader workers)."""
    if folder:
        os.makedirs(folder, exist_ok=True)
        os.environ["CVL_SHARD_CACHE"] = str(Path(folder).absolute())
    if gb is not None:
        if gb <= 0:
            raise CvlError(f"--shard-cache-gb {gb}: must be positive")
        os.environ["CVL_SHARD_CACHE_GB"] = str(gb)


def _name(url: str) -> str:
    h = hashlib.sha256(url.encode()).hexdigest()[:24]
    return f"{h}-{os.path.basename(url.rstrip('/'))}"


_TOUCHED: dict[str, int] = {}  # path -> pid that refreshed its time (once per process)


def local_copy(url: str) -> str | None:
    """The local path of shard `url` in the shard cache, fetched first when missing (one
    process per node fetches; the others wait on its lock); None without a cache."""
    root = cache_dir()
    if root is None:
        return None
    path = root / _name(url)
    if path.is_file():
        if _TOUCHED.get(str(path)) != os.getpid():
            _TOUCHED[str(path)] = os.getpid()
            try:
                os.utime(path)  # used now: evicted last
            except OSError:
                pass
        return str(path)
    from cvl.data.shardindex import _folder_lock

    with _folder_lock(str(root / ".locks" / path.name[:2])):
        if not path.is_file():
            _fetch(url, path)
    return str(path)


def _size_of(url: str) -> int | None:
    from cvl.data.index import TABLE

    sid = TABLE.ids.get(url)
    return None if sid is None else TABLE.sizes[sid]


def _fetch(url: str, path: Path) -> None:
    from cvl.data.remote import download

    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        download(url, str(tmp), _size_of(url))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _evict(path.parent, keep=path)


def _evict(root: Path, keep: Path) -> None:
    """Remove the shards used longest ago until the cache is within its bound."""
    files = []
    for e in os.scandir(root):
        if e.is_file() and not e.name.startswith("."):
            st = e.stat()
            files.append((st.st_mtime, st.st_size, e.path))
    total = sum(s for _, s, _ in files)
    budget = budget_bytes()
    for _, size, p in sorted(files):
        if total <= budget:
            break
        if p == str(keep):
            continue
        try:
            os.unlink(p)
            total -= size
        except FileNotFoundError:
            pass


class Prefetcher:
    """Fetches, in the background, the shards of batches ahead of the training loop (the
    batch plan is known in advance): `ahead(shards)` queues shards; `close()` stops."""

    def __init__(self, workers: int = 4) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="cvl-shard-prefetch")
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    def ahead(self, shards: Iterable[str]) -> None:
        with self.lock:
            new = [s for s in shards if s not in self.seen]
            self.seen.update(new)
        for s in new:
            self.pool.submit(self._one, s)

    def _one(self, url: str) -> None:
        try:
            local_copy(url)
        except BaseException as e:  # the worker that needs it fetches again and says why
            self.error = e

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def configure_io(concurrency: int = 0, cache: str | None = None, gb: float = 0.0) -> None:
    """A command's I/O settings for itself and the loader workers it forks: remote ranges in
    flight (`CVL_IO_CONCURRENCY`; 0 keeps the default) and the shard cache."""
    if concurrency:
        os.environ["CVL_IO_CONCURRENCY"] = str(int(concurrency))
    configure(cache, gb or None)


def prefetching(dataset: Any, batches: Iterable[list], ahead: int = 32) -> Iterator[list]:
    """`batches` as they are, the shards at URLs of the `ahead` batches after each queued for
    the shard cache (a `Prefetcher`); unchanged without a cache."""
    if cache_dir() is None:
        yield from batches
        return
    from collections import deque

    import numpy as np

    from cvl.data.index import _ROW, TABLE, Entries, is_remote

    pre = Prefetcher()
    window: deque = deque()
    try:
        for b in batches:
            window.append(b)
            if isinstance(dataset.entries, Entries):
                ids = dataset.entries.ids([i if isinstance(i, int) else i[0] for i in b])
                urls = [TABLE.paths[int(s)] for s in np.unique(ids // _ROW)]
                pre.ahead(u for u in urls if is_remote(u))
            if len(window) > ahead:
                yield window.popleft()
        yield from window
    finally:
        pre.close()
