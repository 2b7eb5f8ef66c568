"""The one path every URL/file source takes: rows -> split rule -> images -> shards -> manifest.

A source module only turns its files into `Row`s (one per image-text pair, with an id, caption,
URL or local path, and whatever it knows: task, split, category, metadata) and picks a
`SplitRule`. `build_stream` then

1. drops bad rows with a counted reason (missing caption or image, unsafe or duplicate id,
   non-UTF-8 text, an image path that resolves outside the source's image root: `..`,
   absolute paths, symlinks leading out),
2. lets the split rule assign each row a task and a split (train / val / test / query /
   gallery),
3. applies the task order (``default``, ``reversed`` or a comma list; a subset keeps only
   those tasks),
4. gets the images: URLs through the download cache (img2dataset, see `download.py`), local
   files through the same img2dataset resizer (an image whose header announces more than
   `MAX_PIXELS` pixels is dropped as ``too_large`` before it is decoded),
5. writes ``train/<task>/*.tar`` and ``eval/<split>/<task>/*.tar`` (KEY.jpg, KEY.txt,
   KEY.json with id, task, category, source, ...), ``stream.json``, ``build_report.json``
   and ``dropped.jsonl`` (every dropped sample with its reason), atomically.

Split rules are small classes with ``assign(rows, report) -> rows``: `ColumnSplit` (the task is a
field of the row: P9D industries, a table's task column), `InstanceSplit` (seeded random equal
chunks with held-out val/test, IncCLIP's instance split) and `ClassSplit` (tasks are groups of
class labels, e.g. IncCLIP's BEiT pseudo-label split: give it the label of each row).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cvl.errors import CvlError
from cvl.io import atomic_dir, check_overwrite
from cvl.progress import progress_bar
from cvl.streams.download import (
    TOO_LARGE,
    DownloadCache,
    DownloadOptions,
    ImageOptions,
    process_bytes,
    process_local,
)
from cvl.streams.manifest import EvalSet, Manifest, ShardSet, TaskInfo, save_manifest
from cvl.streams.writer import BuildReport, ShardSink

SPLITS = ("train", "val", "test", "query", "gallery")
EVAL_KIND = {"val": "pairs", "test": "pairs", "query": "query", "gallery": "gallery"}
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
    """True when `path` resolves (symlinks followed) to a place inside the folder `root`."""
    import os

    p, r = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return p == r or r in p.parents


def validate_rows(rows: Iterable[Row], drop: Dropper) -> list[Row]:
    """Drop rows without caption/image, with unsafe, non-UTF-8 or duplicate (per split) ids,
    or with an image path outside their image root."""
    out: list[Row] = []
    seen: set[tuple[str, str]] = set()
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


# -- split rules ---------------------------------------------------------------------------------
class SplitRule:
    """Assigns every row a task (and, for rules that hold data out, a split)."""

    name = "rule"

    def assign(self, rows: list[Row], drop: Dropper) -> list[Row]:
        raise NotImplementedError

    def task_names(self) -> list[str]:
        """Tasks in their default order (valid after `assign`)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        """Numbers for build_report.json (what was selected, what was left unused)."""
        return {}

    def finalize(self, rows: list[Row], drop: Dropper) -> list[Row]:
        """Last look once it is known which rows have an image (default: keep all)."""
        return rows


