"""RWalk: Riemannian walk (Chaudhry et al. 2018; CTP appendix B.1; CTP code).

EWC's Fisher and SI's path integral together. Along task t (as SI): ω ← ω − g·Δθ with the
unregularised, rank-averaged gradient g. After the task:

    F ← t/(t+1)·F + 1/(t+1)·F_t                    (F_t: EWC's Fisher pass, `ewc.task_fisher`)
    s = ReLU(ω / (F·(θ_end − θ*)² + ξ)),   ξ = `xi` = 0.1   (the merged F, as the code)
    S ← (S + s)/2                                    (S starts at 0, as the code)

Loss on task t > 0: L_base + λ·Σ_k (F_k + S_k)(θ_k − θ*_k)², λ = `lam` = 1000 (CTP code, no ½).
F + S is formed once per task. After the last task neither F nor S is updated (the
Fisher pass would only serve a next task). Logged term: `rwalk`.
"""

from __future__ import annotations

import torch

from cvl.checks import NON_NEGATIVE_INT, POSITIVE_FLOAT
from cvl.methods.base import TaskContext
from cvl.methods.ewc import task_fisher
from cvl.methods.registry import register
from cvl.methods.regularizers import ParamRegularizer, is_last_task, merge_running_mean, note


@torch.no_grad()
def rwalk_scores(
    scores: list | None, w: list, fisher: list, start: list, end: list, xi: float
) -> list:
    """S ← (S + ReLU(ω/(F·Δθ² + ξ)))/2 (S = 0 when None), fused; returns S."""
    d = torch._foreach_sub(end, start)
    torch._foreach_mul_(d, d)
    torch._foreach_mul_(d, fisher)
    torch._foreach_add_(d, xi)
    s = torch._foreach_div(w, d)
    s = torch._foreach_clamp_min(s, 0.0)
    if scores is None:
        torch._foreach_mul_(s, 0.5)
        return s
    torch._foreach_add_(scores, s)
    torch._foreach_mul_(scores, 0.5)
    return scores


@register("rwalk")
class RWalk(ParamRegularizer):
    """RWalk: λ·Σ(F+S)(θ−θ*)², F = merged Fisher, S = averaged ReLU path scores (λ = 1000)."""

    defaults = {"lam": 1000.0, "xi": 0.1, "fisher_batches": 0}
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {"xi": POSITIVE_FLOAT, "fisher_batches": NON_NEGATIVE_INT}
    term = "rwalk"
    track_path = True
    persistent = ("fisher", "scores")
    in_task = ("w",)
    _fs: list | None = None  # F + S of the current task

    def before_task(self, ctx: TaskContext) -> None:
        super().before_task(ctx)
        f, s = self.get("fisher"), self.get("scores")
        self._fs = torch._foreach_add(f, s) if f is not None and s is not None else None

    def anchors(self):
        if self._fs is None or self.star is None:
            return []
        return [(self.star, self._fs, self.args["lam"], False)]

    def after_task(self, ctx: TaskContext) -> None:
        if is_last_task(ctx):
            note(ctx, self.name, "last task: no Fisher pass / path scores (no next task)")
        else:
            new = task_fisher(ctx, max_batches=int(self.args["fisher_batches"]))
            f = merge_running_mean(self.get("fisher"), new, ctx.task_index)
            self.lists["fisher"] = f
            end = [p.detach() for p in self.params(ctx)]
            self.lists["scores"] = rwalk_scores(
                self.get("scores"), self.lists["w"], f, self.star, end, self.args["xi"]
            )
            self.counters["tasks"] = ctx.task_index + 1
        self._fs = None
        self.end_task()
