"""The parsed `--budget` and its arithmetic: `parse_budget`, the `--budget-arg` options
(`budget_options`), each task's share and the steps it buys (`task_share`, `derive_steps`,
`charged_cost`). What the options mean: `cvl.train.budget`'s docstring.

No measurement here: the run's plan (plan.py) and the learning-rate schedule
(schedules.py) need a task's share before anything is measured, and import this module rather
than budget.py, which measures steps with the optimizer (optim.py -> schedules.py).
`cvl.train.budget` re-exports every name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cvl.errors import CvlError
from cvl.train.memory import MEASURES

KINDS = ("samples", "tflops", "maf")
_SPEC = re.compile(r"^(samples|tflops|maf)=([0-9.eE+-]+)(/task)?$")


@dataclass(frozen=True)
class Budget:
    """A parsed `--budget` value."""

    kind: str  # samples | tflops | maf
    amount: float
    per_task: bool
    spec: str

    @property
    def unit(self) -> str:
        return {"samples": "samples", "tflops": "TFLOPs", "maf": "MAF (memory-adjusted TFLOPs)"}[
            self.kind
        ]


def parse_budget(spec: str | None) -> Budget | None:
    """`samples=N`, `tflops=N`, `maf=N`, each optionally `/task`; None for no budget."""
    if spec is None or str(spec).strip() == "":
        return None
    s = str(spec).strip().replace(" ", "")
    m = _SPEC.match(s)
    amount = None
    if m:
        try:
            amount = float(m.group(2))
        except ValueError:
            amount = None
    if m is None or amount is None or not math.isfinite(amount) or amount <= 0:
        raise CvlError(
            f"--budget {spec!r}: expected samples=N, tflops=N or maf=N with N > 0, for the "
            "whole stream, or with /task for each task (e.g. tflops=2.5 or samples=20000/task)"
        )
    return Budget(m.group(1), amount, bool(m.group(3)), s)


# -- options (--budget-arg) --------------------------------------------------------------------
OPTIONS: dict[str, tuple[str, ...]] = {
    "split": ("equal", "pairs"),
    "extras": ("step", "task", "none"),
    "rounding": ("nearest", "floor"),
    "reference": ("full", "tune"),
    "memory": ("auto", *MEASURES),
}
#: FoMo-in-Flux's MAF (module doc)
FOMO = {
    "split": "equal",
    "extras": "step",
    "rounding": "nearest",
    "reference": "full",
    "memory": "auto",
}
#: cvl's choices for samples and tflops
CVL = {"split": "pairs", "extras": "none", "rounding": "floor"}
MAF_ONLY = ("reference", "memory")


def budget_options(b: Budget | None, given: Mapping[str, Any] | None) -> dict[str, str]:
    """The options of budget `b`: its kind's defaults (module doc) overridden by `given`
    (`--budget-arg NAME=VALUE`); one-line errors for unknown names, values, or an option its
    kind has no use for."""
    given = dict(given or {})
    if b is None:
        if given:
            raise CvlError("--budget-arg given without --budget")
        return {}
    out = dict(FOMO if b.kind == "maf" else CVL)
    for k, v in given.items():
        v = str(v).strip().lower()
        if k not in OPTIONS:
            raise CvlError(f"--budget-arg {k}: unknown (options: {', '.join(OPTIONS)})")
        if v not in OPTIONS[k]:
            raise CvlError(f"--budget-arg {k}={v}: expected {' or '.join(OPTIONS[k])}")
        if k in MAF_ONLY and b.kind != "maf":
            raise CvlError(f"--budget-arg {k} applies to maf budgets only (got {b.kind})")
        if k == "extras" and b.kind == "samples" and v != "none":
            raise CvlError("--budget-arg extras: a samples budget counts samples, not FLOPs")
        out[k] = v
    return out


# -- shares and steps ------------------------------------------------------------------------------
def task_share(
    b: Budget,
    counts: dict[int, int],
    ti: int,
    n_tasks: int,
    single_task: bool,
    split: str = "pairs",
    seen: bool = False,
) -> float:
    """Task `ti`'s part of the budget (in the spec's unit). `counts`: training pairs of the
    trained tasks, by index; `split`: `equal` over them (FoMo-in-Flux) or by their `pairs`.
    `seen`: the task stands for tasks 0..ti (TiC-CLIP's Oracle, `joint restart=true`: step t
    retrains on everything with t × the per-step compute)."""
    if b.per_task:
        return b.amount * (n_tasks if single_task else ti + 1 if seen else 1)
    if split == "equal":
        k = sum(1 for i in counts if i <= ti) if seen else 1
        return b.amount * k / len(counts) if counts else 0.0
    total = sum(counts.values())
    mine = sum(c for i, c in counts.items() if i <= ti) if seen else counts[ti]
    return b.amount * mine / total if total else 0.0


def derive_steps(
    share: float, per_step: float, upper: int, rounding: str = "floor"
) -> tuple[int, int]:
    """(steps the budget buys (at least 1), steps to train (≤ `upper`)): share / per_step
    rounded down (`floor`) or to the nearest step (`nearest`, FoMo-in-Flux's Tab. 4)."""
    if per_step <= 0:
        return upper, upper
    x = share / per_step
    n = math.floor(x + 0.5) if rounding == "nearest" else math.floor(x * (1 + 1e-9))
    n = max(1, n)
    return n, min(n, upper)


def charged_cost(
    step: float, extras: float, memory_ratio: float = 1.0, charge: str = "none"
) -> tuple[float, float]:
    """(cost per step, cost per task before the steps) of a method whose step costs `step`
    FLOPs and whose end-of-task work `extras`, at `memory_ratio` (its memory / full fine-tuning's;
    1 for tflops). FoMo-in-Flux's MAF (`charge="step"`): ((step + extras) × ratio, 0)."""
    if charge == "step":
        return (step + extras) * memory_ratio, 0.0
    if charge == "task":
        return step * memory_ratio, extras * memory_ratio
    return step * memory_ratio, 0.0