class ColumnSplit(SplitRule):
    """The task is already a field of each row (P9D industry, a table's task column).

    `tasks` fixes the default order (rows with other tasks are dropped as unknown_task);
    without it the order is that of first appearance. Per task, ``val``/``test`` training rows
    are held out at random (seeded), then at most ``limit`` training rows and ``eval_limit``
    rows of each evaluation split are kept (a seeded random subset, in file order).
    """

    name = "column"

    def __init__(
        self,
        what: str,
        tasks: list[str] | None = None,
        default_task: str | None = None,
        limit: int | None = None,
        eval_limit: int | None = None,
        val: int = 0,
        test: int = 0,
        seed: int = 0,
    ) -> None:
        self.what = what
        self.fixed = list(tasks) if tasks is not None else None
        self.default_task = default_task
        self.limit, self.eval_limit, self.val, self.test, self.seed = (
            limit,
            eval_limit,
            val,
            test,
            seed,
        )
        self._seen: list[str] = []
        self.unsampled = 0

    def assign(self, rows: list[Row], drop: Dropper) -> list[Row]:
        seen: dict[str, None] = dict.fromkeys(self.fixed or [])
        groups: dict[tuple[str, str], list[Row]] = {}
        pos = {id(r): i for i, r in enumerate(rows)}
        for r in rows:
            if not r.task:
                r.task = self.default_task
            if not r.task:
                drop("missing_task", r)
                continue
            if self.fixed is not None and r.task not in seen:
                drop("unknown_task", r, detail=str(r.task))
                continue
            if r.split not in SPLITS:
                drop("unknown_split", r, detail=str(r.split))
                continue
            seen.setdefault(r.task)
            groups.setdefault((r.task, r.split), []).append(r)
        self._seen = list(seen)
        out: list[Row] = []
        for t_i, task in enumerate(self._seen):
            rng = np.random.default_rng([self.seed, 777, t_i])
            train = groups.get((task, "train"), [])
            if self.val or self.test:
                perm = [train[i] for i in rng.permutation(len(train))]
                for r in perm[: self.test]:
                    r.split = "test"
                for r in perm[self.test : self.test + self.val]:
                    r.split = "val"
                for s in ("test", "val"):
                    groups.setdefault((task, s), []).extend(r for r in perm if r.split == s)
                train = [r for r in train if r.split == "train"]
                groups[(task, "train")] = train
            for s in SPLITS:
                g = groups.get((task, s), [])
                lim = self.limit if s == "train" else self.eval_limit
                if lim is not None and len(g) > lim:
                    self.unsampled += len(g) - lim
                    g = [g[i] for i in sorted(rng.choice(len(g), size=lim, replace=False))]
                out.extend(sorted(g, key=lambda r: pos[id(r)]))
        return out

    def task_names(self) -> list[str]:
        return list(self._seen)

    def summary(self) -> dict[str, Any]:
        return {"unsampled": self.unsampled}

    def describe(self) -> str:
        parts = [f"one task per {self.what}"]
        if self.val or self.test:
            parts.append(
                f"{self.val} val / {self.test} test training pairs per task held out (seeded)"
            )
        if self.limit is not None:
            parts.append(f"at most {self.limit} training pairs per task (seeded random subset)")
        if self.eval_limit is not None:
            parts.append(f"at most {self.eval_limit} pairs per task and eval set")
        return "; ".join(parts)


def _chunks(items: list, n: int) -> list[list]:
    """n contiguous, as-equal-as-possible parts (sizes differ by at most one)."""
    return [[items[i] for i in part] for part in np.array_split(np.arange(len(items)), n)]


