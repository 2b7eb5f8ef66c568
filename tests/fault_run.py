"""Run `cvl ARGS` in this process with a fault of the filesystem injected first (the
reliability tests start it as a subprocess: the faults cannot be undone in a process).

    python tests/fault_run.py --fsize BYTES -- train ...      files larger than BYTES fail
                                                               (RLIMIT_FSIZE: EFBIG, as the
                                                               kernel refuses the write)
    python tests/fault_run.py --readonly DIR -- train ...     DIR and everything in it is a
                                                               read-only filesystem (EROFS)
    python tests/fault_run.py --enospc NAME:BYTES -- ...      a file named NAME fails with
                                                               ENOSPC once BYTES are written

`--readonly` works without root (tests may run as root, whom chmod does not stop): an audit
hook (PEP 578) refuses every Python-level way of changing DIR — opening a file for writing,
creating, renaming, removing or re-timing an entry — with the read-only filesystem's OSError,
as the kernel would. Writers below Python (safetensors' Rust writer) are not seen by it, so
the tests also compare the folder's files before and after.
"""

from __future__ import annotations

import builtins
import errno
import os
import resource
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGE_EVENTS = {
    "os.mkdir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.truncate",
    "os.utime",
    "os.chmod",
    "os.symlink",
    "os.link",
    "shutil.rmtree",
    "shutil.move",
}


def _readonly(root: str) -> None:
    root = os.path.realpath(root)

    def inside(p: object) -> bool:
        if isinstance(p, int) or p is None:
            return False
        try:
            q = os.path.realpath(os.fsdecode(p))
        except (TypeError, ValueError):
            return False
        return q == root or q.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writes and inside(path):
                raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))
        elif event in _CHANGE_EVENTS and args and any(inside(a) for a in args[:2]):
            raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(args[0]))

    sys.addaudithook(hook)


def _enospc(name: str, budget: int) -> None:
    real_open = builtins.open

    class Full:
        def __init__(self, f):  # noqa: ANN001
            self.f, self.left = f, budget

        def write(self, data):  # noqa: ANN001, ANN202
            if len(data) > self.left:
                raise OSError(errno.ENOSPC, "No space left on device", self.f.name)
            self.left -= len(data)
            return self.f.write(data)

        def __getattr__(self, a):  # noqa: ANN001, ANN204
            return getattr(self.f, a)

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc):  # noqa: ANN002, ANN204
            self.f.close()

    def fake_open(file, mode="r", *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        f = real_open(file, mode, *a, **k)
        if "w" in str(mode) and os.path.basename(os.fsdecode(file)) == name:
            return Full(f)
        return f

    builtins.open = fake_open


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--")
    opts, args = argv[:cut], argv[cut + 1 :]
    for flag, val in zip(opts[::2], opts[1::2]):
        if flag == "--fsize":
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(val), int(val)))
        elif flag == "--readonly":
            _readonly(val)
        elif flag == "--enospc":
            name, n = val.rsplit(":", 1)
            _enospc(name, int(n))
        else:
            raise SystemExit(f"unknown fault {flag}")
    from cvl.cli import main as cvl_main

    return cvl_main(args)


if __name__ == "__main__":
    sys.exit(main())
