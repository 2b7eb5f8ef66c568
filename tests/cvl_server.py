"""A `cvl` command for the recipe smoke tests that skips the libraries' import time.

Each `cvl` process of a recipe's --smoke pipeline spends most of its time importing torch,
torchvision (which pulls in TorchDynamo), open_clip (transformers) and timm: about half of a
tiny model's whole run, paid by every one of the ~100 commands a `make smoke` starts. Here one
server process imports those libraries once; the `cvl` executable the recipe calls
(`client`) hands the server its arguments, working directory, environment and stdin / stdout /
stderr, and the server forks a child that runs `python -m cvl ARGS` with them (cvl itself is
imported afresh in every child) and reports its exit status back. Each command is still its
own process with its own state; only the already-imported libraries are shared.

    python cvl_server.py serve SOCKET   # the server (prints "ready" once the imports are done)
    python cvl_server.py client ARGS... # the `cvl` command (socket from $CVL_SERVER)

POSIX only (fork, file descriptors over a Unix socket). What the libraries read at import
(OMP_NUM_THREADS: the tests' 1, torch's thread pools) is the server's, not the client's; the
server must not have run a torch op before forking (no thread pool is started yet).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

PRELOAD = ("torch", "torchvision", "open_clip", "timm", "accelerate", "safetensors.torch")


def _run_child(conn: socket.socket) -> None:
    """In the forked child: take over the client's stdio, cwd, environment and run cvl."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    (n,) = struct.unpack("!I", head)
    msg = b""
    while len(msg) < n:
        msg += conn.recv(n - len(msg))
    req = json.loads(msg)
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = ["cvl", *req["argv"]]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command waits on its own children
    code = 0
    try:
        import runpy

        runpy.run_module("cvl", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter maps sys.exit's argument
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if code == 1 and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (reported as python would, exit 1)
        import traceback

        traceback.print_exc()
        code = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001, S110 (a closed pipe: nothing more to say)
            pass
    conn.sendall(struct.pack("!i", code))
    os._exit(code)


def serve(path: str) -> None:
    """Import the libraries, then fork one child per connection, forever."""
    for mod in PRELOAD:
        __import__(mod)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        if os.fork() == 0:
            srv.close()
            _run_child(conn)
        conn.close()


def client(argv: list[str]) -> int:
    """Run `cvl ARGV` in the server's child with this process's stdio; its exit status."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["CVL_SERVER"])
    req = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    data = json.dumps(req).encode()
    socket.send_fds(conn, [struct.pack("!I", len(data))], [0, 1, 2])
    conn.sendall(data)
    got = b""
    while len(got) < 4:
        part = conn.recv(4 - len(got))
        if not part:
            print("cvl_server: the command's process died without a status", file=sys.stderr)
            return 1
        got += part
    return struct.unpack("!i", got)[0]


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[2:]))
