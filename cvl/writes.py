"""What a failed write means (disk full, over quota, a file-size limit, read-only) and
`make_dirs`, `mkdir -p` with one-line errors.

The lowest layer of cvl's file-system helpers: `cvl.io` (atomic files and folders) and
`cvl.lock` (folder locks) both build on it, so neither has to import the other for it.
`cvl.io` re-exports every name here.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from cvl.errors import CvlError

# What a failed write means, by errno (OSError) or by the OS error's number in the text of
# errors that carry it as text (safetensors' Rust writer: "... (os error 28)").
_WRITE_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (the filesystem's or the process's file-size limit, ulimit -f)",
    errno.EROFS: "read-only file system",
}
# What a rerun after freeing space does, by what was being written (`atomic_dir`'s kind).
RETRY = {
    "run": "nothing complete was replaced: a run resumes from its last complete checkpoint",
    "stream": "a stream is built in a temporary folder and renamed only when complete: nothing "
    "was replaced, and the rerun builds it again",
    None: "nothing complete was replaced",
}


def write_failure(e: BaseException) -> str | None:
    """Why a write failed when the cause is the filesystem (full, over quota, a file-size
    limit, read-only), else None. OSError carries the errno; safetensors' SafetensorError
    has the OS error in its text ("os error 28", "No space left on device", "StorageFull")."""
    if isinstance(e, OSError) and e.errno in _WRITE_ERRORS:
        return _WRITE_ERRORS[e.errno]
    text = str(e)
    if "No space left on device" in text or "os error 28" in text or "StorageFull" in text:
        return _WRITE_ERRORS[errno.ENOSPC]
    for code, why in _WRITE_ERRORS.items():
        if f"os error {code})" in text:
            return why
    return None


def write_failure_message(e: BaseException, path: str | os.PathLike, retry: str | None) -> str:
    """The one line for a write that failed for `write_failure`'s reasons, with the next step."""
    why = write_failure(e) or str(e)
    note = RETRY.get(retry, retry or RETRY[None])
    if why == _WRITE_ERRORS[errno.EROFS]:
        return (
            f"{path}: cannot write it ({why}); cvl reads such a folder (cvl info, cvl eval with "
            "--out elsewhere) but writes only where it can: choose another output folder"
        )
    fix = "free some space" if "space" in why or "quota" in why else "raise the limit or free space"
    return f"{path}: {why} while writing it; {fix} and rerun the same command ({note})"


def permission_message(e: PermissionError) -> str:
    """The one line for a file or folder the process may not read (or write): which, and
    what to check (a stream or run written by another user under a strict umask)."""
    if e.filename is not None:
        what = f"{os.fsdecode(e.filename)}: {(e.strerror or 'permission denied').lower()}"
    else:  # re-raised from a data-loader worker: its text's last line names the file
        lines = str(e).strip().splitlines()
        what = lines[-1][:300] if lines else "permission denied"
    return (
        f"{what}; cvl (uid {os.getuid()}) must be able "
        "to read its inputs and write its outputs: check the owner and mode (ls -l), e.g. ask "
        "the owner to run chmod -R a+rX on the stream or run folder"
    )


def raise_if_write_failed(
    e: BaseException, path: str | os.PathLike, retry: str | None = None
) -> None:
    """Turn a write that the filesystem refused (`write_failure`) into one line saying what
    to do next; `retry`: what rerunning does (a key of `RETRY`: "run", "stream")."""
    if write_failure(e):
        raise CvlError(write_failure_message(e, path, retry)) from None


def umask() -> int:
    """The process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(target: str | os.PathLike | int, folder: bool = False) -> None:
    """Give a file made by `mkstemp` (0600) or a folder made by `mkdtemp` (0700) the mode a
    plain `open` / `mkdir` gives: 0666 / 0777 less the umask, so that a teammate or a job
    under another uid reads what cvl writes as it reads the user's other files. `target`: a
    path or an open file's descriptor."""
    mode = (0o777 if folder else 0o666) & ~umask()
    if isinstance(target, int):
        os.fchmod(target, mode)
    else:
        os.chmod(target, mode)


def honour_umask_tree(folder: str | os.PathLike) -> None:
    """`honour_umask` on a folder built aside and everything in it (writers that make private
    files whatever the umask: safetensors' writes 0600), before it is renamed into place."""
    mask = umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)


def make_dirs(path: str | os.PathLike, what: str | None = None) -> Path:
    """`mkdir -p` with one-line errors: a file in the way, no permission."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), path)
        raise CvlError(
            f"{what or path}: cannot create it: {blocker} is a file, not a folder; "
            "choose another output path"
        ) from None
    except PermissionError as e:
        raise CvlError(f"{what or path}: cannot create it ({e.strerror}: {e.filename})") from None
    except OSError as e:
        raise_if_write_failed(e, path)
        raise CvlError(f"{what or path}: cannot create it ({e.strerror})") from None
    return path
