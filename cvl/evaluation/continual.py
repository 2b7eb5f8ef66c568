"""Continual-learning metrics, each derived from a stored R matrix (one function per definition).

`R[i][j]` = metric of the model after training task i evaluated on task j's test set
(0-based; rows and columns in training order, T x T, higher is better, NaN = not evaluated).
`b[j]` = the same metric of the initial (zero-shot) model on task j, when the run saved its
initial weights. A function returns None when the entries it needs are missing (NaN) or when
T is too small for the definition (e.g. BWT needs T >= 2).

- `average_final`:      (1/T) sum_j R[T-1][j]                     (final model, all tasks)
- `average_seen`:       per step i, (1/(i+1)) sum_{j<=i} R[i][j]    (the ACC curve)
- `bwt_incclip`:        IncCLIP §4.4: 1/(N-1) sum_{i=2..N} (1/i) sum_{j=1..i} (A_j^i - A_j^j)
                        (1-based; the j = i term is 0 but still counts in 1/i)
- `bwt_standard`:       GEM (Lopez-Paz & Ranzato 2017): 1/(T-1) sum_{j<T-1} (R[T-1][j] - R[j][j])
- `forgetting`:         Chaudhry et al. 2018: f_j = max_{j<=l<T-1} R[l][j] - R[T-1][j], averaged
                        over j < T-1 (the max runs over the models that had already trained on j)
- `forgetting_rate`:    DHA §4.1: FR_t = (R[t][t] - R[T-1][t]) / R[t][t] for t < T-1, in percent
                        (the paper's tables print it x100); undefined (None) when R[t][t] = 0
- `average_forgetting_rate`: DHA: 1/(n-1) sum_{t<n-1} FR_t
- `fwt`:                GEM: 1/(T-1) sum_{i>=1} (R[i-1][i] - b[i]) (needs the zero-shot row b)
- `so_far_vs_final`:    CTP Fig. 4 vs Table 1, from the cumulative matrix C[i][k] = model after
                        task i on the merged test set of tasks 0..k: per step i, C[i][i] (so
                        far) and C[T-1][i] (the final model on the same merged set).

DHA's R_t^t is "the best main model in task T_t": in cvl that is the checkpoint saved at the
end of task t, i.e. R[t][t].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def as_matrix(R: Any) -> np.ndarray:
    """A float T x T array (None -> NaN); raises when it is not square."""
    a = np.array([[np.nan if v is None else float(v) for v in row] for row in R], dtype=float)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"R must be a square T x T matrix, got shape {a.shape}")
    return a


def _ok(*vals: float) -> bool:
    return all(v is not None and not math.isnan(v) for v in vals)


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


def average_final(R: Any) -> float | None:
    """Mean over tasks of the final model's metric."""
    a = as_matrix(R)
    row = a[-1]
    return _num(float(row.mean())) if _ok(*row) else None


def average_seen(R: Any) -> list[float | None]:
    """Per step i, the mean over the tasks seen so far (j <= i) of R[i][j]."""
    a = as_matrix(R)
    out = []
    for i in range(a.shape[0]):
        vals = a[i, : i + 1]
        out.append(float(vals.mean()) if _ok(*vals) else None)
    return out


def bwt_incclip(R: Any) -> float | None:
    """IncCLIP's BWT: 1/(N-1) sum_{i=2..N} (1/i) sum_{j=1..i} (A_j^i - A_j^j)."""
    a = as_matrix(R)
    n = a.shape[0]
    if n < 2:
        return None
    total = 0.0
    for i in range(1, n):  # 0-based step i = paper's i+1
        terms = [a[i, j] - a[j, j] for j in range(i + 1)]
        if not _ok(*terms):
            return None
        total += sum(terms) / (i + 1)
    return total / (n - 1)


