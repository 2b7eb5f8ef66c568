"""Reading shard bytes: local files through an LRU of open descriptors (`Files`, one `pread`
a range), remote ones (any fsspec URL: http(s)://, s3://, gs://, ...) by byte-range requests
issued together (`fetch_ranges`: a batch's ranges in flight at once, at most
`io_concurrency()` per process) with retries.

http(s):// is read with aiohttp directly, so that a server that ignores ``Range`` (it answers
200 with the whole file: ``python -m http.server`` does) is refused at its first answer, before
its body is read, rather than taken for a short or corrupt sample; other protocols go through
their fsspec filesystem's asynchronous ``_cat_file`` (s3fs, gcsfs: keywords, never
positions). Every request runs on fsspec's IO thread (one event loop per process, reset in a
forked loader worker), so a loader worker pays one round trip per batch, not one per sample.

Failures: a 404 / missing object, a refused credential, a server that ignores ranges and a
shard shorter than its index are one line at once; anything else (connection reset, 5xx,
time-out, a short answer) is retried `RETRIES` times with exponential back-off, then one line
naming the URL and the bytes (`CvlError`). None of them is ever taken for a bad sample.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import resource
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from cvl.errors import CvlError

RETRIES = 4
BACKOFF_S = 0.25
DEFAULT_CONCURRENCY = 64  # ranges in flight per process (each loader worker) for object stores


def io_concurrency() -> int:
    """Remote requests in flight per process (`CVL_IO_CONCURRENCY`; `cvl train
    --io-concurrency`), default `DEFAULT_CONCURRENCY`."""
    try:
        return max(1, int(os.environ.get("CVL_IO_CONCURRENCY") or DEFAULT_CONCURRENCY))
    except ValueError:
        raise CvlError(
            f"CVL_IO_CONCURRENCY={os.environ['CVL_IO_CONCURRENCY']!r}: not a positive integer"
        ) from None


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
        """`span` = (offset, size) of bytes in shard `path` (local, or a URL: one request);
        a short read or an I/O error is one line naming the shard (never a bad sample)."""
        if "://" in path and not path.startswith("file://"):
            return fetch_ranges([(path, span[0], span[0] + span[1])])[0]
        try:
            data = os.pread(self._fd(path), span[1], span[0])
        except OSError as e:
            self.forget(path)
            raise CvlError(f"{path}: cannot read the shard ({e.strerror or e})") from None
        if len(data) != span[1]:
            self.forget(path)
            raise CvlError(
                f"{path}: short read at byte {span[0]} ({len(data)} of {span[1]}): the shard is "
                "shorter than its index says (truncated or replaced?)"
            )
        return data

    def forget(self, path: str) -> None:
        fd = self.fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


# -- remote requests ----------------------------------------------------------------------------
class _Final(Exception):
    """A failure that no retry can mend (404, 403, a server that ignores ranges)."""


class _Short(Exception):
    """An answer shorter than asked: retried, then a transport error."""


_STATE: dict[str, Any] = {"pid": -1}
_INHERITED: list[dict[str, Any]] = []


def _loop() -> Any:
    import fsspec.asyn

    if _STATE["pid"] != os.getpid():  # a forked worker: its own loop, sessions, filesystems
        # the parent's are kept, never collected here: closing them in the child would shut
        # connections the parent still uses (its next request would hang)
        _INHERITED.append(dict(_STATE))
        _STATE.clear()
        _STATE.update(pid=os.getpid(), fs={}, session=None, sem=None)
    return fsspec.asyn.get_loop()


@atexit.register
def _close_session() -> None:
    """This process's HTTP session, closed at exit (not a forked child's inherited one)."""
    if _STATE.get("pid") == os.getpid() and _STATE.get("session") is not None:
        import fsspec.asyn

        try:
            fsspec.asyn.sync(fsspec.asyn.get_loop(), _STATE["session"].close, timeout=5)
        except Exception:  # noqa: BLE001 (the loop may be gone at exit: nothing to save)
            pass


def _fs(proto: str) -> Any:
    fs = _STATE["fs"].get(proto)
    if fs is None:
        import fsspec

        try:
            fs = fsspec.filesystem(proto)
        except ImportError as e:
            extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(proto)
            hint = f" (pip install 'cvl[{extra}]')" if extra else ""
            raise CvlError(
                f"{proto}://: its fsspec filesystem is not installed{hint}: {e}"
            ) from None
        except ValueError as e:
            raise CvlError(f"{proto}://: no fsspec filesystem for this protocol ({e})") from None
        _STATE["fs"][proto] = fs
    return fs


async def _session() -> Any:
    if _STATE.get("session") is None:
        import aiohttp

        conn = aiohttp.TCPConnector(limit=io_concurrency(), ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
        _STATE["session"] = aiohttp.ClientSession(connector=conn, timeout=timeout)
    return _STATE["session"]


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/")


async def _http_get(url: str, start: int | None, end: int | None) -> bytes:
    session = await _session()
    headers = {} if start is None else {"Range": f"bytes={start}-{end - 1}"}
    async with session.get(url, headers=headers) as r:
        if r.status == 404:
            raise FileNotFoundError(url)
        if r.status in (401, 403):
            raise _Final(f"access denied ({r.status}): check the server's credentials")
        if r.status == 416:
            raise _Final("the file is shorter than the range asked (416): truncated or replaced?")
        if r.status >= 400:
            raise OSError(f"HTTP {r.status}")
        if start is not None:
            whole = r.status == 200 and start == 0 and r.content_length == end
            if r.status == 200 and not whole:
                r.close()  # its body (the whole file) is not read
                host = url.split("/")[2] if url.count("/") >= 2 else url
                raise _Final(
                    f"the server at {host} ignores byte ranges (it answered 200 with the whole "
                    f"file to `Range: bytes={start}-{end - 1}`); cvl reads shards by range: serve "
                    "the stream with a server that honours Range (nginx, caddy, an object store; "
                    "not `python -m http.server`), or set --shard-cache DIR to fetch whole shards"
                )
            m = _CONTENT_RANGE.match(r.headers.get("Content-Range", ""))
            if r.status == 206 and m and int(m[1]) != start:
                raise _Final(
                    f"the server answered another range ({r.headers.get('Content-Range')})"
                )
        data = await r.read()
    return data


async def _get(url: str, start: int | None, end: int | None) -> bytes:
    proto = url.split("://", 1)[0]
    if proto in ("http", "https"):
        return await _http_get(url, start, end)
    fs = _fs(proto)
    if getattr(fs, "async_impl", False):
        if start is None:
            return await fs._cat_file(url)
        return await fs._cat_file(url, start=start, end=end)
    loop = asyncio.get_running_loop()
    if start is None:
        return await loop.run_in_executor(None, lambda: fs.cat_file(url))
    return await loop.run_in_executor(None, lambda: fs.cat_file(url, start=start, end=end))


async def _retrying(url: str, what: str, attempt_once: Any, missing_ok: bool = False) -> Any:
    """`await attempt_once()` with the module's retry rules (module doc)."""
    if _STATE.get("sem") is None:
        _STATE["sem"] = asyncio.Semaphore(io_concurrency())
    last: Exception | None = None
    for attempt in range(RETRIES + 1):
        try:
            async with _STATE["sem"]:
                return await attempt_once()
        except FileNotFoundError:
            if missing_ok:
                return None
            raise CvlError(f"{url}: not found (404) while reading {what}") from None
        except PermissionError as e:
            raise CvlError(f"{url}: access denied while reading {what} ({e})") from None
        except _Final as e:
            raise CvlError(f"{url}: {e}") from None
        except CvlError:
            raise
        except Exception as e:  # connection errors, 5xx, time-outs, short answers: transient
            last = e
            if attempt < RETRIES:
                await asyncio.sleep(BACKOFF_S * 2**attempt)
    raise CvlError(
        f"{url}: unreachable after {RETRIES + 1} tries while reading {what} "
        f"({type(last).__name__}: {last})"
    )


