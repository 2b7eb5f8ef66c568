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
   `MAX_PIXELS` pixels is dropped as ``too_large`` before it is decoded); the held-out pairs
   a rule drew at random are read first, and one whose image does not read is replaced by
   another pair of its task (and period) that does (`_read_held_out`),
5. writes ``train/<task>/*.tar`` and ``eval/<split>/<task>/*.tar`` (KEY.jpg, KEY.txt,
   KEY.json with id, task, category, source, ...), ``stream.json``, ``build_report.json``
   and ``dropped.jsonl`` (every dropped sample with its reason), atomically; an evaluation
   set lost on the way (a task left out, a set none of whose pairs was written, no
   evaluation set at all) is a warning, and the report counts what was written.

Split rules are small classes with ``assign(rows, report) -> rows``: `ColumnSplit` (the task is a
field of the row: P9D industries, a table's task column), `InstanceSplit` (seeded random equal
chunks with held-out val/test, IncCLIP's instance split) and `ClassSplit` (tasks are groups of
class labels, e.g. IncCLIP's BEiT pseudo-label split: give it the label of each row).

Where each step lives: `rows.py` (the rows and step 1), `splitrules.py` (steps 2 and 3),
`imageload.py` (step 4's reading and resizing); this module plans the images and writes the
stream (step 5), with `--processes` N processes each resizing and writing whole shards
(`parallel.py`: the bytes do not depend on N). The names of rows.py and splitrules.py stay importable from here.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cvl.data.index import index_files
from cvl.errors import CvlError
from cvl.io import atomic_dir, check_overwrite
from cvl.progress import progress_bar
from cvl.streams.download import (
    TOO_LARGE,
    DownloadCache,
    DownloadOptions,
    ImageOptions,
)
from cvl.streams.imageload import load_image, load_images
from cvl.streams.manifest import EvalSet, Manifest, ShardSet, TaskInfo, save_manifest
from cvl.streams.parallel import join_sets, map_shards, shard_ranges, unique_keys
from cvl.streams.rows import (  # noqa: F401  (re-exported: their home was this module)
    DROPPED_FILE,
    Dropper,
    Row,
    clean_text,
    has_surrogates,
    id_problem,
    inside_root,
    printable,
    validate_rows,
)
from cvl.streams.splitrules import (  # noqa: F401  (re-exported: their home was this module)
    EVAL_KIND,
    SPLITS,
    ClassSplit,
    ColumnSplit,
    InstanceSplit,
    SplitRule,
    resolve_order,
)
from cvl.streams.writer import BuildReport, ShardSink


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
    held = Counter((r.split, r.task) for r in rows if r.split != "train")
    pre = _read_held_out(rows, plan, rule, opts, drop)
    with_image = [i for i in range(len(rows)) if i in plan]
    final = rule.finalize([rows[i] for i in with_image], drop)
    keep_ids = {id(r) for r in final}
    groups: dict[tuple[str, str], list[int]] = {}
    for i in with_image:
        r = rows[i]
        if id(r) in keep_ids:
            groups.setdefault((r.split, r.task or ""), []).append(i)
    out = Path(opts.out)
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
        folder = task_folders(order)
        jobs: list[_ShardJob] = []  # every shard of every set, fixed by input order
        for split, task in seq:
            base = f"train/{folder[task]}" if split == "train" else f"eval/{split}/{folder[task]}"
            for group, idx in parts[(split, task)]:
                rel = base if group is None else f"{base}/{task_folders([group])[group]}"
                keys = unique_keys(rows[i].id for i in idx)
                for k, rg in enumerate(shard_ranges(len(idx), opts.shard_size)):
                    sl = slice(rg.start, rg.stop)
                    jobs.append(_ShardJob(split, task, group, rel, k, idx[sl], keys[sl]))

        def write_shard(j: int, images: Iterator[tuple] | None = None) -> _ShardDone:
            """Load (or take from `images`) and write the images of shard job j."""
            job = jobs[j]
            sink = ShardSink(tmp, job.rel, maxcount=opts.shard_size, first=job.number)
            done = _ShardDone()
            for i, key in zip(job.rows, job.keys):
                if i in pre:  # a held-out image read already (`_read_held_out`)
                    data, err = pre[i], None
                elif images is None:
                    data, err = load_image(plan[i], opts.image)
                else:
                    data, err = next(images)
                r = rows[i]
                if data is None:
                    done.failed.append((i, err or ""))
                    continue
                sink.write(key, data, r.caption, _meta(r, job.split, job.task, source))
                if r.category:
                    done.categories.add(r.category)
            done.shards = sink.close()
            return done

        procs = opts.download.processes
        if procs > 1 and len(jobs) >= 2 * procs:  # whole shards in every process
            _warm([plan[i] for i in flat if i not in pre], opts.image)
            results = map_shards(write_shard, len(jobs), procs)
        else:  # few shards: images resized in a pool, shards written here
            todo = [plan[i] for i in flat if i not in pre]  # held-out images were read already
            images = load_images(todo, opts.image, procs)
            results = (write_shard(j, images) for j in range(len(jobs)))
        group_sets: dict[tuple[str, str, str | None], list[ShardSet]] = {}
        wrote: dict[tuple[str, str], list[int]] = {}  # the rows written, per set
        for job, done in zip(jobs, results):
            bar.update(len(job.rows))
            for i, err in done.failed:
                drop(_failure(err), rows[i], detail=f"{rows[i].where}: {err}")
            failed = {i for i, _ in done.failed}
            wrote.setdefault((job.split, job.task), []).extend(
                i for i in job.rows if i not in failed
            )
            if done.shards.count:
                report.kept[job.split] += done.shards.count
                cats[job.task] |= done.categories
                group_sets.setdefault((job.split, job.task, job.group), []).append(done.shards)
        by_set: dict[tuple[str, str], list[ShardSet]] = {}
        for (split, task, group), parts_ in group_sets.items():
            ss = join_sets(parts_)
            if group is not None:
                sub_sets[(split, task, group)] = ss
            by_set.setdefault((split, task), []).append(ss)
        written: dict[tuple[str, str], ShardSet] = {k: join_sets(v) for k, v in by_set.items()}
        bar.close()

        tasks: dict[str, TaskInfo] = {}
        final_order = []
        for t in order:
            tr = written.get(("train", t))
            if tr is None:
                report.warn(f"task '{t}' has no usable training pairs: left out of the stream")
                _leave_out_held(t, written, wrote, rows, tmp, drop, report)
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
        for w in getattr(rule, "warnings", []):
            report.warn(w)
        for (split, t), n in held.items():
            if t in tasks and (split, t) not in written:
                report.warn(
                    f"task '{t}': none of its {n} {split} pairs was written (see dropped.jsonl): "
                    f"it has no {split} set"
                )
        if not evals and not extra.get("benchmarks"):
            report.warn(
                "the stream has no evaluation set (no pair held out, or none readable): "
                "cvl eval has nothing to score on it"
            )
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


def _read_held_out(
    rows: list[Row], plan: dict[int, tuple], rule: SplitRule, opts: BuildOptions, drop: Dropper
) -> dict[int, bytes]:
    """Read the images of the held-out pairs the split rule drew at random (`rule.drawn`)
    before anything is written, so that these sets are drawn from pairs that read: one that
    does not (no image, unreadable) is dropped and replaced by a training pair of its task
    (and period) whose image reads, the first of a seeded order. Returns the images read,
    by row index (written from memory: nothing is read twice); the plan loses the dropped."""
    if not rule.drawn:
        return {}
    group = getattr(rule, "shard_group", None)

    def key(r: Row) -> tuple:
        return (r.task, group(r) if group is not None else None)

    held = [i for i, r in enumerate(rows) if id(r) in rule.drawn and r.split != "train"]
    got: dict[int, bytes] = {}

    def read(idx: list[int]) -> list[int]:
        """Read `idx` (those with an image); returns the ones that failed, dropped."""
        have = [i for i in idx if i in plan]
        bad = [i for i in idx if i not in plan]  # the download failed: already counted
        for i, (data, err) in zip(
            have, load_images([plan[i] for i in have], opts.image, opts.download.processes)
        ):
            if data is None:
                drop(_failure(err or ""), rows[i], detail=f"{rows[i].where}: {err}")
                del plan[i]
                bad.append(i)
            else:
                got[i] = data
        return bad

    failed = read(held)
    if not failed:
        return got
    want = {key(rows[i]) for i in failed}
    pool: dict[tuple, list[int]] = {}  # the training pairs of those tasks, in a seeded order
    for i, r in enumerate(rows):
        if r.split == "train" and i in plan and key(r) in want:
            pool.setdefault(key(r), []).append(i)
    rng = np.random.default_rng([opts.seed, 47])
    for k in sorted(pool, key=str):
        pool[k] = [pool[k][j] for j in rng.permutation(len(pool[k]))][::-1]  # pop() = first
    for i in failed:
        cand = pool.get(key(rows[i]), [])
        while cand:
            j = cand.pop()
            if not read([j]):
                rows[j].split = rows[i].split
                break
    return got


def _leave_out_held(
    task: str,
    written: dict[tuple[str, str], ShardSet],
    wrote: dict[tuple[str, str], list[int]],
    rows: list[Row],
    tmp: Path,
    drop: Dropper,
    report: BuildReport,
) -> None:
    """A task left out for want of training pairs takes its held-out sets with it: their
    shards are removed and their pairs counted as dropped (not kept), with a warning."""
    lost = []
    for split in SPLITS[1:]:
        ss = written.pop((split, task), None)
        if ss is None:
            continue
        for s in ss.shards:
            for f in (tmp / s, *map(Path, index_files(str(tmp / s)))):
                f.unlink(missing_ok=True)  # the shard and its index
        for i in wrote.get((split, task), []):
            drop("task_left_out", rows[i], detail=f"task '{task}' has no training pair")
            report.kept[split] -= 1
        lost.append(f"{split} {ss.count}")
    if lost:
        report.warn(f"task '{task}': its held-out pairs ({', '.join(lost)}) left out with it")


@dataclass
class _ShardJob:
    """One shard of a (split, task[, group]) set: its number and its rows, with their keys."""

    split: str
    task: str
    group: str | None
    rel: str
    number: int
    rows: list[int]
    keys: list[str]


@dataclass
class _ShardDone:
    """What writing a shard job gives back: its shards, failed images, categories written."""

    shards: ShardSet = field(default_factory=lambda: ShardSet([], 0))
    failed: list[tuple[int, str]] = field(default_factory=list)
    categories: set[str] = field(default_factory=set)


def _meta(r: Row, split: str, task: str, source: str) -> dict[str, Any]:
    """A sample's KEY.json: the source's metadata first (it never overrides the rest)."""
    return {
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


def _failure(err: str) -> str:
    """The drop reason of an image that did not load."""
    if err.startswith("undecodable base64"):
        return "bad_base64"
    return TOO_LARGE if err.startswith(TOO_LARGE) else "bad_image"


def _warm(items: list[tuple], image: ImageOptions) -> None:
    """Make img2dataset's resizer here (its imports take seconds), so the forked shard
    processes inherit it instead of each making its own."""
    from cvl.streams.resize import _resizer

    if any(it[0] != "cache" for it in items):  # only cached images skip the resizer
        _resizer(image)


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
