"""A stream over shards it did not write: the collection, its row selections, its copies.

`cvl build-stream shards` (`cvl.streams.shards`) splits a webdataset collection's samples into
tasks; this module holds what it reads and writes:

- `Collection`: the shards (`cvl.data.shardlist`: folders, patterns, URLs), indexed (missing
  indexes built in parallel, or read under an index prefix), their samples as `Entries`;
- `write_rows`: a task's training samples in place: the shards holding them and the
  positions of the samples among those shards' usable samples, as an integer array file
  beside stream.json (4 B a sample below 2^32 samples; `cvl.data.selection` reads it back);
- `copy_held_out`: evaluation sets are copied (small; cvl's KEY.json with id, task, split,
  category, period), each held-out sample checked to read first: one drawn at random that
  does not is replaced by a training sample of its task (and period), as the other sources do;
- `source_entry`: the manifest's `sources` record of the collection (``sources/shards`` is a
  link to a local collection, or stands for its URL);
- `write_stream`: a split (`Split`: each sample's task, split and period as arrays, made by
  `cvl.streams.shards`) written as the stream's sets and manifest, with the build report's
  counts (`Drops`: dropped samples by reason, with example ids).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cvl.data.index import TABLE, Entries, ensure_indexed, is_remote
from cvl.errors import CvlError
from cvl.streams.manifest import EvalSet, Manifest, ShardSet, TaskInfo
from cvl.streams.pipeline import BuildOptions, task_folders, time_counts
from cvl.streams.rows import clean_text
from cvl.streams.splitcore import SPLITS, TEST, TRAIN, VAL
from cvl.streams.splitrules import EVAL_KIND
from cvl.streams.writer import BuildReport

SOURCE = "shards"
LINK = "sources/shards"  # the collection as the manifest's shard entries name it


@dataclass
class Collection:
    """A webdataset collection, indexed: shards in order, usable samples per shard."""

    shards: list[str]
    root: str
    index_prefix: str | None
    every: Entries
    counts: np.ndarray
    starts: np.ndarray  # first position of each shard's samples (len(shards) + 1 entries)
    left_out: dict[str, int] = field(default_factory=dict)

    @property
    def sids(self) -> np.ndarray:
        return self.every.parts[0][1] if self.every.parts else np.zeros(0, np.int64)

    def rel(self, shard: str) -> str:
        """A shard's manifest entry (through `LINK`)."""
        return f"{LINK}/{shard[len(self.root.rstrip('/')) + 1 :]}"


def open_collection(
    inputs: list[str],
    index_prefix: str | None,
    log: Callable[[str], None],
    progress: bool,
) -> Collection:
    """List, index (what is missing, in parallel, with progress) and read a collection."""
    from cvl.data.shardlist import collection_root, list_shards, use_prefix
    from cvl.progress import progress_bar

    shards = list_shards(inputs)
    root = use_prefix(index_prefix, shards) if index_prefix else collection_root(shards)
    if index_prefix and not is_remote(index_prefix):
        index_prefix = os.path.abspath(index_prefix)
    log(f"shards: {len(shards)} shard(s) under {root}")
    bar = progress_bar(total=len(shards), unit="shard", desc="indexing", show=progress)
    ensure_indexed(shards, remote=True, done=lambda n: bar.update(1))
    bar.close()
    every = Entries.of_shards(shards)
    sids = every.parts[0][1]
    counts = np.array([TABLE.counts[int(s)] for s in sids], dtype=np.int64)
    left: dict[str, int] = {}
    for s in sids:
        for _, reason in TABLE.skipped[int(s)]:
            left[reason] = left.get(reason, 0) + 1
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Collection(shards, root, index_prefix, every, counts, starts, left)


