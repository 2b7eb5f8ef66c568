"""The rows a source gives the build, and their validation: `Row` (one image-text pair),
`Dropper` (every dropped row with its reason, to ``dropped.jsonl``) and `validate_rows` (missing
caption or image, unsafe or duplicate id, non-UTF-8 text, an image path outside the source's
image root).

Step 1 of `pipeline.build_stream`, kept apart so that the split rules and every source module
build on it without the rest of the build. `cvl.streams.pipeline` re-exports every name.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cvl.streams.writer import BuildReport

DROPPED_FILE = "dropped.jsonl"


_BAD_ID = re.compile(r"[/\\\x00-\x1f]")


@dataclass
class Row:
    """One image-text pair as a source describes it (before images are fetched)."""

    id: str
    caption: str
    url: str | None = None
    path: str | None = None
    task: str | None = None
    split: str = "train"
    category: str | None = None
    captions: list[str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    blob: tuple[str, int, int] | None = None  # (file, offset, length) of a base64 image (EC TSV)
    member: tuple[str, int, int] | None = None  # (file, offset, length) of image bytes (a tar)
    root: str | None = None  # the image root `path` must resolve inside (else outside_root)
    data: bytes | None = None  # an encoded image read from an array file (CIFAR, MNIST)

    @property
    def where(self) -> str:
        if self.blob or self.member:
            f, off, _ = self.blob or self.member  # type: ignore[misc]
            return f"{Path(f).name}@{off}"
        if self.data is not None and not (self.url or self.path):
            return f"<array image {self.id}>"
        return self.url or self.path or ""


class Dropper:
    """Counts dropped rows in the BuildReport and remembers them for dropped.jsonl."""

    def __init__(self, report: BuildReport) -> None:
        self.report = report
        self.rows: list[dict[str, Any]] = []

    def __call__(
        self, reason: str, row: Row | None = None, detail: str = "", where: str = ""
    ) -> None:
        ex = f"{row.id}: {detail or row.where}" if row is not None else (detail or where)
        self.report.drop(reason, printable(ex[:300]))
        rec: dict[str, Any] = {"reason": reason}
        if row is not None:
            rec.update(
                id=printable(str(row.id)), split=row.split, task=row.task, src=printable(row.where)
            )
        elif where:
            rec["where"] = printable(where)
        if detail:
            rec["detail"] = printable(detail[:500])
        self.rows.append(rec)


def printable(s: Any) -> Any:
    """Text safe to write as UTF-8: bytes that were not UTF-8 become U+FFFD."""
    if isinstance(s, str) and has_surrogates(s):
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(s, list):
        return [printable(x) for x in s]
    return s


def has_surrogates(s: str) -> bool:
    """True for text decoded with errors='surrogateescape' from bytes that were not UTF-8."""
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def clean_text(v: Any) -> str | None:
    """A caption as one line of text, or None if missing/empty."""
    if v is None or isinstance(v, (dict, list, bool)):
        return None
    s = " ".join(str(v).split())
    return s or None


def id_problem(raw: Any) -> str | None:
    """Why a raw id cannot be used (None if fine): empty, path-like or control characters."""
    if raw is None or isinstance(raw, (dict, list, bool)):
        return "missing_id"
    s = str(raw).strip()
    if not s:
        return "missing_id"
    if s in (".", "..") or _BAD_ID.search(s) or ".." in s:
        return "unsafe_id"
    if has_surrogates(s):
        return "non_utf8"
    return None


def inside_root(path: str | Path, root: str | Path) -> bool:
    """True when `path` resolves (symlinks followed) to a place inside the folder `root`.

    The same as comparing `os.path.realpath`s, with the folders' resolutions cached (a
    table's images share a few folders): one `lstat` per image instead of one per path
    component, on the build's one serial path (`validate_rows`)."""
    cwd = os.getcwd()  # relative paths resolve against it: part of the cache key
    p = os.fspath(path)
    head, name = os.path.split(p)
    if name in ("", ".", "..") or os.path.islink(p):
        real = os.path.realpath(p)
    else:  # a plain name: its folder's resolution, then the name
        real = os.path.join(_real_dir(os.path.join(cwd, head)), name)
    r = _real_dir(os.path.join(cwd, os.fspath(root)))
    return real == r or real.startswith(r.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=4096)
def _real_dir(folder: str) -> str:
    """A folder's `os.path.realpath`, remembered for the rest of one `validate_rows` pass."""
    return os.path.realpath(folder)


def validate_rows(rows: Iterable[Row], drop: Dropper) -> list[Row]:
    """Drop rows without caption/image, with unsafe, non-UTF-8 or duplicate (per split) ids,
    or with an image path outside their image root."""
    out: list[Row] = []
    seen: set[tuple[str, str]] = set()
    _real_dir.cache_clear()  # folders resolved once per build (a later build looks again)
    for r in rows:
        prob = id_problem(r.id)
        if prob:
            drop(prob, r, detail=repr(r.id)[:80])
            continue
        r.id = str(r.id).strip()
        if r.caption is None or not str(r.caption).strip():
            drop("missing_caption", r)
            continue
        texts = [r.caption, *(r.captions or []), r.category or "", r.task or "", r.url or ""]
        if any(has_surrogates(t) for t in texts):
            drop("non_utf8", r, detail="caption/category is not valid UTF-8")
            continue
        if not r.url and not r.path and not r.blob and not r.member and r.data is None:
            drop("missing_image", r, detail="no url or image path")
            continue
        if r.url and not r.path and not re.match(r"^https?://", r.url, re.I):
            drop("bad_url", r, detail=r.url[:200])
            continue
        if r.path and r.root is not None and not inside_root(r.path, r.root):
            drop("outside_root", r, detail=f"{r.path} resolves outside {r.root}")
            continue
        k = (r.split, r.id)
        if k in seen:
            drop("duplicate_id", r)
            continue
        seen.add(k)
        out.append(r)
    return out