async def _one(url: str, start: int | None, end: int | None, missing_ok: bool) -> bytes | None:
    async def once() -> bytes:
        data = await _get(url, start, end)
        if start is not None and len(data) != end - start:
            raise _Short(f"{len(data)} of {end - start} bytes")
        return data

    what = "the file" if start is None else f"bytes {start}-{end}"
    return await _retrying(url, what, once, missing_ok)


async def _download(url: str, dest: str, size: int | None) -> None:
    proto = url.split("://", 1)[0]

    async def once() -> None:
        if proto in ("http", "https"):
            session = await _session()
            async with session.get(url) as r:
                if r.status == 404:
                    raise FileNotFoundError(url)
                if r.status in (401, 403):
                    raise _Final(f"access denied ({r.status}): check the server's credentials")
                if r.status >= 400:
                    raise OSError(f"HTTP {r.status}")
                with open(dest, "wb") as f:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        f.write(chunk)
        else:
            fs = _fs(proto)
            if getattr(fs, "async_impl", False):
                await fs._get_file(url, dest)
            else:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: fs.get_file(url, dest)
                )
        got = os.path.getsize(dest)
        if size is not None and got != size:
            raise _Short(f"{got} of {size} bytes")

    await _retrying(url, "the whole shard", once)


def _run(jobs: list[tuple[str, int | None, int | None]], missing_ok: bool) -> list[Any]:
    import fsspec.asyn

    loop = _loop()

    async def gather() -> list[Any]:
        return await asyncio.gather(*(_one(u, a, b, missing_ok) for u, a, b in jobs))

    return fsspec.asyn.sync(loop, gather)