def write_rows(c: Collection, pos: np.ndarray, path: Path) -> ShardSet:
    """A training set in place: the shards holding the samples at `pos` (ascending positions
    in the collection) and the samples' positions among those shards' samples, saved to
    `path` (module doc). The ShardSet's `rows` is left to the caller (a path in the stream)."""
    pos = np.asarray(pos, dtype=np.int64)
    shard_of = np.searchsorted(c.starts, pos, side="right") - 1
    listed = np.unique(shard_of)
    listed_starts = np.concatenate([[0], np.cumsum(c.counts[listed])]).astype(np.int64)
    rows = pos - c.starts[shard_of] + listed_starts[np.searchsorted(listed, shard_of)]
    of = int(listed_starts[-1])
    dtype = np.uint32 if of < 2**32 else np.int64
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, rows.astype(dtype), allow_pickle=False)
    return ShardSet([c.rel(c.shards[i]) for i in listed], len(pos), of=of)


def readable(entries: Entries) -> np.ndarray:
    """Which samples read: the image decodes, the caption is non-empty UTF-8."""
    from cvl.data.reader import PairDataset

    ds = PairDataset(entries)
    ok = np.ones(len(entries), dtype=bool)
    for i in range(len(entries)):
        try:
            ds.read_raw(i)
        except Exception:  # noqa: BLE001 - corrupt image, bad text: not usable for evaluation
            ok[i] = False
    return ok


def replace_unreadable(
    c: Collection,
    held: np.ndarray,
    drawn: np.ndarray,
    pool: np.ndarray,
    seed: int,
    drop: Callable[[str, np.ndarray], None],
) -> tuple[np.ndarray, np.ndarray]:
    """Held-out positions `held` of one set whose samples read: one that does not is dropped
    (``bad_image``) and, when the rule drew it at random (`drawn`), replaced by the first of
    `pool` (training samples of its task and period) in a seeded order that reads (one that
    does not is dropped too). Returns (held, the pool's positions used up)."""
    ok = readable(c.every.take(held)) if len(held) else np.zeros(0, bool)
    if ok.all():
        return held, np.zeros(0, np.int64)
    bad = held[~ok]
    drop("bad_image", bad)
    keep = list(held[ok])
    want = int(drawn[bad].sum())
    used = []
    for p in pool[np.random.default_rng([seed, 47]).permutation(len(pool))]:
        if want == 0:
            break
        used.append(p)
        if readable(c.every.take([p]))[0]:
            keep.append(p)
            want -= 1
        else:
            drop("bad_image", np.array([p]))
    return np.sort(np.array(keep, dtype=np.int64)), np.array(used, dtype=np.int64)


def copy_set(
    c: Collection,
    pos: np.ndarray,
    root: Path,
    rel: str,
    meta: Callable[[int, dict[str, Any]], dict[str, Any]],
    shard_size: int,
    processes: int,
) -> ShardSet:
    """The samples at `pos` copied into ``root/rel/*.tar`` (`parallel.copy_entries`); `meta`
    gets the position in the collection."""
    from cvl.streams.parallel import copy_entries

    pos = np.asarray(pos, dtype=np.int64)
    return copy_entries(
        c.every.take(pos),
        root,
        rel,
        lambda i, own: meta(int(pos[i]), own),
        shard_size,
        processes,
    )


def source_entry(c: Collection, folder: Path) -> dict[str, Any]:
    """The manifest's record of the collection; a local one is linked at `folder/LINK`."""
    entry: dict[str, Any] = {"name": "shards", "link": LINK, "kind": "webdataset collection"}
    if is_remote(c.root):
        entry["url"] = c.root
    else:
        entry["path"] = c.root
        link = folder / LINK
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            raise CvlError(f"{link}: exists")
        os.symlink(c.root, link, target_is_directory=True)
    if c.index_prefix:
        entry["index"] = c.index_prefix
    return entry


class Drops:
    """Samples dropped by reason (counts and the first ids as examples: `BuildReport`)."""

    def __init__(self, report: BuildReport, keep: np.ndarray, ids: Any) -> None:
        self.report, self.keep, self.ids = report, keep, ids

    def __call__(self, reason: str, pos: np.ndarray, detail: Any = None) -> None:
        pos = np.asarray(pos, dtype=np.int64)
        if not len(pos):
            return
        self.keep[pos] = False
        self.report.dropped[reason] += len(pos)
        ex = self.report.examples.setdefault(reason, [])
        for p in pos[: max(0, self.report.max_examples - len(ex))]:
            d = detail(int(p)) if detail else ""
            ex.append(f"{self.ids[int(p)].as_py()}" + (f": {d}" if d else ""))


