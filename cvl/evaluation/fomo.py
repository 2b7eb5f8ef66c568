"""FoMo-in-Flux's headline metrics (Roth et al. 2024): knowledge accumulation, zero-shot
retention and their geometric mean, from a run's metrics.json.

As its code computes them (pseudope/fomo_in_flux: `utils/evaluation.py` `prepare_log_dict`,
`results_from_wandb_xid.py`), for every evaluated model (the initial weights, then the model
after each task):

- each dataset scores with its own metric: zero-shot classification accuracy (top-1 among the
  dataset's classes) for a classification dataset, recall@5 — the mean of image→text and
  text→image R@5 (its `RecallAtK`) — for a retrieval dataset;
- **knowledge accumulation** A_KA = the mean over the *adaptation* datasets (those the stream
  trains on: its `alldata-trainonly` mean over datasets, weighted 40 : 1 by the classification
  and retrieval counts in `results_from_wandb_xid.py`, i.e. one weight per dataset), over all
  of them at every evaluation, those not trained on yet included;
- **zero-shot retention** A_ZS = the same mean over the held-out datasets (its
  `evaluation.additional_datasets`, never trained on: `alldata-evalonly`);
- the geometric mean sqrt(A_KA · A_ZS) of each model's pair.

FoMo reports the pair of the initial model ("zero-shot point") and of the final model
(`--print-last-only`, on by default; its README's "averaged across tasks" is the mean over
datasets). In cvl terms: each task's test set is an adaptation dataset, scored by ZS-top1
when the task's images carry categories (a classification dataset) and by (TR@5 + IR@5) / 2
otherwise; the held-out sets are the stream's benchmarks (eval sets of no task; R@5) and
the `--zeroshot-folder` image folders (top-1). A model misses a value (None) when any of its
sets is missing; with no held-out set A_ZS and the geometric mean are None.
"""

from __future__ import annotations

import math
from typing import Any

from cvl.evaluation.markdown import fmt

ZS_KEY = "ZS-top1"  # classification datasets: zero-shot accuracy among the task's classes


def _r5(tr5: Any, ir5: Any) -> float | None:
    """FoMo's recall@5: the mean of the two directions."""
    return None if tr5 is None or ir5 is None else (float(tr5) + float(ir5)) / 2


def _mean(vals: list[float | None]) -> float | None:
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


def geometric_mean(ka: float | None, zs: float | None) -> float | None:
    """sqrt(A_KA · A_ZS); None when either is missing."""
    if ka is None or zs is None:
        return None
    return math.sqrt(max(0.0, ka) * max(0.0, zs))


def adaptation_kinds(m: dict[str, Any]) -> dict[str, str]:
    """Per task: `ZS-top1` (its test images carry categories: a classification dataset) or
    `R@5` (a retrieval dataset)."""
    rows = list((m.get("matrices") or {}).get(ZS_KEY) or [])
    if m.get("zero_shot_row"):
        rows.append(m["zero_shot_row"].get(ZS_KEY) or [])
    out = {}
    for j, t in enumerate(m["tasks"]):
        has_zs = any(j < len(r) and r[j] is not None for r in rows)
        out[t] = ZS_KEY if has_zs else "R@5"
    return out


def knowledge_accumulation(
    row: dict[str, list[float | None]], kinds: dict[str, str], tasks: list[str]
) -> float | None:
    """A_KA of one model: the mean over every task of its score (`row`: metric -> values
    per task, as one row of each R matrix)."""
    vals = []
    for j, t in enumerate(tasks):
        if kinds[t] == ZS_KEY:
            vals.append((row.get(ZS_KEY) or [None] * len(tasks))[j])
        else:
            none = [None] * len(tasks)
            vals.append(_r5((row.get("TR@5") or none)[j], (row.get("IR@5") or none)[j]))
    return _mean(vals)