def fetch_ranges(ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
    """Bytes [start, end) of each (url, start, end), all in flight together (at most
    `io_concurrency()` at once), each retried; in order. One line for what fails."""
    return _run([(u, int(a), int(b)) for u, a, b in ranges], False) if ranges else []


def fetch_whole(urls: Sequence[str], missing_ok: bool = False) -> list[bytes | None]:
    """Whole files (index summaries, rows, a manifest) in parallel; None for a missing one
    with `missing_ok`."""
    return _run([(u, None, None) for u in urls], missing_ok) if urls else []


def download(url: str, dest: str, size: int | None = None) -> None:
    """The whole file at `url` into `dest` (streamed, not held in memory), retried; `size`:
    the bytes it must have (a shorter answer is a transport error)."""
    import fsspec.asyn

    fsspec.asyn.sync(_loop(), lambda: _download(url, dest, size))


def read_range(url: str, offset: int, size: int) -> bytes:
    """Bytes [offset, offset + size) of a remote file."""
    return fetch_ranges([(url, offset, offset + size)])[0]


def read_bytes(url: str) -> bytes:
    """A whole remote file (index files, a stream's manifest)."""
    return fetch_whole([url])[0]  # type: ignore[return-value]


def fs_of(url: str) -> tuple[Any, str]:
    """(the fsspec filesystem of this process for `url`'s protocol, `url`): for listings and
    writes (`cvl index` under an index prefix, a collection's folder)."""
    _loop()
    return _fs(url.split("://", 1)[0]), url


async def _size(url: str) -> int:
    proto = url.split("://", 1)[0]
    if proto in ("http", "https"):
        session = await _session()
        async with session.head(url, allow_redirects=True) as r:
            if r.status == 404:
                raise FileNotFoundError(url)
            if r.status >= 400:
                raise OSError(f"HTTP {r.status}")
            if r.content_length is None:
                raise _Final("the server gives no Content-Length for it")
            return int(r.content_length)
    fs = _fs(proto)
    if getattr(fs, "async_impl", False):
        return int((await fs._info(url))["size"])
    return int(await asyncio.get_running_loop().run_in_executor(None, lambda: fs.size(url)))


def size(url: str) -> int:
    """A remote file's size in bytes (one HEAD / metadata request, retried)."""
    import fsspec.asyn

    return fsspec.asyn.sync(_loop(), lambda: _retrying(url, "its size", lambda: _size(url)))
