"""Small file-system helpers shared by every step: atomic folders and files, JSON, and the
safety rules of output folders (what `--overwrite` may replace, disk-full errors, leftovers)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from cvl.errors import CvlError
from cvl.lock import FolderLock, command_line
from cvl.writes import (  # noqa: F401  (re-exported: the helpers' public home was cvl.io)
    RETRY,
    honour_umask,
    honour_umask_tree,
    make_dirs,
    permission_message,
    raise_if_write_failed,
    write_failure,
    write_failure_message,
)

# The marker of a folder cvl wrote as a command's output: `--overwrite` replaces only folders
# holding one of the same kind (a stream, an export, labels), never anything else.
OUTPUT_MARKER = ".cvl-output.json"
MARKER_SCHEMA = "cvl.output/1"


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
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        honour_umask(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise_if_write_failed(e, path)
        raise


def check_parent_writable(path: str | os.PathLike) -> Path:
    """Fail early with a clear message when `path` cannot be created."""
    path = Path(path).absolute()
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CvlError(
            f"{path}: cannot create it: {parent} is a file, not a folder; choose another path"
        )
    if not os.access(parent, os.W_OK):
        raise CvlError(f"{path}: cannot write here ({parent} is not writable)")
    return path


# -- what --overwrite may replace ---------------------------------------------------------------
def write_marker(folder: str | os.PathLike, kind: str) -> None:
    """Mark `folder` as a `kind` output written by cvl (see `check_overwrite`)."""
    from cvl import __version__

    write_json(
        Path(folder) / OUTPUT_MARKER,
        {
            "schema": MARKER_SCHEMA,
            "kind": kind,
            "cvl": __version__,
            "command": command_line(),
            "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        },
    )


def output_kind(folder: str | os.PathLike) -> str | None:
    """The kind in `folder`'s cvl marker, or None when cvl did not mark it."""
    f = Path(folder) / OUTPUT_MARKER
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d.get("kind") if isinstance(d, dict) and d.get("schema") == MARKER_SCHEMA else None


def _what_is(folder: Path) -> str:
    if (folder / "run.json").is_file():
        return "a cvl run folder"
    kind = output_kind(folder)
    if kind:
        return f"a cvl {kind} folder"
    for p in folder.parents:
        if (p / "run.json").is_file():
            return f"a part of the cvl run folder {p}"
        if output_kind(p):
            return f"a part of the cvl {output_kind(p)} folder {p}"
    if (folder / "stream.json").is_file():
        return f"a stream folder without cvl's marker ({OUTPUT_MARKER}: an older cvl wrote it)"
    return f"a folder cvl did not write (no {OUTPUT_MARKER})"


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_overwrite(
    out: str | os.PathLike, kind: str, inputs: Iterable[str | os.PathLike | None] = ()
) -> None:
    """Refuse to replace `out` unless cvl wrote it as a `kind` output and it holds no input.

    `--overwrite` deletes the old folder once the new one is complete; this decides whether it
    may: the folder must carry cvl's marker of the same kind (so a data folder, a run, a run's
    tasks/ or anything else is never deleted), and must neither be nor contain one of the
    command's inputs.
    """
    out_p = Path(out)
    if not out_p.exists():
        return
    real = Path(os.path.realpath(out_p))
    if not real.is_dir():
        raise CvlError(f"--out {out_p} is a file, not a folder; choose another --out")
    for inp in inputs:
        if inp is None or str(inp) == "":
            continue
        ri = Path(os.path.realpath(inp))
        if _within(ri, real):
            raise CvlError(
                f"--out {out_p} holds an input of this command ({inp}); --overwrite would "
                "delete it: choose another --out"
            )
    if output_kind(real) != kind:
        raise CvlError(
            f"--out {out_p} is {_what_is(real)}, not a cvl {kind} folder; --overwrite replaces "
            "only what cvl wrote there: choose another --out, or remove it yourself"
        )


# -- atomic folders -----------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(
    out: str | os.PathLike,
    overwrite: bool = False,
    *,
    kind: str | None = None,
    inputs: Iterable[str | os.PathLike | None] = (),
    retry: str | None = None,
) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it to `out` only when complete.

    Refuses an existing `out` unless `overwrite`; on any error the partial folder is removed,
    so nothing half-written is ever left at `out`. A command's output (`kind` given: "stream",
    "export", ...) is locked for the build (`cvl.lock`), may replace only a folder cvl marked
    as the same kind (`check_overwrite`), and gets that marker. Leftovers of a killed earlier
    writer of `out` (temp and old copies) are cleaned first; callers are `out`'s only writer
    (its lock, or the run's). A write the filesystem refuses (full, read-only, ...) is one
    line whose next step is `RETRY[retry or kind]` (a run's folders: retry="run").
    """
    retry = retry or kind
    inputs = list(inputs)
    lock = None
    if kind is not None:
        lock = FolderLock(out).acquire()
    try:
        out = check_parent_writable(out)
        recover_dir(out)
        if out.exists() and not overwrite:
            raise CvlError(f"{out} exists (pass --overwrite to replace it)")
        if kind is not None:
            check_overwrite(out, kind, inputs)
        make_dirs(out.parent)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        except OSError as e:
            raise_if_write_failed(e, out, retry)
            raise
        try:
            yield tmp
            if kind is not None:
                write_marker(tmp, kind)
                check_overwrite(out, kind, inputs)  # again: something may have appeared since
            honour_umask_tree(tmp)  # mkdtemp's 0700, safetensors' 0600: readable as umask says
            if out.exists():
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.replace(out, old)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise_if_write_failed(e, out, retry)
            raise
    finally:
        if lock is not None:
            lock.release()


def recover_dir(out: str | os.PathLike) -> Path | None:
    """Clean up after a process that died inside `atomic_dir` writing `out`.

    `atomic_dir` renames the old folder to `.NAME.old-PID` and then the new one to `out`; a
    kill between the two renames leaves no `out` but a complete old copy, which this renames
    back (newest first); a kill after both leaves `out` complete and the old copy, which is
    removed. Half-written temp folders of killed writers are removed. Call it only from the
    folder's single writer. Returns the restored path, or None.
    """
    out = Path(out)
    if not out.parent.is_dir():
        return None
    for partial in out.parent.glob(f".{out.name}.*.partial"):  # a killed writer's temp folder
        shutil.rmtree(partial, ignore_errors=True)
    olds = sorted(
        out.parent.glob(f".{out.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    if out.exists() or not olds:
        for o in olds:  # the swap finished: the old copy is no longer needed
            shutil.rmtree(o, ignore_errors=True)
        return None
    os.replace(olds[0], out)
    for o in olds[1:]:
        shutil.rmtree(o, ignore_errors=True)
    return out


def leftover_names(folder: str | os.PathLike) -> set[str]:
    """Names of the folders in `folder` that killed `atomic_dir` writers left temp/old copies of."""
    names = set()
    d = Path(folder)
    if not d.is_dir():
        return names
    for p in d.iterdir():
        n = p.name
        if not n.startswith(".") or not p.is_dir():
            continue
        if n.endswith(".partial") and n.count(".") >= 3:
            names.add(n[1 : -len(".partial")].rsplit(".", 1)[0])
        elif ".old-" in n:
            names.add(n[1:].rsplit(".old-", 1)[0])
    return names


def recover_children(folder: str | os.PathLike) -> list[str]:
    """`recover_dir` for every folder in `folder` with leftovers; returns their names."""
    names = sorted(leftover_names(folder))
    for n in names:
        recover_dir(Path(folder) / n)
    return names