def held_out_scores(m: dict[str, Any], label: str) -> dict[str, float | None]:
    """The held-out sets of model `label`: each benchmark's R@5 and each image folder's
    zero-shot top-1."""
    out: dict[str, float | None] = {}
    for b, bm in (m.get("benchmarks") or {}).items():
        rows, met = bm.get("rows") or [], bm.get("metrics") or {}
        if label not in rows:
            out[b] = None
            continue
        i = rows.index(label)
        tr5, ir5 = ((met.get(k) or [None] * len(rows))[i] for k in ("TR@5", "IR@5"))
        out[b] = _r5(tr5, ir5)
    for folder, r in ((m.get("folders") or {}).get(label) or {}).items():
        out[folder] = r.get("top1")
    folders = {f for per in (m.get("folders") or {}).values() for f in per}
    for f in folders - set(out):
        out[f] = None  # evaluated for another checkpoint, not this one
    return out


def fomo_summary(m: dict[str, Any]) -> dict[str, Any] | None:
    """metrics.json's "fomo": A_KA, A_ZS and their geometric mean for every evaluated model
    (init first, then the task checkpoints), the initial and the final model's, and which
    metric scored each set. None when no model has an A_KA (e.g. no R@5 was computed)."""
    tasks = m.get("tasks") or []
    if not tasks:
        return None
    kinds = adaptation_kinds(m)
    mats = m.get("matrices") or {}
    keys = [k for k in (ZS_KEY, "TR@5", "IR@5") if k in mats]
    rows: list[tuple[str, dict[str, list]]] = []
    if m.get("zero_shot_row"):
        rows.append(("init", {k: m["zero_shot_row"].get(k) or [] for k in keys}))
    for i, label in enumerate(m.get("rows") or []):
        rows.append((label, {k: mats[k][i] for k in keys}))
    labels, ka, zs, gm = [], [], [], []
    held: list[str] = []
    for label, row in rows:
        a = knowledge_accumulation(row, kinds, tasks)
        h = held_out_scores(m, label)
        held += [k for k in h if k not in held]
        z = _mean(list(h.values())) if h else None
        labels.append(label)
        ka.append(a)
        zs.append(z)
        gm.append(geometric_mean(a, z))
    if all(v is None for v in ka):
        return None

    def point(i: int) -> dict[str, float | None]:
        return {"ka": ka[i], "zs": zs[i], "gm": gm[i]}

    has_init = bool(labels) and labels[0] == "init"
    return {
        "rows": labels,
        "ka": ka,
        "zs": zs,
        "gm": gm,
        "init": point(0) if has_init else None,
        "final": point(len(labels) - 1) if len(labels) > int(has_init) else None,
        "adaptation": kinds,
        "held_out": held,
        "definition": "A_KA: mean over the stream's tasks of ZS-top1 (tasks with categories) or "
        "R@5 = (TR@5 + IR@5) / 2; A_ZS: mean over the held-out sets (benchmarks: R@5, "
        "--zeroshot-folder: top-1); GM = sqrt(A_KA · A_ZS) (FoMo-in-Flux)",
    }


def table_fomo(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    """summary.md's FoMo table: A_KA, A_ZS and GM of every evaluated model."""
    f = m.get("fomo") or fomo_summary(m)
    if not f:
        return None
    rows = [
        [label, fmt(a), fmt(z), fmt(g)]
        for label, a, z, g in zip(f["rows"], f["ka"], f["zs"], f["gm"])
    ]
    return ["model", "knowledge accumulation", "zero-shot retention", "geometric mean"], rows


#: `cvl eval --compare` columns: (column, field of the final model's point)
COMPARE_COLS = [("A_KA", "ka"), ("A_ZS", "zs"), ("GM (FoMo)", "gm")]


def compare_values(m: dict[str, Any]) -> dict[str, float | None]:
    """The final model's A_KA, A_ZS and GM for one run's row of the comparison (recomputed
    from metrics.json, so an evaluation written before these metrics existed has them too)."""
    f = fomo_summary(m)
    fin = (f or {}).get("final") or {}
    return {col: fin.get(field) for col, field in COMPARE_COLS}