@dataclass
class Split:
    """What a split rule made of the samples: per sample its task (index into `names`; -1:
    none), split code, whether it was held out at random, and its period (time splits)."""

    rule: Any
    names: list[str]
    task: np.ndarray
    split: np.ndarray
    drawn: np.ndarray
    period: np.ndarray | None = None
    labels: list[str] | None = None  # period labels by index (time splits)


def why(drop: Drops) -> str:
    top = drop.report.dropped.most_common(4)
    return "dropped: " + (", ".join(f"{k} {v}" for k, v in top) if top else "nothing")


class _Writer:
    """Writes a split's sets: held-out sets copied (unreadable ones replaced), training sets
    in place or copied; collects the ShardSets the manifest lists."""

    def __init__(
        self, c: Collection, tmp: Path, opts: BuildOptions, drop: Drops, sp: Split, cols: dict
    ) -> None:
        self.c, self.tmp, self.opts, self.drop, self.sp, self.cols = c, tmp, opts, drop, sp, cols
        self.sets: dict[tuple[str, str, str | None], ShardSet] = {}
        self.written: dict[tuple[str, str], ShardSet] = {}

    def meta(self, task: str, split: str) -> Any:
        """A copied sample's KEY.json: its own fields, then cvl's (id, task, split, ...)."""
        ids, cats, sp = self.cols["id"], self.cols.get("category"), self.sp

        def f(p: int, own: dict[str, Any]) -> dict[str, Any]:
            m = {**own, "id": ids[p].as_py(), "task": task, "source": SOURCE, "split": split}
            m["category"] = clean_text(cats[p].as_py()) if cats is not None else None
            if sp.period is not None and sp.labels is not None and sp.period[p] >= 0:
                m["period"] = sp.labels[sp.period[p]]
            return m

        return f

    def groups(self, pos: np.ndarray, task: str) -> list[tuple[str | None, np.ndarray]]:
        """A set's positions by period when its task spans several (a sub-folder each)."""
        periods = (getattr(self.sp.rule, "task_periods", None) or {}).get(task) or []
        if self.sp.period is None or len(periods) <= 1:
            return [(None, pos)]
        at = {lab: i for i, lab in enumerate(self.sp.labels or [])}
        return [(p, pos[self.sp.period[pos] == at[p]]) for p in periods]

    def held_out(
        self, task: str, folder: str, s_i: int, pos: np.ndarray, train: np.ndarray
    ) -> np.ndarray:
        """Copy one held-out set (by period); returns the training positions left."""
        split, parts = SPLITS[s_i], []
        groups = self.groups(pos, task)
        pools = dict(self.groups(train, task))
        for g, held in groups:
            held, used = replace_unreadable(
                self.c, held, self.sp.drawn, pools[g], self.opts.seed, self.drop
            )
            train = np.setdiff1d(train, used)
            rel = f"eval/{split}/{folder}" + (f"/{g}" if g is not None else "")
            ss = self.copy(held, rel, task, split)
            self.sets[(split, task, g)] = ss
            parts.append(ss)
        whole = ShardSet([s for p in parts for s in p.shards], sum(p.count for p in parts))
        self.written[(split, task)] = self.sets[(split, task, None)] = whole
        return train

    def copy(self, pos: np.ndarray, rel: str, task: str, split: str) -> ShardSet:
        o = self.opts
        return copy_set(
            self.c, pos, self.tmp, rel, self.meta(task, split), o.shard_size, o.download.processes
        )

    def train(self, task: str, folder: str, pos: np.ndarray, copy: bool) -> ShardSet:
        if copy:
            tr = self.copy(pos, f"train/{folder}", task, "train")
        else:
            tr = write_rows(self.c, pos, self.tmp / f"{folder}.rows.npy")
            tr.rows = f"{folder}.rows.npy"
        self.sets[("train", task, None)] = tr
        for g, p in self.groups(pos, task):
            if g is not None:
                self.sets[("train", task, g)] = ShardSet([], len(p))  # per-period counts
        return tr