def bwt_standard(R: Any) -> float | None:
    """GEM's BWT: mean over j < T-1 of R[T-1][j] - R[j][j]."""
    a = as_matrix(R)
    n = a.shape[0]
    if n < 2:
        return None
    terms = [a[n - 1, j] - a[j, j] for j in range(n - 1)]
    return float(np.mean(terms)) if _ok(*terms) else None


def forgetting_per_task(R: Any) -> list[float | None]:
    """f_j = max_{j <= l < T-1} R[l][j] - R[T-1][j] for every j < T-1."""
    a = as_matrix(R)
    n = a.shape[0]
    out: list[float | None] = []
    for j in range(n - 1):
        prev = a[j : n - 1, j]
        out.append(float(prev.max() - a[n - 1, j]) if _ok(*prev, a[n - 1, j]) else None)
    return out


def forgetting(R: Any) -> float | None:
    """Average forgetting (Chaudhry et al.) over the tasks before the last."""
    f = forgetting_per_task(R)
    return float(np.mean(f)) if f and all(v is not None for v in f) else None


def forgetting_rate_per_task(R: Any) -> list[float | None]:
    """DHA's FR_t = (R[t][t] - R[T-1][t]) / R[t][t] for t < T-1, in percent."""
    a = as_matrix(R)
    n = a.shape[0]
    out: list[float | None] = []
    for t in range(n - 1):
        if not _ok(a[t, t], a[n - 1, t]) or a[t, t] == 0:
            out.append(None)
        else:
            out.append(100.0 * float((a[t, t] - a[n - 1, t]) / a[t, t]))
    return out


def average_forgetting_rate(R: Any) -> float | None:
    """DHA's average FR: 1/(n-1) sum_{t<n-1} FR_t (None if any FR_t is undefined)."""
    fr = forgetting_rate_per_task(R)
    return float(np.mean(fr)) if fr and all(v is not None for v in fr) else None


def fwt(R: Any, zero_shot: Sequence[float | None] | None) -> float | None:
    """GEM's forward transfer: mean over i >= 1 of R[i-1][i] - b[i]; needs the zero-shot row."""
    if zero_shot is None:
        return None
    a = as_matrix(R)
    n = a.shape[0]
    if n < 2 or len(zero_shot) != n:
        return None
    terms = [a[i - 1, i] - (np.nan if zero_shot[i] is None else zero_shot[i]) for i in range(1, n)]
    return float(np.mean(terms)) if _ok(*terms) else None


def so_far_vs_final(C: Any) -> list[dict[str, float | None]]:
    """CTP's table: per step i, the model after task i and the final model on tasks 0..i.

    `C[i][k]` (k <= i) = model after task i on the merged test set of tasks 0..k (entries above
    the diagonal are ignored). Returns [{"step", "so_far", "final", "delta"}] with
    delta = final - so_far (negative = the final model lost ground on those tasks).
    """
    a = np.array([[np.nan if v is None else float(v) for v in row] for row in C], dtype=float)
    n = a.shape[0]
    out = []
    for i in range(n):
        so_far = _num(a[i, i]) if a.shape[1] > i else None
        final = _num(a[n - 1, i]) if a.shape[1] > i else None
        delta = final - so_far if so_far is not None and final is not None else None
        out.append({"step": i, "so_far": so_far, "final": final, "delta": delta})
    return out


def summary(R: Any, zero_shot: Sequence[float | None] | None = None) -> dict[str, Any]:
    """Every metric above for one R matrix (JSON-able)."""
    return {
        "average_final": average_final(R),
        "average_seen": average_seen(R),
        "bwt_incclip": bwt_incclip(R),
        "bwt_standard": bwt_standard(R),
        "forgetting": forgetting(R),
        "forgetting_per_task": forgetting_per_task(R),
        "forgetting_rate": average_forgetting_rate(R),
        "forgetting_rate_per_task": forgetting_rate_per_task(R),
        "fwt": fwt(R, zero_shot),
        "final_row": [_num(v) for v in as_matrix(R)[-1]],
    }
