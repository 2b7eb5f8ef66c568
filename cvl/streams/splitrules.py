"""Split rules: step 2 of `pipeline.build_stream`, which assigns each row a task and a split.

``assign(rows, report) -> rows``: `ColumnSplit` (the task is a field of the row: P9D industries,
a table's task column), `InstanceSplit` (seeded random equal chunks with held-out val/test,
IncCLIP's instance split) and `ClassSplit` (tasks are groups of class labels, e.g. IncCLIP's
BEiT pseudo-label split); `resolve_order` applies the task order (step 3). Kept apart from the
build so that a source (timesplit.py) can define its own rule without importing the build.
`cvl.streams.pipeline` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cvl.errors import CvlError
from cvl.streams.rows import (
    Dropper,
    Row,
)
from cvl.streams.splitcore import SPLITS, balance_chunks, column_split, instance_split

EVAL_KIND = {"val": "pairs", "test": "pairs", "query": "query", "gallery": "gallery"}


# -- split rules ---------------------------------------------------------------------------------
class SplitRule:
    """Assigns every row a task (and, for rules that hold data out, a split)."""

    name = "rule"
    # `id`s of the held-out (val / test) rows the rule drew at random from a task's pairs,
    # valid after `assign`: the build replaces one whose image is unreadable by another pair
    # of the task (`pipeline.build_stream`); rows a source or an id list held out stay as given
    drawn: frozenset[int] | set[int] = frozenset()

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
        ok = np.zeros(len(rows), dtype=bool)
        for i, r in enumerate(rows):
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
            ok[i] = True
        self._seen = list(seen)
        of = {t: i for i, t in enumerate(self._seen)}
        task = np.array([of[r.task] if k else -1 for r, k in zip(rows, ok)], dtype=np.int32)
        split = np.array([SPLITS.index(r.split) if k else -1 for r, k in zip(rows, ok)], np.int8)
        a = column_split(
            task,
            split,
            len(self._seen),
            val=self.val,
            test=self.test,
            limit=self.limit,
            eval_limit=self.eval_limit,
            seed=self.seed,
        )
        self.unsampled += a.unsampled
        self.drawn = {*self.drawn, *(id(rows[i]) for i in np.flatnonzero(a.drawn))}
        keep = np.flatnonzero(a.task >= 0)
        for i in keep:
            rows[i].split = SPLITS[a.split[i]]
        # tasks in order, each split in SPLITS order, file order inside
        order = keep[np.lexsort((keep, a.split[keep], a.task[keep]))]
        return [rows[i] for i in order]

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
        presplit = None
        if self.presplit:
            presplit = np.full(len(rows), -1, np.int8)
            for i, r in enumerate(rows):
                if r.split not in SPLITS:
                    drop("unknown_split", r, detail=r.split)
                    continue
                presplit[i] = SPLITS.index(r.split)
        a = instance_split(
            len(rows),
            self.chunks,
            train=self.train,
            val=self.val,
            test=self.test,
            seed=self.seed,
            presplit=presplit,
        )
        self.unsampled += a.unsampled  # not used (not dropped: not asked for)
        self.got.update(a.got)
        keep = np.flatnonzero(a.task >= 0)
        for i in keep:
            rows[i].split, rows[i].task = SPLITS[a.split[i]], self.names[a.task[i]]
        if not self.presplit:
            self.drawn = {id(rows[i]) for i in np.flatnonzero(a.drawn)}
        # each split in SPLITS order, its chunks in order, file order inside a chunk
        return [rows[i] for i in keep[np.lexsort((keep, a.task[keep], a.split[keep]))]]

    def task_names(self) -> list[str]:
        return list(self.names)

    def summary(self) -> dict[str, Any]:
        return {"selected": dict(self.got), "unsampled": self.unsampled}

    def finalize(self, rows: list[Row], drop: Dropper) -> list[Row]:
        """Equal training chunks again after failed downloads: trim to the smallest chunk."""
        if self.chunks == 1 or not self.equal:
            return rows
        of = {t: i for i, t in enumerate(self.names)}
        task = np.array([of.get(r.task or "", -1) for r in rows], dtype=np.int32)
        split = np.array([SPLITS.index(r.split) for r in rows], dtype=np.int8)
        keep = balance_chunks(task, split, self.chunks, self.seed)
        n = int(min(((split == 0) & (task == c)).sum() for c in range(self.chunks)))
        for i in np.flatnonzero(~keep):
            drop("chunk_balance", rows[i], detail=f"trimmed to {n} per chunk")
        return [r for r, k in zip(rows, keep) if k]

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
        self.drawn = {id(r) for r in out if r.split == "test"}
        return out

    def task_names(self) -> list[str]:
        return list(self.names)

    def describe(self) -> str:
        return (
            f"class split: {self.n_classes} classes in {self.chunks} groups"
            + (" (seeded shuffle)" if self.shuffle else " (contiguous)")
            + (f"; {self.test} test pairs per task" if self.test else "")
        )


def check_split_options(
    time: bool,
    task_col: str | None,
    chunks: int,
    sample: int | None,
    limit: int | None,
    more: tuple[str, ...] = (),
) -> None:
    """The options that choose a split exclude each other (`table`, `shards`): --time-col (with
    `more`: other options a time split leaves no room for), --task-col, --chunks / --sample;
    --limit-per-task goes with the first two."""
    if time:
        clash = [*more, *(["--task-col"] if task_col else [])]
        clash += ["--sample"] if sample is not None else []
        clash += ["--chunks"] if chunks != 1 else []
        if clash:
            raise CvlError(f"--time-col makes one task per period: drop {', '.join(clash)}")
    if task_col and (sample is not None or chunks != 1):
        raise CvlError(
            "--task-col gives the tasks: use --limit-per-task instead of --sample/--chunks"
        )
    if not (task_col or time) and limit is not None:
        raise CvlError("--limit-per-task needs --task-col or --time-col (else use --sample)")


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