def write_stream(
    c: Collection,
    tmp: Path,
    opts: BuildOptions,
    report: BuildReport,
    drop: Drops,
    sp: Split,
    order: list[str],
    cols: dict[str, Any],
    copy: bool,
) -> Manifest:
    """The stream's sets and manifest (saved by the caller)."""
    folders = task_folders(order)
    w = _Writer(c, tmp, opts, drop, sp, cols)
    live = (sp.task >= 0) & drop.keep
    tasks: dict[str, TaskInfo] = {}
    for name in order:
        k = sp.names.index(name)
        mine = live & (sp.task == k)
        train = np.flatnonzero(mine & (sp.split == TRAIN))
        if not len(train):
            report.warn(f"task '{name}' has no usable training pairs: left out of the stream")
            continue
        for s_i in (VAL, TEST):
            held = np.flatnonzero(mine & (sp.split == s_i))
            if len(held):
                train = w.held_out(name, folders[name], s_i, held, train)
        for s_i in (VAL, TEST):
            if (SPLITS[s_i], name) in w.written:
                report.kept[SPLITS[s_i]] += w.written[(SPLITS[s_i], name)].count
        report.kept["train"] += len(train)
        tasks[name] = TaskInfo(
            name=name,
            train=w.train(name, folders[name], train, copy),
            categories=_categories(cols.get("category"), train),
        )
    if not tasks:
        raise CvlError(f"{SOURCE}: no task has usable training pairs ({why(drop)})")
    final = [t for t in order if t in tasks]
    evals = {}
    for s_i in (VAL, TEST):
        per = {t: w.written[(SPLITS[s_i], t)] for t in final if (SPLITS[s_i], t) in w.written}
        if per:
            evals[SPLITS[s_i]] = EvalSet(EVAL_KIND[SPLITS[s_i]], per)
    extra = sp.rule.manifest_extra(w.sets, final) if hasattr(sp.rule, "manifest_extra") else {}
    for msg in getattr(sp.rule, "warnings", []):
        report.warn(msg)
    if not evals and not extra.get("benchmarks"):
        report.warn(
            "the stream has no evaluation set (no pair held out): cvl eval has nothing to score"
        )
    where = "copied" if copy else "read in place (rows of the source shards)"
    m = Manifest(
        name=opts.name or Path(opts.out).name,
        source=SOURCE,
        split_rule=f"{sp.rule.describe()}; training sets {where}",
        seed=opts.seed,
        task_order=final,
        tasks=tasks,
        eval_sets=evals,
        benchmarks=extra.get("benchmarks") or {},
        time=extra.get("time"),
        sources=[] if copy else [source_entry(c, tmp)],
    )
    report.notes["task_order"] = final
    report.notes["counts"] = {
        s: {t: w.written[(s, t)].count for t in final if (s, t) in w.written}
        for s in SPLITS[1:]
        if any((s, t) in w.written for t in final)
    } | {"train": {t: tasks[t].train.count for t in final}}
    report.notes["selected"] = sp.rule.summary()
    report.notes["collection"] = {
        "root": c.root,
        "shards": len(c.shards),
        "usable_samples": len(c.every),
        "left_out_when_indexed": c.left_out,
    }
    if not copy:
        n_train = sum(t.train.count for t in tasks.values())
        rows = sum((tmp / t.train.rows).stat().st_size for t in tasks.values() if t.train.rows)
        report.notes["in_place"] = {
            "training_samples": n_train,
            "rows_bytes": rows,
            "rows_bytes_per_sample": round(rows / max(1, n_train), 3),
        }
    if m.time:
        report.notes["time"] = time_counts(m, w.sets)
    return m


def _categories(cats: Any, pos: np.ndarray) -> list[str] | None:
    """The distinct categories of a task's training samples (None without --category-col)."""
    if cats is None:
        return None
    import pyarrow as pa

    vals = cats.take(pa.array(pos)).unique().to_pylist()
    return sorted({c for c in (clean_text(v) for v in vals) if c}) or None
