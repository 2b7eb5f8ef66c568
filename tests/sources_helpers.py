"""Shared helpers of the source tests: a loopback image server and fixture copies.

The server (stdlib http.server on a thread, 127.0.0.1, random port) answers by path prefix:

- ``/img/NAME.jpg``      a generated JPEG whose colour is a function of NAME (`expected_rgb`)
- ``/404/...``           404 Not Found
- ``/corrupt/...``       200 with bytes that start like a JPEG but are not one
- ``/html/...``          200 with an HTML page (not an image)
- ``/slow/NAME.jpg``     the image, but only after `slow_seconds` (beyond the test timeout)
- ``/noai/NAME.jpg``     the image with ``X-Robots-Tag: noai``
- ``/drop/NAME.jpg``     headers for the whole image, half the body, then the connection closes
- ``/flaky/NAME.jpg``    500 Internal Server Error on the first request of a path, then the image
- ``/hang/NAME.jpg``     accepts the request and never answers (for `hang_seconds`)

Fixture files under ``datasets/fixtures`` use the placeholder host `PLACEHOLDER`;
`copy_fixture` rewrites it to the server's address (also inside ``.gz`` files).
"""

from __future__ import annotations

import gzip
import http.server
import io
import shutil
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

FIXTURES = Path(__file__).resolve().parent.parent / "datasets" / "fixtures"
PLACEHOLDER = "http://images.cvl.invalid"
IMG_SIZE = (48, 40)


def expected_rgb(name: str) -> tuple[int, int, int]:
    """The colour the server paints image NAME (file name without folder)."""
    h = zlib.crc32(name.encode())
    return (40 + h % 180, 40 + (h >> 8) % 180, 40 + (h >> 16) % 180)


def jpeg_bytes(name: str, size: tuple[int, int] = IMG_SIZE) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, expected_rgb(name)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def mean_rgb(img: bytes | Image.Image) -> tuple[float, float, float]:
    """Mean colour of JPEG bytes or a PIL image."""
    import numpy as np

    if isinstance(img, bytes):
        img = Image.open(io.BytesIO(img))
    a = np.asarray(img.convert("RGB"), dtype=np.float64)
    return tuple(a.reshape(-1, 3).mean(0).tolist())  # type: ignore[return-value]


def close_rgb(a, b, tol: float = 6.0) -> bool:  # noqa: ANN001
    return all(abs(x - y) <= tol for x, y in zip(a, b))


class ImageServer:
    """A threaded loopback HTTP server counting hits per path."""

    def __init__(self, slow_seconds: float = 3.0, hang_seconds: float = 60.0) -> None:
        self.slow_seconds = slow_seconds
        self.hang_seconds = hang_seconds
        self.flaky_seen: set[str] = set()  # not cleared by reset(): a rerun gets the image
        self.hits: Counter[str] = Counter()
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:  # noqa: ANN002
                pass

            def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    for k, v in (extra or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?", 1)[0]
                with server._lock:
                    server.hits[path] = server.hits[path] + 1
                kind = path.strip("/").split("/", 1)[0]
                name = path.rsplit("/", 1)[-1]
                if kind == "404":
                    self._send(404, b"not found", "text/plain")
                elif kind == "corrupt":
                    self._send(200, b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4, "image/jpeg")
                elif kind == "html":
                    self._send(200, b"<html><body>not an image</body></html>", "text/html")
                elif kind == "slow":
                    time.sleep(server.slow_seconds)
                    self._send(200, jpeg_bytes(name), "image/jpeg")
                elif kind == "noai":
                    self._send(200, jpeg_bytes(name), "image/jpeg", {"X-Robots-Tag": "noai"})
                elif kind == "drop":
                    body = jpeg_bytes(name)
                    try:
                        self.send_response(200)
                        self.send_header("Content-Type", "image/jpeg")
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body[: len(body) // 2])
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    self.close_connection = True
                elif kind == "flaky":
                    with server._lock:
                        first = path not in server.flaky_seen
                        server.flaky_seen.add(path)
                    if first:
                        self._send(500, b"try again", "text/plain")
                    else:
                        self._send(200, jpeg_bytes(name), "image/jpeg")
                elif kind == "hang":
                    time.sleep(server.hang_seconds)
                elif kind == "img":
                    self._send(200, jpeg_bytes(name), "image/jpeg")
                else:
                    self._send(404, b"unknown path", "text/plain")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return self.base + "/" + path.lstrip("/")

    def total(self, prefix: str = "") -> int:
        with self._lock:
            return sum(n for p, n in self.hits.items() if p.startswith(prefix))

    def reset(self) -> None:
        with self._lock:
            self.hits.clear()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def image_server():
    srv = ImageServer(slow_seconds=3.0)
    yield srv
    srv.close()


def copy_fixture(name: str, dst: Path, base: str) -> Path:
    """Copy datasets/fixtures/NAME (file or folder) to dst, pointing its URLs at `base`."""
    src = FIXTURES / name
    dst.mkdir(parents=True, exist_ok=True)
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    for f in files:
        rel = f.name if src.is_file() else f.relative_to(src)
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if f.name.endswith(".gz"):
            data = gzip.decompress(f.read_bytes()).replace(PLACEHOLDER.encode(), base.encode())
            out.write_bytes(gzip.compress(data, mtime=0))
        elif f.suffix in (".json", ".tsv", ".csv", ".jsonl", ".txt"):
            out.write_bytes(f.read_bytes().replace(PLACEHOLDER.encode(), base.encode()))
        else:
            shutil.copy(f, out)
    return dst / src.name if src.is_file() else dst


def fast_args(downloads: Path) -> list[str]:
    """CLI options that keep img2dataset small and quick in tests."""
    return [
        "--downloads",
        str(downloads),
        "--processes",
        "1",
        "--threads",
        "8",
        "--timeout",
        "1.5",
        "--exit-grace",
        "5",
        "--quiet",
    ]


def fixture_urls(base: str) -> list[str]:
    """Every image URL in datasets/fixtures (found by pattern, not by the source parsers)."""
    import re

    pat = re.compile(re.escape(PLACEHOLDER) + r"/[A-Za-z0-9_./\-]+")
    urls: set[str] = set()
    for f in FIXTURES.rglob("*"):
        if not f.is_file():
            continue
        data = gzip.decompress(f.read_bytes()) if f.name.endswith(".gz") else f.read_bytes()
        urls.update(m.group(0) for m in pat.finditer(data.decode("utf-8", "replace")))
    return sorted(u.replace(PLACEHOLDER, base) for u in urls)


@pytest.fixture(scope="module")
def prefetched(tmp_path_factory, image_server):  # noqa: F811
    """A download cache holding every fixture URL, fetched in ONE img2dataset run.

    Each img2dataset start costs ~5 s on 2 cores (it imports torch, albumentations, ...), so
    the per-source tests build from this cache (``--no-retry-failed``) and assert that they
    fetched nothing new: that proves each source asked for exactly its fixture's URLs. The
    full download path (fresh run, retry, resume) is exercised by the P9D tests.
    """
    from cvl.streams.download import DownloadCache, DownloadOptions, ImageOptions

    d = tmp_path_factory.mktemp("prefetched") / "downloads"
    urls = fixture_urls(image_server.base)
    cache = DownloadCache(d, ImageOptions())
    opts = DownloadOptions(threads=16, timeout=1.5, exit_grace=5)
    recs, _ = cache.fetch({u: {} for u in urls}, opts, log=lambda m: None, progress=False)
    assert sum(r.ok for r in recs.values()) > 30
    return d
