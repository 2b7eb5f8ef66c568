"""MTIL's Transfer / Avg. / Last (ZSCL, ICCV'23, Table 1) and RAIL's X-TAIL, from accuracy
matrices, and their tables.

`R[i][j]` = zero-shot top-1 (percent) of the model after training task i on dataset j's test
set; rows are the T task checkpoints in training order (the initial weights are not a row),
columns the T datasets in the same order. As the ZSCL code's results notebook computes them
(`mtil/results.ipynb`, `statistics`: ``transfer = [mean(arr[j, i] for j in range(i)) for i in
1..10]``, ``avg = arr.mean(axis=0)``, ``last = arr[-1]``, each then averaged over datasets):

- Transfer_j = mean_{i<j} R[i][j], for j ≥ 1: the models that have not learned dataset j yet.
  The first dataset has no such model, hence no Transfer; Transfer = mean over j = 1..T−1.
- Avg_j = mean over all T rows of R[i][j]; Avg. = mean over j (the whole matrix's mean).
- Last_j = R[T−1][j]; Last = mean over j.

The notebook handles order II by permuting rows and columns of its order-I matrix into order
II; cvl's matrices are already in the stream's training order, so the same formulas apply.

**MTIL** uses the matrix of each dataset classified among its own classes with its template
ensemble (`ZS-top1`: the task identity is known). **X-TAIL** (RAIL, NeurIPS'24,
`primal_RAIL.py`) uses the same three formulas on the matrix of each test image classified
among the classes of *all* the stream's domains (1,100 for RAIL's ten; seen and unseen), with
no domain hint (`ZS-all-top1`); RAIL's code takes the upper triangle with `np.triu(k=1)` and
masks zeros, which also drops a true 0 % entry: here a 0 counts. Only a full T × T matrix
(every task trained) gets these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cvl.evaluation.markdown import fmt

#: (metrics.json key, R-matrix metric, title)
PROTOCOLS = (
    ("mtil", "ZS-top1", "MTIL (ZSCL Table 1): each test set among its own classes"),
    ("xtail", "ZS-all-top1", "X-TAIL (RAIL): every test image among all tasks' classes"),
)
COLUMNS = ("transfer", "avg", "last")
TITLES = {"transfer": "Transfer", "avg": "Avg.", "last": "Last"}


def _mean(vals: Sequence[float | None]) -> float | None:
    vals = list(vals)
    if not vals or any(v is None or math.isnan(v) for v in vals):
        return None
    return float(sum(vals) / len(vals))


def _square(R: Sequence[Sequence[float | None]]) -> list[list[float | None]]:
    rows = [list(r) for r in R]
    if not rows or any(len(r) != len(rows) for r in rows):
        raise ValueError(f"R must be a square T x T matrix, got {len(rows)} rows")
    return rows


def transfer_per_task(R: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Transfer_j = mean_{i<j} R[i][j]; None for the first task (no model before it)."""
    a = _square(R)
    return [None] + [_mean([a[i][j] for i in range(j)]) for j in range(1, len(a))]


def avg_per_task(R: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Avg_j = mean over every checkpoint i of R[i][j]."""
    a = _square(R)
    return [_mean([row[j] for row in a]) for j in range(len(a))]


def last_per_task(R: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Last_j = the final checkpoint's R[T-1][j]."""
    return [v if v is None else float(v) for v in _square(R)[-1]]


def summary(R: Sequence[Sequence[float | None]]) -> dict[str, Any]:
    """Transfer / Avg. / Last per task and their means (Transfer over tasks 1..T-1)."""
    tr, av, la = transfer_per_task(R), avg_per_task(R), last_per_task(R)
    return {
        "transfer": _mean(tr[1:]) if len(tr) > 1 else None,
        "avg": _mean(av),
        "last": _mean(la),
        "per_task": {"transfer": tr, "avg": av, "last": la},
    }


def block(matrices: dict[str, Any], tasks: list[str], n_rows: int) -> dict[str, Any]:
    """metrics.json's `mtil`: {"mtil": summary of ZS-top1, "xtail": of ZS-all-top1} for the
    matrices that are full T x T (one checkpoint per task, all evaluated)."""
    out: dict[str, Any] = {}
    if n_rows != len(tasks) or not tasks:
        return out
    for key, metric, title in PROTOCOLS:
        R = matrices.get(metric)
        if R and all(v is not None for row in R for v in row):
            out[key] = {"metric": metric, "title": title, "tasks": list(tasks), **summary(R)}
    return out


def table(m: dict[str, Any], key: str) -> tuple[list[str], list[list[str]]] | None:
    """Rows Transfer / Avg. / Last, a column per task and the mean (ZSCL Table 1's layout)."""
    b = (m.get("mtil") or {}).get(key)
    if not b:
        return None
    rows = [
        [TITLES[c], *(fmt(v) for v in b["per_task"][c]), fmt(b[c])]
        for c in ("transfer", "avg", "last")
    ]
    return ["", *b["tasks"], "mean"], rows


def sections(m: dict[str, Any]) -> list[tuple[str, tuple[list[str], list[list[str]]] | None]]:
    """The report sections (one per protocol present)."""
    return [
        (f"{b['title']}: Transfer / Avg. / Last", table(m, key))
        for key, b in (m.get("mtil") or {}).items()
    ]


def compare_columns(ms: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """`cvl eval --compare` columns (header, protocol key, field) for the protocols any run has."""
    keys = [k for k, *_ in PROTOCOLS if any((m.get("mtil") or {}).get(k) for m in ms)]
    prefix = {"mtil": "MTIL", "xtail": "X-TAIL"}
    return [(f"{prefix[k]} {TITLES[c]}", k, c) for k in keys for c in COLUMNS]