class InstanceSplit(SplitRule):
    """Seeded random, equal chunks (IncCLIP's instance split); val/test held out per chunk.

    Rows whose split is already set to val/test by the source (official splits) keep it when
    ``presplit``; otherwise ``val`` and ``test`` rows per task are drawn at random first. Then
    at most ``train`` training rows (all if None) are cut into ``chunks`` equal parts. Once the
    downloads are known, the training chunks are trimmed (seeded) to the smallest one, so they
    stay exactly equal when some URLs fail (trimmed rows: ``chunk_balance``; ask a larger
    ``--sample`` to make up for failures). Held-out sets keep what downloaded.
    """

    name = "instance"

    def __init__(
        self,
        chunks: int = 1,
        train: int | None = None,
        val: int = 0,
        test: int = 0,
        seed: int = 0,
        prefix: str = "chunk",
        names: list[str] | None = None,
        presplit: bool = False,
        equal: bool = True,
    ) -> None:
        if chunks <= 0:
            raise CvlError("--chunks must be positive")
        if names is not None and len(names) != chunks:
            raise CvlError(f"need {chunks} task names, got {len(names)}")
        self.chunks, self.train, self.val, self.test = chunks, train, val, test
        self.seed, self.presplit, self.equal = seed, presplit, equal
        self.names = names or ([prefix] if chunks == 1 else [f"{prefix}{i}" for i in range(chunks)])
        self.got: dict[str, int] = {}
        self.unsampled = 0

    def assign(self, rows: list[Row], drop: Dropper) -> list[Row]:
        rng = np.random.default_rng([self.seed, 1234])
        pos = {id(r): i for i, r in enumerate(rows)}
        pools: dict[str, list[Row]] = {s: [] for s in SPLITS}
        if self.presplit:
            for r in rows:
                if r.split not in pools:
                    drop("unknown_split", r, detail=r.split)
                    continue
                pools[r.split].append(r)
            for s in pools:
                pools[s] = [pools[s][i] for i in rng.permutation(len(pools[s]))]
        else:
            perm = [rows[i] for i in rng.permutation(len(rows))]
            nt, nv = self.test * self.chunks, self.val * self.chunks
            pools["test"], pools["val"], pools["train"] = (
                perm[:nt],
                perm[nt : nt + nv],
                perm[nt + nv :],
            )
        want = {
            "train": self.train,
            "val": self.val * self.chunks,
            "test": self.test * self.chunks,
            "query": None,
            "gallery": None,
        }
        if self.presplit:  # official val/test sets: all of them unless a size is asked for
            want["val"] = want["val"] or None
            want["test"] = want["test"] or None
        out: list[Row] = []
        for split, pool in pools.items():
            limit = want[split]
            if limit is not None:
                self.unsampled += max(0, len(pool) - limit)  # not used (not dropped: not asked for)
                pool = pool[:limit]
            self.got[split] = len(pool)
            # keep file order inside a chunk so shards are easy to inspect
            for name, part in zip(self.names, _chunks(pool, self.chunks)):
                for r in sorted(part, key=lambda r: pos[id(r)]):
                    r.split, r.task = split, name
                    out.append(r)
        return out

    def task_names(self) -> list[str]:
        return list(self.names)

    def summary(self) -> dict[str, Any]:
        return {"selected": dict(self.got), "unsampled": self.unsampled}

    def finalize(self, rows: list[Row], drop: Dropper) -> list[Row]:
        """Equal training chunks again after failed downloads: trim to the smallest chunk."""
        if self.chunks == 1 or not self.equal:
            return rows
        by: dict[tuple[str, str], list[Row]] = {}
        for r in rows:
            by.setdefault((r.split, r.task or ""), []).append(r)
        rng = np.random.default_rng([self.seed, 4242])
        out_ids: set[int] = set()
        for split in SPLITS:
            parts = [by.get((split, t), []) for t in self.names]
            if split != "train":  # held-out sets keep what they have
                out_ids.update(id(r) for p in parts for r in p)
                continue
            n = min(len(p) for p in parts)
            for p in parts:
                keep = set(rng.permutation(len(p))[:n].tolist())
                for i, r in enumerate(p):
                    if i in keep:
                        out_ids.add(id(r))
                    else:
                        drop("chunk_balance", r, detail=f"trimmed to {n} per chunk")
        return [r for r in rows if id(r) in out_ids]

    def describe(self) -> str:
        held = ", ".join(
            f"{n} {s} per task" for s, n in (("val", self.val), ("test", self.test)) if n
        )
        src = "official splits" if self.presplit else "seeded random held-out"
        return (
            f"instance split: {self.chunks} seeded random equal chunk(s)"
            + (f" of {self.train} training pairs in total" if self.train else "")
            + (f"; {held} ({src})" if held else "")
        )


