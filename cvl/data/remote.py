"""Reading shard bytes by range: local files through an LRU of open descriptors, remote
shards (any fsspec URL: http(s)://, s3://, gs://, ...) by byte-range requests with retries.

A sample's members are read with the offsets of the shard's index (`cvl.data.index`), so a
remote shard is never downloaded whole. Transient failures (connection reset, 5xx, timeouts)
are retried `RETRIES` times with exponential back-off; what still fails is one line naming the
shard (`CvlError`).
"""

from __future__ import annotations

import os
import resource
import time
from collections import OrderedDict
from typing import Any

from cvl.errors import CvlError

RETRIES = 4
BACKOFF_S = 0.25


def _open_limit() -> int:
    """Open shard descriptors kept per process: a quarter of the descriptor limit, between
    16 and 2,048 (each rank and loader worker of a node holds this many). The soft limit is
    raised towards the hard one first (to 16,384 at most), as training jobs commonly do: the
    usual soft 1,024 would keep only 256 shards open."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 16384 if hard == resource.RLIM_INFINITY else min(hard, 16384)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 8192
    return max(16, min(2048, soft // 4))


class Files:
    """Per-process LRU of open local shards (re-made after a fork into a loader worker):
    a read is one `pread`, a shard beyond the limit closes only the least recently used."""

    def __init__(self, limit: int | None = None) -> None:
        self.pid = -1
        self.limit = limit or _open_limit()
        self.fds: OrderedDict[str, int] = OrderedDict()
        self.opened = 0  # opens so far (benchmarks: reopen rate)

    def _fd(self, path: str) -> int:
        if self.pid != os.getpid():
            self.fds, self.pid = OrderedDict(), os.getpid()  # the parent's stay the parent's
        fd = self.fds.get(path)
        if fd is not None:
            self.fds.move_to_end(path)
            return fd
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CvlError(f"{path}: cannot open the shard ({e.strerror or e})") from None
        self.opened += 1
        self.fds[path] = fd
        while len(self.fds) > self.limit:
            os.close(self.fds.popitem(last=False)[1])
        return fd

    def read(self, path: str, span: tuple[int, int]) -> bytes:
        """`span` = (offset, size) of a member's data in shard `path` (local or URL)."""
        if "://" in path and not path.startswith("file://"):
            return read_range(path, span[0], span[1])
        data = os.pread(self._fd(path), span[1], span[0])
        if len(data) != span[1]:
            raise OSError(f"{path}: short read at {span[0]} (the shard is truncated)")
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


_FS: dict[str, Any] = {}


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    proto = url.split("://", 1)[0]
    key = f"{proto}:{os.getpid()}"  # an fsspec filesystem (and its session) per process
    if key not in _FS:
        _FS[key] = fsspec.filesystem(proto)
    return _FS[key], url


def _retry(url: str, what: str, fn: Any) -> Any:
    last: Exception | None = None
    for attempt in range(RETRIES + 1):
        try:
            return fn()
        except FileNotFoundError:
            raise CvlError(f"{url}: not found (404) while reading {what}") from None
        except (ImportError, ValueError) as e:
            raise CvlError(f"{url}: cannot read {what} ({e})") from None
        except Exception as e:  # connection errors, 5xx, time-outs: transient until proven
            last = e
            if attempt < RETRIES:
                time.sleep(BACKOFF_S * 2**attempt)
    raise CvlError(
        f"{url}: unreachable after {RETRIES + 1} tries while reading {what} "
        f"({type(last).__name__}: {last})"
    )


def read_range(url: str, offset: int, size: int) -> bytes:
    """Bytes [offset, offset + size) of a remote file."""
    fs, path = _fs(url)
    data = _retry(
        url, f"bytes {offset}-{offset + size}", lambda: fs.cat_file(path, offset, offset + size)
    )
    if len(data) != size:
        raise CvlError(f"{url}: short read at {offset} ({len(data)} of {size} bytes)")
    return data


def read_bytes(url: str) -> bytes:
    """A whole remote file (index files, a stream's manifest)."""
    fs, path = _fs(url)
    return _retry(url, "the file", lambda: fs.cat_file(path))


def exists(url: str) -> bool:
    fs, path = _fs(url)
    return bool(_retry(url, "its metadata", lambda: fs.exists(path)))


def size(url: str) -> int:
    """A remote file's size in bytes."""
    fs, path = _fs(url)
    return int(_retry(url, "its size", lambda: fs.size(path)))
