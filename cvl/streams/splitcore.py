"""The split rules' draws on integer arrays: one implementation for every source.

The rules of `splitrules.py` (`InstanceSplit`, `ColumnSplit`) and `timesplit.py` (`TimeSplit`)
act on a list of `Row`s; `cvl build-stream shards` splits collections of tens of millions of
samples, where a Python object per sample would cost gigabytes and minutes. Both call the
functions here, which take items as positions 0..n-1 (the rows in their order, or the
samples of a collection in shard-then-file order) and their task / split / period as integer
arrays, and make the same seeded draws in the same order: the same items give the same
tasks and held-out sets whichever route built the stream.

Split codes are indices into `SPLITS` (train 0, val 1, test 2, query 3, gallery 4); -1 marks an
item in no task (not drawn, dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SPLITS = ("train", "val", "test", "query", "gallery")
TRAIN, VAL, TEST = 0, 1, 2


def sample_positions(n: int, sample: int, seed: int) -> np.ndarray:
    """A seeded random `sample` of positions 0..n-1, ascending (all when n <= sample): the
    two-pass draw of `tablefiles.collect` (`--sample` at read time)."""
    if n <= sample:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, 31337])
    return np.sort(rng.choice(n, size=sample, replace=False)).astype(np.int64)


def groups_of(codes: np.ndarray, n_groups: int) -> list[np.ndarray]:
    """Positions holding each code 0..n_groups-1, ascending (one stable sort; negative codes
    are in no group)."""
    codes = np.asarray(codes)
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(n_groups + 1))
    return [order[bounds[g] : bounds[g + 1]] for g in range(n_groups)]


@dataclass
class Assigned:
    """Per item: its task (index into the rule's task names; -1: none) and split code; the
    items held out at random (`drawn`: the build may replace one whose image does not read);
    the count of items not drawn (`unsampled`)."""

    task: np.ndarray
    split: np.ndarray
    drawn: np.ndarray
    unsampled: int = 0
    got: dict[str, int] = field(default_factory=dict)

    @classmethod
    def empty(cls, n: int) -> Assigned:
        return cls(
            np.full(n, -1, np.int32), np.full(n, -1, np.int8), np.zeros(n, dtype=bool), 0, {}
        )


def _chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """n positions in `chunks` contiguous, as-equal-as-possible parts (np.array_split's)."""
    parts = np.array_split(np.arange(n), chunks)
    out, start = [], 0
    for p in parts:
        out.append((start, start + len(p)))
        start += len(p)
    return out


def instance_split(
    n: int,
    chunks: int,
    *,
    train: int | None,
    val: int,
    test: int,
    seed: int,
    presplit: np.ndarray | None = None,
) -> Assigned:
    """IncCLIP's instance split (`InstanceSplit`): `val` / `test` items per chunk drawn first
    from one seeded permutation (or the items' own splits with `presplit`: split codes, -1 for
    none), at most `train` training items, each split's pool cut into `chunks` equal parts."""
    rng = np.random.default_rng([seed, 1234])
    a = Assigned.empty(n)
    pools: dict[str, np.ndarray] = {}
    if presplit is not None:
        for s_i, s in enumerate(SPLITS):
            idx = np.flatnonzero(np.asarray(presplit) == s_i)
            pools[s] = idx[rng.permutation(len(idx))]
    else:
        perm = rng.permutation(n)
        nt, nv = test * chunks, val * chunks
        empty = np.zeros(0, dtype=np.int64)
        pools = {
            "train": perm[nt + nv :],
            "val": perm[nt : nt + nv],
            "test": perm[:nt],
            "query": empty,
            "gallery": empty,
        }
    want = {"train": train, "val": val * chunks, "test": test * chunks}
    if presplit is not None:  # official val/test sets: all of them unless a size is asked for
        want["val"] = want["val"] or None
        want["test"] = want["test"] or None
    for s_i, (split, pool) in enumerate(pools.items()):
        limit = want.get(split)
        if limit is not None:
            a.unsampled += max(0, len(pool) - limit)
            pool = pool[:limit]
        a.got[split] = len(pool)
        for c, (lo, hi) in enumerate(_chunk_bounds(len(pool), chunks)):
            a.task[pool[lo:hi]] = c
            a.split[pool[lo:hi]] = s_i
    if presplit is None:
        a.drawn = (a.split == VAL) | (a.split == TEST)
    return a


def balance_chunks(task: np.ndarray, split: np.ndarray, chunks: int, seed: int) -> np.ndarray:
    """`InstanceSplit.finalize`: the training items of each chunk trimmed (seeded) to the
    smallest chunk's count, held-out sets untouched. Items in list order; returns a keep mask."""
    keep = np.ones(len(task), dtype=bool)
    if chunks == 1:
        return keep
    rng = np.random.default_rng([seed, 4242])
    parts = [np.flatnonzero((split == TRAIN) & (task == c)) for c in range(chunks)]
    n = min(len(p) for p in parts)
    for p in parts:
        out = np.ones(len(p), dtype=bool)
        out[rng.permutation(len(p))[:n]] = False
        keep[p[out]] = False
    return keep


def column_split(
    task: np.ndarray,
    split: np.ndarray,
    n_tasks: int,
    *,
    val: int,
    test: int,
    limit: int | None,
    eval_limit: int | None,
    seed: int,
) -> Assigned:
    """`ColumnSplit`: each item's task is given (0..n_tasks-1 in their order); per task `val` /
    `test` training items are held out (seeded), then at most `limit` training items and
    `eval_limit` of each evaluation split are kept (seeded random subsets)."""
    n = len(task)
    a = Assigned(np.full(n, -1, np.int32), np.asarray(split, np.int8).copy(), np.zeros(n, bool))
    by_task = groups_of(np.where(np.asarray(split) >= 0, task, -1), n_tasks)
    for t_i, items in enumerate(by_task):
        rng = np.random.default_rng([seed, 777, t_i])
        groups = {s: items[a.split[items] == s_i] for s_i, s in enumerate(SPLITS)}
        tr = groups["train"]
        if val or test:
            perm = tr[rng.permutation(len(tr))]
            te, va = perm[:test], perm[test : test + val]
            a.split[te], a.split[va] = TEST, VAL
            a.drawn[perm[: test + val]] = True
            groups["test"] = np.concatenate([groups["test"], te])
            groups["val"] = np.concatenate([groups["val"], va])
            groups["train"] = tr[a.split[tr] == TRAIN]
        for s in SPLITS:
            g = groups[s]
            lim = limit if s == "train" else eval_limit
            if lim is not None and len(g) > lim:
                a.unsampled += len(g) - lim
                g = g[np.sort(rng.choice(len(g), size=lim, replace=False))]
            a.task[g] = t_i
    a.split[a.task < 0] = -1
    return a


def time_split(
    period: np.ndarray,
    n_periods: int,
    head: int,
    held: np.ndarray | None,
    *,
    test: int,
    val: int,
    limit: int | None,
    seed: int,
) -> tuple[Assigned, list[dict[str, int]]]:
    """`TimeSplit`: `period` is each item's period (0..n_periods-1 in time order; negative:
    dropped); the first `head` periods make the first task, each later one a task. From every
    period the items `held` marks (an id list: TiC's retrieval uids) or `test` seeded random
    ones are held out as its test set, then `val` items per task; at most `limit` training
    items per task. Returns the assignment and, per period, its pairs / test / train counts."""
    n = len(period)
    a = Assigned.empty(n)
    by = groups_of(period, n_periods)
    tasks = [list(range(head))] + [[k] for k in range(head, n_periods)]
    counts: list[dict[str, int]] = [{} for _ in range(n_periods)]
    for ti, group in enumerate(tasks):
        rng = np.random.default_rng([seed, 2024, ti])
        rests = []
        for k in group:
            rs = by[k]
            a.task[rs] = ti
            if held is not None:
                h = rs[held[rs]]
            else:
                h = rs[np.sort(rng.permutation(len(rs))[:test])]
                a.drawn[h] = True
            a.split[rs] = TRAIN
            a.split[h] = TEST
            rests.append(rs[a.split[rs] == TRAIN])
            counts[k] = {"pairs": len(rs), "test": len(h)}
        train = np.concatenate(rests) if rests else np.zeros(0, np.int64)
        perm = rng.permutation(len(train))
        a.split[train[perm[:val]]] = VAL
        a.drawn[train[perm[:val]]] = True
        train = train[a.split[train] == TRAIN]
        if limit is not None and len(train) > limit:
            a.unsampled += len(train) - limit
            keep = train[np.sort(rng.choice(len(train), limit, replace=False))]
            a.split[train] = -1
            a.task[train] = -1
            a.split[keep] = TRAIN
            a.task[keep] = ti
            train = keep
        per = np.bincount(period[train], minlength=n_periods) if len(train) else None
        for k in group:
            if per is not None and per[k]:
                counts[k]["train"] = int(per[k])
    return a, counts