class ClassSplit(SplitRule):
    """Tasks are groups of class labels (IncCLIP's class split with BEiT pseudo-labels).

    `label_of(row)` gives a row's class index (0..n_classes-1) or None (dropped: no_label);
    classes are cut into `chunks` equal contiguous groups, after a seeded shuffle if
    `shuffle_classes`. `test` rows per task are held out at random inside each task.
    """

    name = "class"

    def __init__(
        self,
        label_of: Callable[[Row], int | None],
        n_classes: int = 1000,
        chunks: int = 4,
        test: int = 0,
        seed: int = 0,
        shuffle_classes: bool = False,
        prefix: str = "chunk",
    ) -> None:
        self.label_of, self.n_classes, self.chunks = label_of, n_classes, chunks
        self.test, self.seed, self.shuffle = test, seed, shuffle_classes
        self.names = [f"{prefix}{i}" for i in range(chunks)]
        classes = np.arange(n_classes)
        if shuffle_classes:
            classes = np.random.default_rng([seed, 99]).permutation(n_classes)
        self.groups = [g.tolist() for g in np.array_split(classes, chunks)]
        self.task_of = {int(c): self.names[i] for i, g in enumerate(self.groups) for c in g}

    def assign(self, rows: list[Row], drop: Dropper) -> list[Row]:
        per_task: dict[str, list[Row]] = {n: [] for n in self.names}
        for r in rows:
            lab = self.label_of(r)
            if lab is None or int(lab) not in self.task_of:
                drop("no_label", r, detail=str(lab))
                continue
            r.task, r.split = self.task_of[int(lab)], "train"
            r.meta.setdefault("label", int(lab))
            per_task[r.task].append(r)
        rng = np.random.default_rng([self.seed, 4321])
        out = []
        for name in self.names:
            rs = per_task[name]
            test_idx = set(rng.permutation(len(rs))[: self.test].tolist())
            for i, r in enumerate(rs):
                if i in test_idx:
                    r.split = "test"
                out.append(r)
        return out

    def task_names(self) -> list[str]:
        return list(self.names)

    def describe(self) -> str:
        return (
            f"class split: {self.n_classes} classes in {self.chunks} groups"
            + (" (seeded shuffle)" if self.shuffle else " (contiguous)")
            + (f"; {self.test} test pairs per task" if self.test else "")
        )


# -- task order ----------------------------------------------------------------------------------
def resolve_order(
    spec: str | None, default: list[str], aliases: dict[str, str] | None = None
) -> list[str]:
    """``default`` | ``reversed`` | a comma list of task names (or aliases, case-insensitive)."""
    if spec is None or spec.strip().lower() in ("", "default"):
        return list(default)
    if spec.strip().lower() in ("reversed", "reverse"):
        return list(reversed(default))
    lookup = {t.lower(): t for t in default}
    for a, t in (aliases or {}).items():
        lookup.setdefault(a.lower(), t)
    order: list[str] = []
    for part in spec.split(","):
        p = part.strip()
        if not p:
            continue
        t = lookup.get(p.lower())
        if t is None:
            raise CvlError(f"--order: unknown task '{p}' (tasks: {', '.join(default)})")
        if t in order:
            raise CvlError(f"--order lists '{t}' twice")
        order.append(t)
    if not order:
        raise CvlError("--order is empty")
    return order


# -- the build -----------------------------------------------------------------------------------
@dataclass
class BuildOptions:
    """Everything a builder needs besides its rows (shared by every source subcommand)."""

    out: Path
    name: str | None = None
    order: str | None = None
    seed: int = 0
    image: ImageOptions = field(default_factory=ImageOptions)
    download: DownloadOptions = field(default_factory=DownloadOptions)
    downloads: Path | None = None  # cache folder; default <out parent>/downloads/<source>
    shard_size: int = 10000
    overwrite: bool = False
    progress: bool = True
    log: Callable[[str], None] = print
    command: list[str] | None = None  # replaces the img2dataset child command (tests)

    def cache_dir(self, source: str) -> Path:
        return (
            Path(self.downloads)
            if self.downloads
            else Path(self.out).absolute().parent / "downloads" / source
        )


def check_out(opts: BuildOptions) -> None:
    """Refuse an existing output before any work (atomic_dir checks again at the end): without
    --overwrite, and with it unless cvl wrote it as a stream (`cvl.io.check_overwrite`)."""
    out = Path(opts.out)
    if out.exists() and not opts.overwrite:
        raise CvlError(f"{out.absolute()} exists (pass --overwrite to replace it)")
    check_overwrite(out, "stream")


