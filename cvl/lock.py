"""One writer per output folder: an exclusive lock per run folder, stream build, eval or export.

The lock is `fcntl.flock` on a small file beside the folder, ``PARENT/.NAME.lock`` (beside, not
inside: a stream folder is renamed into place when complete). The kernel releases a flock when
the process that holds it ends, however it ends (exit, exception, SIGKILL, OOM kill), so a
crash never leaves a lock that has to be removed by hand. The file records the holder (pid,
host, command line, start time): a second process is refused at once with one line naming
it. A record still in the file when the lock is taken was left by a holder that died: the new
holder says whose lock it takes over. A clean release removes the file (while still holding
the lock; a process that opened the old file sees that the path now names another file and
tries again), so nothing is left beside the folder.

Only the process holds its locks: forked children (DataLoader workers, builder pools) close
their inherited copy at once, so a killed command's surviving worker cannot keep its folder
locked, and exec'd children never inherit the descriptor (close-on-exec). Within one process a
lock is re-entrant (a build command and the builder it calls lock the same folder). Several
training processes (torchrun / accelerate) share one lock held by rank 0 (`lock_on_main`).
On NFS, Linux emulates flock with POSIX locks, which are seen by every client.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from cvl.errors import CvlError
from cvl.writes import make_dirs

# lock file -> [fd, depth, folders made for it, token] of the locks this process holds
_HELD: dict[str, list[Any]] = {}
_COMMAND: list[str] = []  # the command line recorded in lock files (set by cvl.cli.main)
_CTRL = re.compile(r"[\x00-\x1f\x7f]")


def set_command(argv: list[str]) -> None:
    """The command line this process records in the locks it takes (`cvl train ...`)."""
    _COMMAND[:] = list(argv)


def command_line() -> str:
    """This process's command line as one printable line."""
    argv = _COMMAND or ["python", *sys.argv]
    text = " ".join(shlex.quote(a) for a in argv)
    text = _CTRL.sub(" ", text)
    return text if len(text) <= 300 else text[:297] + "..."


def lock_file(folder: str | os.PathLike) -> Path:
    """Where the lock of `folder` lives: ``.NAME.lock`` beside it (symlinks resolved)."""
    real = Path(os.path.realpath(os.path.abspath(folder)))
    return real.parent / f".{real.name}.lock"


def _forget_in_child() -> None:
    for fd, *_ in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _describe(rec: dict[str, Any]) -> str:
    return (
        f"pid {rec.get('pid', '?')} on {rec.get('host', '?')}, `{rec.get('command', '?')}`, "
        f"since {rec.get('since', '?')}"
    )


def _read_record(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 4096, 0)
    except OSError:
        return None
    if not data.strip():
        return None
    try:
        rec = json.loads(data.decode("utf-8", "replace"))
    except ValueError:
        return {"command": "unreadable lock record"}
    return rec if isinstance(rec, dict) else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class FolderLock:
    """The exclusive lock of one output folder (a context manager, or `acquire`/`release`)."""

    def __init__(self, folder: str | os.PathLike, quiet: bool = False) -> None:
        self.folder = Path(folder)
        self.path = lock_file(folder)
        self.quiet = quiet
        self._held = False
        self.read_only = False  # taken on a folder no one can write: nothing held (acquire)

    def acquire(self) -> FolderLock:
        """Take the lock or raise a one-line CvlError naming the process that holds it."""
        if self._held:
            return self
        key = str(self.path)
        if key in _HELD:  # re-entrant within this process
            _HELD[key][1] += 1
            self._token = _HELD[key][3]
            self._held = True
            return self
        parent = self.path.parent
        made = [p for p in [parent, *parent.parents] if not p.exists()]
        make_dirs(parent, what=str(self.folder))
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if self._unwritable(e):  # no one can write the folder: nothing to guard
                    self.read_only = True
                    return self
                raise CvlError(
                    f"{self.folder}: cannot create its lock file {self.path} ({e.strerror})"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                rec = _read_record(fd)
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise CvlError(
                        f"{self.folder}: cannot lock {self.path} ({e.strerror})"
                    ) from None
                who = _describe(rec) if rec else "another process (starting up)"
                raise CvlError(
                    f"{self.folder} is in use by {who}; wait for it to end or stop it "
                    f"(lock: {self.path})"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder released and removed it meanwhile: take the new file
        stale = _read_record(fd)
        if stale and not self.quiet:
            print(
                f"note: {self.folder}: taking over the lock of {_describe(stale)}, "
                "which ended without releasing it",
                file=sys.stderr,
            )
        rec = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command_line(),
            "since": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(rec) + "\n").encode("utf-8"), 0)
        self._token = object()
        _HELD[key] = [fd, 1, made, self._token]
        self._held = True
        return self

    def _unwritable(self, e: OSError) -> bool:
        """The lock file cannot be made because the folder is on a read-only filesystem (or
        neither it nor its parent may be written by this user): then this process cannot
        change the folder either, and a command with nothing to write (a finished run) goes
        on unlocked; any write it tries fails with its own one-line error (`cvl.io`)."""
        if e.errno == errno.EROFS:
            return True
        if e.errno in (errno.EACCES, errno.EPERM):
            return self.folder.is_dir() and not os.access(self.folder, os.W_OK)
        return False

    def release(self) -> None:
        """Give the lock back (the file is removed when the outermost holder releases)."""
        if not self._held:
            return
        self._held = False
        held = _HELD.get(str(self.path))
        if held is None or held[3] is not self._token:  # released by release_all, or a fork
            return
        held[1] -= 1
        if held[1] <= 0:
            _drop(str(self.path))

    @property
    def held(self) -> bool:
        return self._held

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def _drop(key: str) -> None:
    """Remove the lock file (still holding it), close it, and remove the folders made for it
    alone if they are still empty: a refused or failed command leaves nothing behind."""
    fd, _, made, _ = _HELD.pop(key)
    try:
        if _same_file(fd, Path(key)):
            os.unlink(key)
    except OSError:
        pass
    os.close(fd)
    for d in made:
        try:
            os.rmdir(d)
        except OSError:
            break


def held_locks() -> set[str]:
    """The lock files this process holds now."""
    return set(_HELD)


def release_all(keep: set[str] | frozenset[str] = frozenset()) -> None:
    """Release the locks this process holds but those in `keep` (the CLI releases, when a
    command ends, every lock the command took)."""
    for key in list(_HELD):
        if key not in keep:
            _drop(key)


def lock_on_main(folder: str | os.PathLike, accelerator: Any = None) -> FolderLock | None:
    """The folder's lock taken by rank 0 of a multi-process launch (or by the only process).

    Every rank learns the outcome (one broadcast), so when rank 0 is refused every rank stops
    with the same one-line error instead of waiting for it in a collective.
    """
    main = accelerator is None or accelerator.is_main_process
    lock, err = None, None
    if main:
        try:
            lock = FolderLock(folder).acquire()
        except CvlError as e:
            err = str(e)
    if accelerator is not None and accelerator.num_processes > 1:
        import torch.distributed as dist

        box = [err]
        dist.broadcast_object_list(box, src=0)
        err = box[0]
    if err is not None:
        if lock is not None:
            lock.release()
        raise CvlError(err)
    return lock
