"""Servers for streams at URLs, started by the tests and benchmarks/bench_remote.py:

- `RangeServer`: a loopback static file server that honours ``Range: bytes=a-b`` (as object
  stores do; 206 with Content-Range), with an injected latency before each answer, a count of
  requests and bytes, and the most requests it held at once; faults on demand: some paths
  failing with 503, answers cut short, or ``Range`` ignored (200 with the whole file, as
  ``python -m http.server`` does).
- `s3_server`: moto's S3-protocol server (a real HTTP server speaking S3) on a free port, with
  the environment s3fs / boto3 need to reach it (no credentials of the user's are read).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path


class RangeServer:
    """A loopback static file server over `folder` (module doc)."""

    def __init__(
        self,
        folder: Path,
        latency: float = 0.0,
        fail: set[str] | None = None,
        ignore_range: bool = False,
        short: set[str] | None = None,
    ) -> None:
        self.requests: list[tuple[str, str | None]] = []
        self.bytes_sent = 0
        self.latency = latency
        self.ignore_range = ignore_range
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as object stores and CDNs serve

            def log_message(self, *a) -> None:  # noqa: ANN002
                pass

            def do_GET(self) -> None:  # noqa: N802
                rng = self.headers.get("Range")
                with lock:
                    server.requests.append((self.path, rng))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if server.latency:
                        time.sleep(server.latency)  # the store's time to first byte
                    self._answer(rng)
                finally:
                    with lock:
                        server.in_flight -= 1

            def _answer(self, rng: str | None) -> None:
                path = Path(self.translate_path(self.path))
                if fail and any(self.path.endswith(f) for f in fail):
                    self.send_error(503)
                    return
                if not path.is_file():
                    self.send_error(404)
                    return
                size = path.stat().st_size
                m = re.match(r"bytes=(\d+)-(\d*)", rng or "")
                code = 200
                with open(path, "rb") as f:
                    if m and not server.ignore_range:
                        a, b = int(m[1]), min(size - 1, int(m[2]) if m[2] else size - 1)
                        f.seek(a)
                        data, code = f.read(b + 1 - a), 206
                    else:
                        data = f.read()
                self.send_response(code)
                if code == 206:
                    self.send_header("Content-Range", f"bytes {a}-{a + len(data) - 1}/{size}")
                if short and any(self.path.endswith(f) for f in short):
                    data = data[: len(data) // 2]  # a connection cut mid-body
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                    with lock:
                        server.bytes_sent += len(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client closed it (it refused the answer)

        handler = functools.partial(Handler, directory=str(folder))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def tar_requests(self) -> list[tuple[str, str | None]]:
        return [(p, r) for p, r in self.requests if p.endswith(".tar")]

    def reset(self) -> None:
        self.requests.clear()
        self.bytes_sent = self.max_in_flight = 0

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server on a free loopback port; yields its endpoint URL, with the
    environment (AWS_* variables, test credentials) pointing s3fs and boto3 at it."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    endpoint = f"http://127.0.0.1:{port}"
    keys = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield endpoint
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        srv.stop()


def upload(folder: Path, url: str) -> None:
    """Copy every file of `folder` to the S3 prefix `url` (s3://bucket/prefix)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = url[len("s3://") :].split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fs.put_file(str(p), f"{url}/{p.relative_to(folder).as_posix()}")