def _image_plan(
    rows: list[Row], source: str, opts: BuildOptions, drop: Dropper, report: BuildReport
) -> dict[int, tuple]:
    """Row index -> ("file", path) | ("cache", tar, offset, size); failures are dropped."""
    plan: dict[int, tuple] = {}
    url_rows: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if r.data is not None:
            plan[i] = ("bytes", r.data)
        elif r.path:
            plan[i] = ("file", r.path)
        elif r.blob:
            plan[i] = ("b64", *r.blob)
        elif r.member:  # an image inside a webdataset / img2dataset shard: resized as a file
            plan[i] = ("raw", *r.member)
        else:
            url_rows.setdefault(r.url or "", []).append(i)
    if url_rows:
        cdir = opts.cache_dir(source).absolute()
        out = Path(opts.out).absolute()
        if cdir == out or out in cdir.parents:
            raise CvlError(
                f"--downloads {cdir} is inside the stream folder {out}: put it beside it"
            )
        cache = DownloadCache(cdir, opts.image)
        want = {
            u: {"id": rows[ix[0]].id, "task": rows[ix[0]].task, "category": rows[ix[0]].category}
            for u, ix in url_rows.items()
        }
        recs, stats = cache.fetch(
            want, opts.download, log=opts.log, progress=opts.progress, command=opts.command
        )
        dl = stats.to_json()
        dl["cache"] = str(cache.root)
        report.notes["download"] = dl
        for u, ix in url_rows.items():
            rec = recs[u]
            loc = cache.locate(rec) if rec.ok else None
            for i in ix:
                if loc is not None:
                    plan[i] = ("cache", *loc)
                elif rec.ok:
                    drop("cache_missing", rows[i], detail=f"image of {u} is gone from {cache.root}")
                else:
                    drop(rec.status, rows[i], detail=f"{u}: {rec.error}")
    return plan


def _load(item: tuple, image: ImageOptions) -> tuple[bytes | None, str | None]:
    if item[0] == "file":
        return process_local(item[1], image)
    if item[0] == "b64":
        return _load_b64(item[1], item[2], item[3], image)
    if item[0] == "bytes":
        return process_bytes(item[1], image)
    kind, tar, off, size = item
    try:
        with open(tar, "rb") as f:
            f.seek(off)
            data = f.read(size)
    except OSError as e:
        return None, f"cannot read {'the shard' if kind == 'raw' else 'cached'} image: {e}"
    # an image inside a source shard is resized as a file; the cache holds resized images
    return process_bytes(data, image) if kind == "raw" else (data, None)


def _load_b64(
    path: str, off: int, size: int, image: ImageOptions
) -> tuple[bytes | None, str | None]:
    """A base64 image stored inside a text file (MUGE / EC-T2I `*.img.tsv`)."""
    try:
        with open(path, "rb") as f:
            f.seek(off)
            raw = f.read(size)
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e}"
    try:
        data = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        return None, f"undecodable base64 ({e})"
    if not data:
        return None, "empty image"
    return process_bytes(data, image)


def _load_star(args: tuple) -> tuple[bytes | None, str | None]:
    return _load(*args)


def _images(items: list[tuple], image: ImageOptions, processes: int) -> Iterator[tuple]:
    """Image bytes for each plan item, in order (local files resized in a pool if processes>1)."""
    n_local = sum(1 for it in items if it[0] in ("file", "b64", "raw", "bytes"))
    if processes > 1 and n_local > 256:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(processes) as pool:
            yield from pool.imap(_load_star, ((it, image) for it in items), chunksize=64)
    else:
        for it in items:
            yield _load(it, image)


