"""TiC-CLIP's summary of a time-ordered run (Garg et al., ICLR 2024): in-distribution,
backward and forward transfer on the dynamic (per-period) retrieval sets.

TiC evaluates the model of every training step on the retrieval set of every period, a
matrix M (rows: the model after training step i, in time order; columns: the periods, in time
order; TiC-DataComp: 7 steps × 9 years), whose entries are DataComp's ``mean_recall@1``:

    M[i][j] = (TR@1 + IR@1) / 2    (image→text and text→image R@1 on period j's set, percent)

Each entry is compared with the *last* period step i trained on, p(i) (a step merging several
periods, TiC's first 2014–2016 step, is the model "of 2016"):

- in-distribution (ID): the entries with j = p(i) (the diagonal);
- backward transfer: the entries with j < p(i) (the lower triangle: periods already past);
- forward transfer: the entries with j > p(i) (the upper triangle: periods still to come).

Each summary is the mean over *all* its entries (pooled over rows), as TiC averages the
triangles of the matrix; `per_row` keeps each row's own means for other averages. These are
absolute scores (higher is better), not differences as GEM's BWT/FWT. A run with a single
checkpoint (plain `joint`: the final Oracle) has one row, so no forward transfer.

The layout (periods, the periods of each task, the benchmark holding each period's set)
comes from the stream's ``time`` field (`cvl.streams.timesplit`); the scores from each
checkpoint's benchmark results. Nothing here is re-evaluated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cvl.evaluation.markdown import fmt

METRIC = "mR@1"
METRIC_NOTE = (
    "mR@1 = (TR@1 + IR@1) / 2 on each period's retrieval set (DataComp's mean_recall@1, "
    "as TiC-CLIP); ID = entries of the period each model last trained on, backward = earlier "
    "periods, forward = later periods; each the mean over all its matrix entries"
)
KINDS = ("id", "backward", "forward")
# compare columns: (header, key of `summary`)
COMPARE_COLS = [("ID (TiC)", "id"), ("backward (TiC)", "backward"), ("forward (TiC)", "forward")]


def relations(row_periods: Sequence[int], n_columns: int) -> list[list[str]]:
    """Per matrix entry: "id", "backward" or "forward"; `row_periods[i]` = column index of
    the last period row i trained on."""
    return [
        ["id" if j == p else "backward" if j < p else "forward" for j in range(n_columns)]
        for p in row_periods
    ]


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def _finite(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def summary(M: Sequence[Sequence[float | None]], row_periods: Sequence[int]) -> dict[str, Any]:
    """ID / backward / forward transfer of matrix `M` (pooled means over the entries of each
    kind; None where a kind has no evaluated entry) and each row's own means."""
    rel = relations(row_periods, len(M[0]) if M else 0)
    pooled: dict[str, list[float]] = {k: [] for k in KINDS}
    per_row = []
    for row, kinds in zip(M, rel):
        mine: dict[str, list[float]] = {k: [] for k in KINDS}
        for v, k in zip(row, kinds):
            if _finite(v):
                mine[k].append(float(v))
                pooled[k].append(float(v))
        per_row.append({k: _mean(mine[k]) for k in KINDS})
    return {**{k: _mean(pooled[k]) for k in KINDS}, "per_row": per_row, "relation": rel}


def mean_r1(res: dict[str, Any] | None) -> float | None:
    """DataComp's mean_recall@1 of one set's retrieval results (None when not evaluated)."""
    if not res or not _finite(res.get("TR@1")) or not _finite(res.get("IR@1")):
        return None
    return 0.5 * (float(res["TR@1"]) + float(res["IR@1"]))


def tic_table(
    manifest: Any, rows: list[tuple[str, str | None]], results: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """metrics.json's ``tic``: the matrix of every task checkpoint on every period's retrieval
    set and its summary. `rows`: (checkpoint label, task) in training order, the initial
    weights with task None (their row is kept apart: they trained on no period). None for a
    stream without a time layout."""
    t = getattr(manifest, "time", None) or {}
    ev = t.get("eval") or {}
    if not ev:
        return None
    periods = [p for p in t["periods"] if p in ev]
    col = {p: j for j, p in enumerate(periods)}

    def row_of(label: str) -> list[float | None]:
        b = (results.get(label) or {}).get("benchmarks") or {}
        return [mean_r1(b.get(ev[p])) for p in periods]

    task_rows = [(lab, task) for lab, task in rows if task is not None and lab in results]
    last = [t["tasks"][task][-1] for _, task in task_rows]
    # a task whose periods have no retrieval set: its last period with one, or before them all
    row_periods = []
    for p in last:
        earlier = [q for q in t["periods"][: t["periods"].index(p) + 1] if q in col]
        row_periods.append(col[earlier[-1]] if earlier else -1)
    M = [row_of(lab) for lab, _ in task_rows]
    init = next((lab for lab, task in rows if task is None and lab in results), None)
    out = {
        "metric": METRIC,
        "note": METRIC_NOTE,
        "periods": periods,
        "benchmarks": [ev[p] for p in periods],
        "rows": [lab for lab, _ in task_rows],
        "row_periods": last,
        "matrix": M,
        "zero_shot_row": row_of(init) if init else None,
    }
    out.update(summary(M, row_periods) if M else dict.fromkeys(KINDS))
    return out


def time_benchmarks(m: dict[str, Any]) -> set[str]:
    """The benchmarks of metrics `m` that are per-period retrieval sets (shown as the TiC
    table, not one by one)."""
    return set((m.get("tic") or {}).get("benchmarks") or [])


def table_tic(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    """summary.md's TiC table: mR@1 of each checkpoint on each period (the period a model
    last trained on in brackets), then ID / backward / forward."""
    tic = m.get("tic")
    if not tic or not tic.get("matrix"):
        return None
    rows = []
    if tic.get("zero_shot_row"):
        rows.append(["init (zero-shot)", *(fmt(v) for v in tic["zero_shot_row"]), "", "", ""])
    for lab, row, kinds, own in zip(tic["rows"], tic["matrix"], tic["relation"], tic["per_row"]):
        cells = [f"[{fmt(v)}]" if k == "id" else fmt(v) for v, k in zip(row, kinds)]
        rows.append([f"after {lab}", *cells, *(fmt(own[k]) for k in KINDS)])
    rows.append(["all (pooled)", *([""] * len(tic["periods"])), *(fmt(tic[k]) for k in KINDS)])
    return ["model \\ period", *tic["periods"], "ID", "backward", "forward"], rows


def compare_values(m: dict[str, Any]) -> dict[str, float | None]:
    """The --compare columns of one run (None without a time layout)."""
    tic = m.get("tic") or {}
    return {h: tic.get(k) for h, k in COMPARE_COLS}
