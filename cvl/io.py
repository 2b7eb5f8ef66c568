"""Small file-system helpers shared by every step: atomic folders and files, JSON."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cvl.errors import CvlError


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    """Write JSON atomically (temp file in the same folder + rename), UTF-8, keys as given."""
    path = Path(path)
    data = json.dumps(obj, indent=indent, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, data.encode("utf-8"))


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file, turning a missing or malformed file into a one-line CvlError."""
    path = Path(path)
    if not path.is_file():
        raise CvlError(f"{path}: file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CvlError(f"{path}: not valid JSON ({e})") from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write bytes so that readers see either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_parent_writable(path: str | os.PathLike) -> Path:
    """Fail early with a clear message when `path` cannot be created."""
    path = Path(path).absolute()
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise CvlError(f"{path}: cannot write here ({parent} is not writable)")
    return path


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it to `out` only when complete.

    Refuses an existing `out` unless `overwrite`; on any error the partial folder is removed,
    so nothing half-written is ever left at `out`.
    """
    out = check_parent_writable(out)
    if out.exists() and not overwrite:
        raise CvlError(f"{out} exists (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def recover_dir(out: str | os.PathLike) -> Path | None:
    """Put back the previous complete `out` if a process died inside `atomic_dir`'s swap.

    `atomic_dir` renames the old folder to `.NAME.old-PID` and then the new one to `out`; a
    kill between the two renames leaves no `out` but a complete old copy, which this renames
    back (newest first); half-written temp folders of killed writers are removed. Call it
    only from the folder's single writer. Returns the restored path, or None.
    """
    out = Path(out)
    if not out.parent.is_dir():
        return None
    for partial in out.parent.glob(f".{out.name}.*.partial"):  # a killed writer's temp folder
        shutil.rmtree(partial, ignore_errors=True)
    if out.exists():
        return None
    olds = sorted(
        out.parent.glob(f".{out.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    if not olds:
        return None
    os.replace(olds[0], out)
    for o in olds[1:]:
        shutil.rmtree(o, ignore_errors=True)
    return out