def build_stream(
    rows: list[Row],
    rule: SplitRule,
    opts: BuildOptions,
    *,
    source: str,
    report: BuildReport,
    drop: Dropper,
    source_args: dict[str, Any] | None = None,
    aliases: dict[str, str] | None = None,
    descriptions: dict[str, str] | None = None,
    task_extra: dict[str, dict[str, Any]] | None = None,
    complete: Callable[[Manifest, BuildReport], None] | None = None,
) -> Manifest:
    """Write a stream folder from rows (see the module docstring); returns its manifest.

    `complete(manifest, report)`, when given, sees the manifest before it is written (it may
    add to it, or raise to leave nothing written: e.g. a class that lost all its images)."""
    log = opts.log
    check_out(opts)
    rows = validate_rows(rows, drop)
    rows = rule.assign(rows, drop)
    report.notes["split"] = {"rule": rule.name, "description": rule.describe(), **rule.summary()}
    default = rule.task_names()
    order = resolve_order(opts.order, default, aliases)
    keep = set(order)
    kept_rows = []
    for r in rows:
        if r.task in keep:
            kept_rows.append(r)
        else:
            drop("task_not_in_order", r, detail=str(r.task))
    rows = kept_rows
    if not rows:
        raise CvlError(f"{source}: no usable rows left ({_drops(report)})")
    n_split = Counter(r.split for r in rows)
    log(
        f"{source}: read {report.read} records; selected {len(rows)} pairs "
        f"({', '.join(f'{s} {n}' for s, n in n_split.items())}); "
        f"{sum(report.dropped.values())} dropped so far"
    )

    plan = _image_plan(rows, source, opts, drop, report)
    with_image = [i for i in range(len(rows)) if i in plan]
    final = rule.finalize([rows[i] for i in with_image], drop)
    keep_ids = {id(r) for r in final}
    groups: dict[tuple[str, str], list[int]] = {}
    for i in with_image:
        r = rows[i]
        if id(r) in keep_ids:
            groups.setdefault((r.split, r.task or ""), []).append(i)
    out = Path(opts.out)
    written: dict[tuple[str, str], ShardSet] = {}
    cats: dict[str, set[str]] = {t: set() for t in order}
    # a rule may write a set in sub-folders (TimeSplit: one per period of a merged task)
    sub = getattr(rule, "shard_group", None)
    parts = {key: _parts(idx, rows, sub) for key, idx in groups.items()}
    sub_sets: dict[tuple[str, str, str], ShardSet] = {}
    with atomic_dir(out, overwrite=opts.overwrite, kind="stream") as tmp:
        seq = [(split, task) for task in order for split in SPLITS if (split, task) in groups]
        flat = [i for key in seq for _, idx in parts[key] for i in idx]
        bar = progress_bar(
            total=len(flat),
            desc=f"{source} shards",
            unit="img",
            show=opts.progress,
            leave=False,
        )
        images = _images([plan[i] for i in flat], opts.image, opts.download.processes)
        folder = task_folders(order)

        def write_one(sink: ShardSink, split: str, task: str, i: int) -> None:
            data, err = next(images)
            bar.update()
            r = rows[i]
            if data is None:
                why = (
                    "bad_base64"
                    if (err or "").startswith("undecodable base64")
                    else TOO_LARGE
                    if (err or "").startswith(TOO_LARGE)
                    else "bad_image"
                )
                drop(why, r, detail=f"{r.where}: {err}")
                return
            meta = {
                # source metadata first: it never overrides the fields below
                **{k: printable(v) for k, v in r.meta.items()},
                "id": r.id,
                "task": task,
                "category": r.category,
                "source": source,
                "split": split,
                **({"url": r.url} if r.url else {}),
                **({"file": printable(Path(r.path).name)} if r.path else {}),
                **({"captions": r.captions} if r.captions and len(r.captions) > 1 else {}),
            }
            sink.write(r.id, data, r.caption, meta)
            report.keep(split)
            if r.category:
                cats[task].add(r.category)

        for split, task in seq:
            base = f"train/{folder[task]}" if split == "train" else f"eval/{split}/{folder[task]}"
            sets: list[ShardSet] = []
            for group, idx in parts[(split, task)]:
                rel = base if group is None else f"{base}/{task_folders([group])[group]}"
                sink = ShardSink(tmp, rel, maxcount=opts.shard_size)
                for i in idx:
                    write_one(sink, split, task, i)
                ss = sink.close()
                if ss.count:
                    sets.append(ss)
                    if group is not None:
                        sub_sets[(split, task, group)] = ss
            if sets:
                written[(split, task)] = ShardSet(
                    [s for ss in sets for s in ss.shards], sum(ss.count for ss in sets)
                )
        bar.close()

        tasks: dict[str, TaskInfo] = {}
        final_order = []
        for t in order:
            tr = written.get(("train", t))
            if tr is None:
                report.notes.setdefault("warnings", []).append(
                    f"task '{t}' has no usable training pairs: left out of the stream"
                )
                continue
            final_order.append(t)
            tasks[t] = TaskInfo(
                name=t,
                train=tr,
                description=(descriptions or {}).get(t, ""),
                categories=sorted(cats[t]) or None,
                extra=dict((task_extra or {}).get(t, {})),
            )
        if not tasks:
            raise CvlError(f"{source}: no task has usable training pairs ({_drops(report)})")
        evals: dict[str, EvalSet] = {}
        for split in SPLITS[1:]:
            per = {t: written[(split, t)] for t in final_order if (split, t) in written}
            if per:
                evals[split] = EvalSet(EVAL_KIND[split], per)
        sets = {(sp, t, None): ss for (sp, t), ss in written.items()} | sub_sets
        extra = rule.manifest_extra(sets, final_order) if hasattr(rule, "manifest_extra") else {}
        m = Manifest(
            name=opts.name or out.name,
            source=source,
            split_rule=rule.describe(),
            seed=opts.seed,
            task_order=final_order,
            tasks=tasks,
            eval_sets=evals,
            source_args={
                **(source_args or {}),
                "order": opts.order or "default",
                "image": opts.image.to_json(),
            },
            benchmarks=extra.get("benchmarks") or {},
            time=extra.get("time"),
        )
        if complete is not None:
            complete(m, report)
        save_manifest(m, tmp)
        report.notes["task_order"] = final_order
        report.notes["counts"] = {
            split: {t: written[(split, t)].count for t in final_order if (split, t) in written}
            for split in SPLITS
            if any((split, t) in written for t in final_order)
        }
        if m.time:  # the written pairs of every period: training and held out
            report.notes["time"] = time_counts(m, sets)
        report.save(tmp)
        with open(tmp / DROPPED_FILE, "w", encoding="utf-8") as f:
            for rec in drop.rows:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    m.root = out.absolute()
    return m


def _parts(
    idx: list[int], rows: list[Row], group: Callable[[Row], str | None] | None
) -> list[tuple[str | None, list[int]]]:
    """The rows of one (split, task) set cut by `group` (in order of first appearance; kept
    in file order within a group), or one part (None) without it."""
    if group is None:
        return [(None, idx)]
    by: dict[str | None, list[int]] = {}
    for i in idx:
        by.setdefault(group(rows[i]), []).append(i)
    return list(by.items())


def time_counts(m: Manifest, sets: dict[tuple[str, str, str | None], ShardSet]) -> dict[str, Any]:
    """build_report.json's `time`: the written training and held-out pairs of every period
    of a time-ordered stream (`cvl.streams.timesplit`), with its task."""
    t = m.time or {}
    out: dict[str, Any] = {}
    for task, ps in (t.get("tasks") or {}).items():
        for p in ps:
            n = {}
            for split in ("train", "val", "test"):
                ss = sets.get((split, task, p)) or (
                    sets.get((split, task, None)) if len(ps) == 1 else None
                )
                n[split] = ss.count if ss is not None else 0
            out[p] = {"task": task, **n}
    return {"unit": t.get("unit"), "periods": out}


def task_folders(tasks: list[str]) -> dict[str, str]:
    """A distinct, safe folder name per task (letters, digits, _ and -; never '..' or '/')."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for t in tasks:
        base = re.sub(r"[^\w\-]+", "_", t).strip("_") or "task"
        name, n = base, 1
        while name.lower() in used:
            name, n = f"{base}_{n}", n + 1
        used.add(name.lower())
        out[t] = name
    return out


def _drops(report: BuildReport) -> str:
    d = report.dropped.most_common(6)
    return (
        "dropped: "
        + (", ".join(f"{k} {v}" for k, v in d) if d else "nothing")
        + f"; read {report.read}"
    )
